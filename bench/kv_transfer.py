"""KV transfer benchmark: GB/s of each FrameTransport moving a real model's KV between processes.

Payload: SmolLM2-135M's KV for one prompt of T tokens (T = 512, 2,048, 8,192): 30 layers, each
a K and a V float32 tensor of shape [T, 3 KV heads, 64 dims] with random data, i.e. 46,080
bytes per token (K + V). The transport is what is measured; the model's shape is what matters.

Per transport and size, a receiver runs in a second process (``multiprocessing`` spawn); the
sender (this process) sends one message per layer and then waits for the receiver's ack:

- ``raw``: ``[small msgpack header, K bytes, V bytes]``, zero-copy views of the tensors.
- ``fmt``: ``kvtransfer.format.encode_frames`` (xxh3 checksum of K and V on the sender) and
  ``decode_frames`` on the receiver (checksum verified): the real wire format's cost.
- ``mac``: ``fmt`` plus the KV plane's authentication as a cluster runs it
  (``kvtransfer.auth``, ``kv_transfer.integrity: full``): an HMAC-SHA256 over header, K and V
  on the sender, verified on the receiver before decoding. ``machdr``: the MAC over the header
  only (``integrity: header``).

Time runs from the first send to the ack's arrival; GB/s = payload bytes (K + V) / time, GB =
1e9 B. Each (transport, size, mode) has a warm-up transfer (connection set-up, first-touch
page faults) and then the median of ``--reps`` transfers. ``inproc`` is the in-process
reference (sender and receiver in this process; it copies each buffer once). ``memcpy_gbps`` is
this process's single-thread ``torch`` ``copy_`` of a 256 MiB tensor, counting the bytes
copied once (best of 5; bench/engine.py's ``copy_bandwidth_gb_s`` counts read + write).

Both ends poll ``recv()`` with a 50 us sleep when nothing is waiting (as an engine loop would).
Timings are wall-clock: on the 2-core development machine any other busy process skews them.

Prints progress on stderr, a table on stdout, and as the last stdout line one flat JSON object:
``memcpy_gbps``, ``<t>_gbps`` (raw, largest size: 8,192 tokens by default), ``<t>_gbps_<T>``,
``<t>_fmt_gbps[_<T>]``, ``<t>_mac_gbps[_<T>]``, ``<t>_machdr_gbps[_<T>]``,
``mac_cost_fraction`` (1 - ucx mac / ucx fmt at the largest size), ``ucx_vs_memcpy`` (floor 0.2), and
``overlap_hidden_fraction``: the share of the transfer that layer streaming hides end to end in a
real prefill (bench/kv_overlap.py), by default with the prefill's forward on every core but the
last and its transfer (the transfer thread, the UCX progress thread) and the receiver on the
last, as ``prefill.transfer_cpus`` runs a worker; ``overlap_hidden_fraction_inline`` /
``_thread`` per way of sending, ``overlap_send`` and ``overlap_cores`` say which was reported.
Runs as ``python bench/kv_transfer.py [--quick]``.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before UCX can load

import msgpack  # noqa: E402
import torch  # noqa: E402

from kvtransfer.auth import PlaneAuth  # noqa: E402
from kvtransfer.base import FrameTransport, get_transport  # noqa: E402
from kvtransfer.format import decode_frames, encode_frames  # noqa: E402


NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4
FINGERPRINT = "bench-smollm2-135m"
POLL_S = 50e-6
TIMEOUT_S = 120.0
# name shown -> (registered transport, constructor kwargs)
TRANSPORTS = {"ucx": ("ucx", {}), "zmq": ("zmq", {}), "zmq_ipc": ("zmq", {"scheme": "ipc"}),
              "inproc": ("inproc", {})}
MODES = ("raw", "fmt", "mac", "machdr")
# Both processes MAC with the same key and "transfer secret", as two workers of one cluster do.
AUTH = {"mac": PlaneAuth(b"bench-cluster-key-32-bytes------", "full"),
        "machdr": PlaneAuth(b"bench-cluster-key-32-bytes------", "header")}
SECRET = b"bench-transfer-secret-32-bytes--"


def log(msg: str) -> None:
    print(f"[kv_transfer] {msg}", file=sys.stderr, flush=True)


def wait_msg(t: FrameTransport, deadline: float) -> tuple[str, list]:
    while (m := t.recv()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no message before the deadline")
        time.sleep(POLL_S)
    return m


def handle(t: FrameTransport, peer: str, frames: list) -> bool:
    """Receiver side of one message; acks after the last layer. Returns False on "stop"."""
    if len(frames) == 5:  # authenticated: [mode, header, K, V, mac]
        auth = AUTH[bytes(frames[0]).decode()]
        frames, tag = PlaneAuth.split(frames[1:])
        assert auth.valid(frames, tag, SECRET), "bad MAC"
    head = msgpack.unpackb(frames[0])
    if head[0] == "stop":
        return False
    if head[0] == "raw":
        layer = head[1]
        assert len(frames) == 3 and len(frames[1]) == len(frames[2]) == head[2]
    else:
        header, _, _ = decode_frames(frames, FINGERPRINT)  # verifies the checksum
        layer = header.layer
    if layer == NUM_LAYERS - 1:
        t.send(peer, [b"ack"])
    return True


def receiver(name: str, kwargs: dict, q: mp.Queue) -> None:
    """Child process: bind, publish the address, serve transfers until "stop" (or orphaned)."""
    torch.set_num_threads(1)
    parent = mp.parent_process()
    t = get_transport(name, **kwargs)
    try:
        q.put(t.bind())
        while True:
            msg = t.recv()
            if msg is None:
                if parent is not None and not parent.is_alive():
                    return
                time.sleep(POLL_S)
            elif not handle(t, *msg):
                return
    finally:
        t.close()


def make_kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(tokens)
    shape = (tokens, NUM_KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(NUM_LAYERS)]


def transfer(t: FrameTransport, peer: str, kv: list, mode: str, other: FrameTransport | None) -> float:
    """Send every layer, wait for the ack; returns seconds. ``other``: in-process receiver."""
    nbytes = kv[0][0].numel() * 4
    deadline = time.monotonic() + TIMEOUT_S
    t0 = time.perf_counter()
    for layer, (k, v) in enumerate(kv):
        if mode != "raw":
            frames = encode_frames("bench", FINGERPRINT, layer, 0, k, v, NUM_KV_HEADS)
            if mode in AUTH:
                frames = [mode.encode(), *AUTH[mode].seal(frames, SECRET)]
        else:
            frames = [msgpack.packb(["raw", layer, nbytes]), memoryview(k.numpy()).cast("B"),
                      memoryview(v.numpy()).cast("B")]
        t.send(peer, frames)
    if other is not None:  # inproc: play the receiver here
        for _ in range(NUM_LAYERS):
            handle(other, *wait_msg(other, deadline))
    _, ack = wait_msg(t, deadline)
    assert bytes(ack[0]) == b"ack"
    return time.perf_counter() - t0


def bench_transport(label: str, sizes: list[int], reps: int, kvs: dict) -> dict[str, float]:
    name, kwargs = TRANSPORTS[label]
    proc, other = None, None
    sender = get_transport(name, **kwargs)
    out: dict[str, float] = {}
    try:
        if name == "inproc":
            other = get_transport(name, **kwargs)
            address = other.bind()
        else:
            q = mp.get_context("spawn").Queue()
            proc = mp.get_context("spawn").Process(target=receiver, args=(name, kwargs, q), daemon=True)
            proc.start()
            address = q.get(timeout=60)
        peer = sender.connect(address)
        for tokens in sizes:
            for mode in MODES:
                times = [transfer(sender, peer, kvs[tokens], mode, other) for _ in range(reps + 1)][1:]
                gbps = tokens * BYTES_PER_TOKEN / statistics.median(times) / 1e9
                key = f"{label}_{_prefix(mode)}gbps_{tokens}"
                out[key] = round(gbps, 3)
                log(f"{key} = {gbps:.2f} GB/s (median of {reps}, {min(times) * 1e3:.0f}-{max(times) * 1e3:.0f} ms)")
        if proc is not None:
            sender.send(peer, [msgpack.packb(["stop"])])
            proc.join(10)
    finally:
        sender.close()
        if other is not None:
            other.close()
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join()
    return out


def _prefix(mode: str) -> str:
    return "" if mode == "raw" else f"{mode}_"


def memcpy_gbps() -> float:
    src = torch.randn(64 << 20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return src.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The last stdout line is a JSON object of all results.")
    ap.add_argument("--quick", action="store_true", help="2 timed transfers per case instead of 5")
    ap.add_argument("--reps", type=int, default=None, help="timed transfers per case (median kept)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths in tokens")
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    ap.add_argument("--overlap-transport", default="ucx", choices=["ucx", "zmq", "none"],
                    help="transport for the streaming-vs-send-after-prefill run on the real model "
                         "(bench/kv_overlap.py); 'none' skips it")
    ap.add_argument("--overlap-prompt", type=int, default=2048, help="prompt length of the overlap run")
    ap.add_argument("--overlap-cores", default=None, choices=["split", "shared"],
                    help="where the overlap run's two sides run (bench/kv_overlap.py --cores; default "
                         "split with 2+ cores: the transfer and the receiver on a core of their own)")
    ap.add_argument("--overlap-reps", type=int, default=None,
                    help="repetitions of the overlap run (default 2, 1 with --quick; the end-to-end "
                         "fraction is a ~1%% difference of prefill times: 20 give a stable median)")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)

    overlap: dict = {}
    if args.overlap_transport != "none":
        # First: a real prefill computes while KV streams (inline, transfer thread, after).
        # (heavy: torch and the engine, loaded only by what uses them)
        from bench.kv_overlap import measure_overlap, split_cores
        cores = args.overlap_cores or ("split" if split_cores() else "shared")
        log(f"overlap: real prefill of {args.overlap_prompt} tokens, {args.overlap_transport}, cores {cores}: "
            "streaming (inline, transfer thread) vs send-after")
        overlap = measure_overlap(args.overlap_transport, args.overlap_prompt,
                                  reps=args.overlap_reps or (1 if args.quick else 2), progress=log, cores=cores)
    torch.set_num_threads(1)

    log("memcpy (256 MiB torch copy_)")
    results: dict[str, object] = {"memcpy_gbps": round(memcpy_gbps(), 3)}
    log(f"memcpy_gbps = {results['memcpy_gbps']:.2f}")
    kvs = {n: make_kv(n) for n in args.sizes}
    for label in args.transports:
        log(f"{label}: sizes {args.sizes}, {reps} timed transfers each")
        try:
            results.update(bench_transport(label, args.sizes, reps, kvs))
        except Exception as e:  # a broken transport must not hide the others' numbers
            log(f"{label} failed: {e!r}")
            results[f"{label}_error"] = repr(e)

    big = max(args.sizes)
    for label in args.transports:
        for fmt in map(_prefix, MODES):
            if f"{label}_{fmt}gbps_{big}" in results:
                results[f"{label}_{fmt}gbps"] = results[f"{label}_{fmt}gbps_{big}"]
    if results.get("ucx_mac_gbps") and results.get("ucx_fmt_gbps"):
        results["mac_cost_fraction"] = round(1 - results["ucx_mac_gbps"] / results["ucx_fmt_gbps"], 3)
    if "ucx_gbps" in results:
        results["ucx_vs_memcpy"] = round(results["ucx_gbps"] / results["memcpy_gbps"], 3)
        results["ucx_vs_memcpy_floor"] = 0.2
        results["ucx_meets_floor"] = results["ucx_vs_memcpy"] >= 0.2
    results.update({"tokens": big, "bytes_per_token": BYTES_PER_TOKEN, "payload_bytes": big * BYTES_PER_TOKEN,
                    "reps": reps, "quick": args.quick,
                    "overlap_hidden_fraction": overlap.get("hidden_fraction"),
                    "overlap_transport": args.overlap_transport, "overlap_prompt_tokens": args.overlap_prompt,
                    "overlap_cores": overlap.get("cores"), "overlap_send": overlap.get("send"),
                    "overlap_prefill_threads": overlap.get("prefill_threads"),
                    "overlap_exposed_hidden_fraction": overlap.get("exposed_hidden_fraction"),
                    **{f"overlap_{k}_{m}": overlap.get(f"{k}_{m}") for m in ("inline", "thread")
                       for k in ("hidden_fraction", "exposed_hidden_fraction", "compute_s", "exposed_s")},
                    "overlap_compute_s": overlap.get("compute_s"),
                    "overlap_exposed_after_s": overlap.get("exposed_after_s")})

    print(f"KV transfer, SmolLM2-135M shape ({BYTES_PER_TOKEN} B/token), GB/s (median of {reps})")
    print(f"memcpy (1 thread, torch copy_ 256 MiB): {results['memcpy_gbps']:.2f} GB/s")
    print(f"{'transport':<10} {'mode':<6} " + " ".join(f"{n:>8}" for n in args.sizes) + "  vs memcpy")
    for label in args.transports:
        for fmt in map(_prefix, MODES):
            cells = [results.get(f"{label}_{fmt}gbps_{n}") for n in args.sizes]
            if all(c is None for c in cells):
                continue
            ratio = (cells[-1] or 0) / results["memcpy_gbps"]
            print(f"{label:<10} {fmt[:-1] or 'raw':<6} "
                  + " ".join(f"{c:>8.2f}" if c is not None else f"{'-':>8}" for c in cells) + f"  {ratio:>8.0%}")
    if overlap:
        print(f"layer streaming ({args.overlap_transport}, {args.overlap_prompt}-token real prefill, cores "
              f"{overlap['cores']}, forward on {overlap['prefill_threads']} threads {overlap['compute_s']:.2f}s): "
              f"KV complete {overlap['exposed_after_s'] * 1e3:.0f} ms after the forward when sent after it")
        for m in ("inline", "thread"):
            hf = overlap[f"hidden_fraction_{m}"]
            print(f"  {m:<6}: forward {overlap[f'compute_s_{m}']:.2f}s, KV complete "
                  f"{overlap[f'exposed_s_{m}'] * 1e3:.0f} ms after it; hidden end to end "
                  f"{'n/a' if hf is None else f'{hf:.0%}'}{'  (reported)' if overlap['send'] == m else ''}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
