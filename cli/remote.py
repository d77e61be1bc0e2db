"""``pdserve generate`` and ``pdserve status`` against a running server, over gRPC (router.client)."""

from __future__ import annotations

import argparse
import json
import sys

MEMORY_FIELDS = ("weights_gb", "packed_copies_gb", "kv_cache_gb", "other_gb", "rss_gb", "pss_gb", "peak_rss_gb")
STATUS_KEYS = ("worker_id", "role", "state", "running", "waiting", "kv_blocks", "tokens_per_s", "restarts",
               "metrics_address")
STATUS_HEAD = ("WORKER", "ROLE", "STATE", "RUNNING", "WAITING", "KV BLOCKS", "TOK/S", "RESTARTS", "METRICS")


def connect(args: argparse.Namespace):
    """A Generation stub for ``--server`` with the client's security options."""
    from router.client import connect  # (heavy: gRPC, loaded only by the commands that call a server)
    return connect(args.server, tls_ca=args.tls_ca, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key)


def rpc_error(e, server: str) -> int:
    """Say what a failed call means (no server there, or the server's own error); returns the exit status."""
    import grpc  # (heavy: gRPC, loaded only by the commands that call a server)
    if e.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (e.details() or "").lower():
        print(f"pdserve: error: cannot reach a server at {server} (is `pdserve serve` running?)", file=sys.stderr)
    else:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def generate(args: argparse.Namespace) -> int:
    """``pdserve generate``: one prompt to the server, its text streamed (or one JSON object at the end)."""
    import grpc  # (heavy: gRPC, loaded only by the commands that call a server)

    from router.client import ResumeMismatch, collect, make_request, stream  # (heavy: gRPC)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    if args.chat:
        req = make_request(messages=[{"role": "user", "content": args.prompt}], stop=args.stop,
                           ignore_eos=args.ignore_eos, **kw)
    else:
        req = make_request(args.prompt, stop=args.stop, ignore_eos=args.ignore_eos, **kw)
    try:
        # (stream: a stream whose router is lost goes on through the next one: router.client; a
        # request to one server that does not answer fails at once: no standby to wait for)
        wait = None if "," in args.server else 0.0
        out = collect(stream(connect(args), req, unanswered_s=wait),
                      None if args.json else lambda t: print(t, end="", flush=True))
    except grpc.RpcError as e:
        return rpc_error(e, args.server)
    except ResumeMismatch as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    u = out.pop("usage")
    if args.json:
        print(json.dumps({**out, **u}))
    else:
        print(f"\n[{out['finish_reason']}; {u['completion_tokens']} tokens; TTFT {u['ttft_s'] * 1e3:.0f} ms; "
              f"TPOT {u['mean_tpot_s'] * 1e3:.1f} ms; {u['prefill_worker']} -> {u['decode_worker']}]",
              file=sys.stderr)
    return 0


def status(args: argparse.Namespace) -> int:
    """``pdserve status``: the cluster's workers as a table (or JSON); exit 3 with ``--check-blocks``
    when blocks are held by no live request (or the check could not run)."""
    import grpc  # (heavy: gRPC, loaded only by the commands that call a server)

    from pdserve.v1 import pdserve_pb2 as pb  # (heavy: gRPC's messages)
    try:
        st = connect(args).GetClusterStatus(pb.GetClusterStatusRequest(check_blocks=args.check_blocks), timeout=30)
    except grpc.RpcError as e:
        return rpc_error(e, args.server)
    stranded = {w.worker_id: w.stranded_blocks for w in st.workers if w.stranded_blocks}
    leak_rc = 3 if args.check_blocks and (stranded or not st.blocks_checked) else 0
    rows = [(w.worker_id, w.role, w.state, str(w.running), str(w.waiting),
             f"{w.kv_blocks_used}/{w.kv_blocks_total}", f"{w.tokens_per_s:.1f}", str(w.restarts),
             w.metrics_address or "-") for w in st.workers]
    if args.json:
        print(json.dumps({"mode": st.mode, "queued_requests": st.queued_requests,
                          "autoscale_events": list(st.autoscale_events),
                          "active_requests": st.active_requests, "metrics_address": st.metrics_address,
                          "workers": [{**dict(zip(STATUS_KEYS, r)), **_memory_json(w)}
                                      for r, w in zip(rows, st.workers)],
                          **({"blocks_checked": st.blocks_checked, "stranded_blocks": stranded}
                             if args.check_blocks else {})}))
    else:
        _print_table(st, rows)
        if args.check_blocks:
            _print_block_check(st.blocks_checked, stranded)
    return leak_rc


def _memory_json(w) -> dict:
    """``{"memory": {weights_gb: ..., ...}}`` for a worker whose memory is known, else {}."""
    return {"memory": {k: round(getattr(w.memory, k), 3) for k in MEMORY_FIELDS}} if w.HasField("memory") else {}


def _print_table(st, rows: list[tuple[str, ...]]) -> None:
    """The workers' table, their memory, speculative acceptance and the latest autoscaling events."""
    widths = [max(len(x) for x in col) for col in zip(STATUS_HEAD, *rows)]
    print(f"mode: {st.mode}; {st.active_requests} active requests, {st.queued_requests} queued for admission; "
          f"metrics: {st.metrics_address or 'off'}")
    for r in (STATUS_HEAD, *rows):
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
    memory = [w for w in st.workers if w.HasField("memory")]
    if memory:
        print("memory (GB): weights as served + packed copies + KV cache + other tensors; process RSS, PSS, "
              "loading peak")
    for w in memory:
        m = w.memory
        print(f"  {w.worker_id}: weights {m.weights_gb:.2f} + packed {m.packed_copies_gb:.2f} + kv "
              f"{m.kv_cache_gb:.2f} + other {m.other_gb:.2f}; rss {m.rss_gb:.2f}, pss {m.pss_gb:.2f}, "
              f"peak {m.peak_rss_gb:.2f}")
    for w in st.workers:
        if w.speculative_acceptance:
            print(f"{w.worker_id}: speculative acceptance {w.speculative_acceptance:.2f}, "
                  f"{w.speculative_tokens_per_verify:.2f} tokens per verify")
    if st.autoscale_events:
        print(f"{'role switches' if st.mode == 'adaptive' else 'autoscaling'} (latest last):")
        for e in st.autoscale_events[-10:]:
            print(f"  {e}")


def _print_block_check(checked: bool, stranded: dict[str, int]) -> None:
    if not checked:
        print("block check: a worker did not answer; no verdict")
    elif stranded:
        print("block check: KV blocks held by no live request: " + ", ".join(f"{w} {n}" for w, n in stranded.items()))
    else:
        print("block check: every KV block held belongs to a live request")
