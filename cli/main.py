"""The ``pdserve`` command line.

Subcommands:
  serve [MODEL]      start the cluster: local Ray (or --address), prefill and decode pools, gRPC
                     and the OpenAI API; MODEL: a catalogue name, a .gguf file or a model folder
  generate           send one prompt to a running server and stream its text (--local: in-process)
  status             the cluster's workers as a table
  bench              serving benchmark over gRPC (bench/serving.py, also run as a script)
  serve --local      in-process demo: a few example prompts in one continuous batch, no cluster
  convert            convert the bundled GGUF (or another llama one) into an fp32 HF-format folder
  pull               download catalogue models (GGUF, verified) into the cache (cli/pull.py)
  models             the catalogue: each model's architecture, size, whether pulled, its path
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

DEFAULT_SERVER = "127.0.0.1:50051"
EXAMPLE_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
]


LOCAL_ONLY = {"threads": "--threads", "kv_cache_gb": "--kv-cache-gb", "max_batched_tokens": "--max-batched-tokens"}


MODEL_HELP = ("a catalogue name (`pdserve models`; `pdserve pull NAME` fetches one), a .gguf file (served from its "
              "weights as shipped: 4-bit blocks as INT4, 5-8 bit as INT8), an HF-format folder (Llama, Mistral, "
              "Qwen2, Gemma 3) or a Hugging Face id already in the local Hugging Face cache; default: the bundled "
              "SmolLM2-135M-Instruct")


def _engine_args(p: argparse.ArgumentParser, cluster: bool = False) -> None:
    g = p.add_argument_group("engine" + ("" if cluster else " (--local only)"))
    g.add_argument("--model", default=None,
                   help=MODEL_HELP + (" (a cluster: overrides `model`; every worker node needs it)" if cluster else ""))
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight and activation dtype (default float32, fastest on AVX2 CPUs); given with a GGUF "
                        "model, its weights are dequantized to it instead of served as shipped"
                        + (" (a cluster: overrides `dtype` and sets `dequantize`)" if cluster else ""))
    g.add_argument("--activations", default=None, choices=["float32", "int8"],
                   help="int8: INT4/INT8 weights multiply activations quantized per group of 32 on the fly "
                        "(llama.cpp's arithmetic on its K-quants): faster decode, not token-identical to HF; "
                        "default float32 (exact)" + (" (a cluster: overrides `activations`)" if cluster else ""))
    only = " (--local only; a cluster sets them per pool: --set decode.kv_cache_gb=2 ...)" if cluster else ""
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)" + only)
    g.add_argument("--kv-cache-gb", type=_kv_cache_gb, default=None, metavar="GIB|auto",
                   help="memory for the paged KV cache, GiB (default 1); auto: what this machine has left after "
                        "the weights and a reserve (engine/kv_budget.py)"
                        + (" (a cluster takes only auto here, for both pools; a number per pool: --set "
                           "decode.kv_cache_gb=2 ...)" if cluster else ""))
    g.add_argument("--max-batched-tokens", type=int, default=None,
                   help="per-step token budget; longer prompts prefill in chunks (default 2048)" + only)


def _kv_cache_gb(value: str) -> float | str:
    """``--kv-cache-gb``: a positive number of GiB, or ``auto``."""
    if value == "auto":
        return value
    try:
        gb = float(value)
    except ValueError:
        gb = float("nan")
    if not gb > 0 or gb == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0 or auto, got {value!r}")
    return gb


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"the pdserve server (default {DEFAULT_SERVER})")
    g = p.add_argument_group("security (as the server requires)")
    g.add_argument("--tls-ca", default=None, help="PEM CA that signed the server's certificate: connect with TLS")
    g.add_argument("--tls-cert", default=None, help="this client's PEM certificate, for servers that want one (mTLS)")
    g.add_argument("--tls-key", default=None, help="the key of --tls-cert")
    g.add_argument("--token", default=None, help="bearer token (default: $PDSERVE_TOKEN); prefer the "
                                                 "variable: a command line is visible to other users")


def _connect(args: argparse.Namespace):
    from cli.client import connect
    return connect(args.server, tls_ca=args.tls_ca, token=args.token, tls_cert=args.tls_cert, tls_key=args.tls_key)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="maximum new tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p(top)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _build_engine(args: argparse.Namespace, chat: bool = False):
    """The engine of the engine options; ``chat``: refuse (before loading) a model without a chat template."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.models.loader import resolve_model_path
    dtype = args.dtype or "float32"
    path = resolve_model_path(args.model)  # a bad name or file stops here, before the slow load
    if chat and not _has_chat_template(path):
        raise ValueError(f"model {args.model or 'bundled'!r} has no chat template (a base model, not "
                         "instruction-tuned): give a plain text prompt (no --chat)")
    # --dtype given: a GGUF model's weights in that dtype, not as shipped (no effect on others)
    kv_gb = 1.0 if args.kv_cache_gb is None else args.kv_cache_gb
    if kv_gb == "auto":  # one engine, alone on this machine: all that is left
        from engine.kv_budget import estimate_weights_bytes, kv_budget, node_available_bytes
        budget = kv_budget(node_available_bytes(), estimate_weights_bytes(path, dtype, args.dtype is not None),
                           "colocated", {"colocated": 1})
        print(budget.describe(), file=sys.stderr, flush=True)
        kv_gb = budget.kv_cache_gib
    cfg = EngineConfig(model=str(path), dtype=dtype, num_threads=args.threads, dequantize=args.dtype is not None,
                       activations=args.activations or "float32",
                       cache=CacheConfig(memory_gb=kv_gb),
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens or 2048))
    print(f"loading {args.model or 'bundled SmolLM2-135M-Instruct'} ({_precision(path, args.dtype)}) ...",
          file=sys.stderr, flush=True)
    eng = LLMEngine(cfg)
    print(f"loaded in {eng.load_seconds:.1f} s; {eng.block_manager.num_blocks} KV blocks of "
          f"{eng.block_manager.block_size} tokens, context limit {eng.max_model_len}",
          file=sys.stderr, flush=True)
    return eng


def _precision(path, dtype: str | None) -> str:
    """How the weights of the model folder ``path`` load, for the loading line."""
    from engine.models import gguf
    if gguf.source(path) is not None and dtype is None:
        return "GGUF weights as shipped, float32 activations"
    return dtype or "float32"


def _has_chat_template(path) -> bool:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)).chat_template is not None


def _params(args: argparse.Namespace):
    from engine.request import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)


def _rpc_error(e, server: str) -> int:
    import grpc
    if e.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (e.details() or "").lower():
        print(f"pdserve: error: cannot reach a server at {server} (is `pdserve serve` running?)", file=sys.stderr)
    else:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def cmd_generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from cli.client import collect, make_request
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    if args.chat:
        req = make_request(messages=[{"role": "user", "content": args.prompt}], stop=args.stop,
                           ignore_eos=args.ignore_eos, **kw)
    else:
        req = make_request(args.prompt, stop=args.stop, ignore_eos=args.ignore_eos, **kw)
    try:
        out = collect(_connect(args).Generate(req),
                      None if args.json else lambda t: print(t, end="", flush=True))
    except grpc.RpcError as e:
        return _rpc_error(e, args.server)
    u = out.pop("usage")
    if args.json:
        print(json.dumps({**out, **u}))
    else:
        print(f"\n[{out['finish_reason']}; {u['completion_tokens']} tokens; TTFT {u['ttft_s'] * 1e3:.0f} ms; "
              f"TPOT {u['mean_tpot_s'] * 1e3:.1f} ms; {u['prefill_worker']} -> {u['decode_worker']}]",
              file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.v1 import pdserve_pb2 as pb
    try:
        st = _connect(args).GetClusterStatus(pb.GetClusterStatusRequest(check_blocks=args.check_blocks), timeout=30)
    except grpc.RpcError as e:
        return _rpc_error(e, args.server)
    stranded = {w.worker_id: w.stranded_blocks for w in st.workers if w.stranded_blocks}
    # --check-blocks: exit 3 when blocks are held by no live request (or the check could not run)
    leak_rc = 3 if args.check_blocks and (stranded or not st.blocks_checked) else 0
    rows = [(w.worker_id, w.role, w.state, str(w.running), str(w.waiting),
             f"{w.kv_blocks_used}/{w.kv_blocks_total}", f"{w.tokens_per_s:.1f}", str(w.restarts),
             w.metrics_address or "-") for w in st.workers]
    if args.json:
        keys = ("worker_id", "role", "state", "running", "waiting", "kv_blocks", "tokens_per_s", "restarts",
                "metrics_address")
        print(json.dumps({"mode": st.mode, "queued_requests": st.queued_requests,
                          "autoscale_events": list(st.autoscale_events),
                          "active_requests": st.active_requests, "metrics_address": st.metrics_address,
                          "workers": [{**dict(zip(keys, r)), **_memory_json(w)} for r, w in zip(rows, st.workers)],
                          **({"blocks_checked": st.blocks_checked, "stranded_blocks": stranded}
                             if args.check_blocks else {})}))
        return leak_rc
    head = ("WORKER", "ROLE", "STATE", "RUNNING", "WAITING", "KV BLOCKS", "TOK/S", "RESTARTS", "METRICS")
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    print(f"mode: {st.mode}; {st.active_requests} active requests, {st.queued_requests} queued for admission; "
          f"metrics: {st.metrics_address or 'off'}")
    for r in (head, *rows):
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
    if args.check_blocks:
        if not st.blocks_checked:
            print("block check: a worker did not answer; no verdict")
        elif stranded:
            print("block check: KV blocks held by no live request: "
                  + ", ".join(f"{w} {n}" for w, n in stranded.items()))
        else:
            print("block check: every KV block held belongs to a live request")
    return leak_rc


MEMORY_FIELDS = ("weights_gb", "packed_copies_gb", "kv_cache_gb", "other_gb", "rss_gb", "pss_gb", "peak_rss_gb")


def _memory_json(w) -> dict:
    """``{"memory": {weights_gb: ..., ...}}`` for a worker whose memory is known, else {}."""
    return {"memory": {k: round(getattr(w.memory, k), 3) for k in MEMORY_FIELDS}} if w.HasField("memory") else {}


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.local:
        return cmd_generate_remote(args)
    params = _params(args)  # validate before the slow model load
    eng = _build_engine(args, chat=args.chat)
    t0 = time.monotonic()
    if args.chat:
        eng.add_request(messages=[{"role": "user", "content": args.prompt}], params=params)
    else:
        eng.add_request(args.prompt, params)
    final = None
    for out in eng.stream():
        if not args.json:
            print(out.new_text, end="", flush=True)
        final = out
    total = time.monotonic() - t0
    assert final is not None
    if args.json:
        print(json.dumps({
            "text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason,
            "prompt_tokens": final.num_prompt_tokens, "completion_tokens": len(final.token_ids),
            "timing": {"ttft_s": final.ttft, "mean_tpot_s": final.mean_tpot, "total_s": total,
                       "tokens_per_s": len(final.token_ids) / total if total > 0 else None},
        }))
    else:
        tpot = f"{final.mean_tpot * 1e3:.1f} ms" if final.mean_tpot else "n/a"
        print(f"\n[{final.finish_reason}; {len(final.token_ids)} tokens; TTFT {final.ttft * 1e3:.0f} ms; "
              f"TPOT {tpot}]", file=sys.stderr)
    return 0


def cmd_serve_cluster(args: argparse.Namespace) -> int:
    from router.app import serve
    from router.config import ConfigError, load_config
    kv_auto = args.kv_cache_gb == "auto"  # the one engine option a cluster takes: auto, for both pools
    local = [flag for name, flag in LOCAL_ONLY.items() if getattr(args, name) is not None
             and not (name == "kv_cache_gb" and kv_auto)]
    if local:  # silently ignoring them would serve something other than what was asked
        raise ConfigError(f"{', '.join(local)} apply to --local only; a cluster sets them per pool, e.g. "
                          "--set decode.kv_cache_gb=2 --set prefill.threads=1 --set decode.max_batched_tokens=4096")
    overrides = {k: v for k, v in (("model", args.model), ("dtype", args.dtype),
                                   # an explicit dtype: a GGUF model's weights dequantized to it
                                   ("dequantize", True if args.dtype is not None else None),
                                   ("activations", args.activations),
                                   ("router.host", args.host), ("router.port", args.port),
                                   ("router.http_port", args.http_port),
                                   ("metrics.port", args.metrics_port), ("security.tls_cert", args.tls_cert),
                                   ("security.tls_key", args.tls_key), ("security.tls_client_ca", args.tls_client_ca),
                                   ("security.tokens_file", args.tokens_file), ("security.insecure", args.insecure),
                                   ("prefill.kv_cache_gb", "auto" if kv_auto else None),
                                   ("decode.kv_cache_gb", "auto" if kv_auto else None))
                 if v is not None}
    import yaml
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set decode.replicas=2")
        overrides[key.strip()] = yaml.safe_load(value)
    cfg = load_config(args.config, overrides)  # a bad key or value stops here, naming it
    return serve(cfg, args.address, cfg.router.host, cfg.router.port)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise ValueError(f"two models: {args.model_arg!r} and --model {args.model!r}; give one")
        args.model = args.model_arg
    if not args.local:
        return cmd_serve_cluster(args)
    params = _params(args)
    eng = _build_engine(args)
    prompts = args.prompt or EXAMPLE_PROMPTS
    chat = getattr(eng.tokenizer, "chat_template", None) is not None
    if not chat:
        print("this model has no chat template (a base model): each prompt is continued as plain text",
              file=sys.stderr, flush=True)
    t0 = time.monotonic()
    ids = [eng.add_request(messages=[{"role": "user", "content": p}], params=params) if chat
           else eng.add_request(p, params) for p in prompts]
    # All prompts decode together in one continuous batch; the terminal shows one answer live at
    # a time and prints the others' text (already generated) when their turn comes.
    shown = 0
    texts = {i: "" for i in ids}
    done: dict[str, object] = {}
    n_tokens = 0

    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")

    def header(k: int) -> None:
        print(f"\n{bold}[{k + 1}/{len(ids)}] {prompts[k]}{plain}\n", end="", flush=True)

    header(0)
    for out in eng.stream():
        n_tokens += len(out.new_token_ids)
        texts[out.request_id] += out.new_text
        if out.finished:
            done[out.request_id] = out
        if out.request_id == ids[shown]:
            print(out.new_text, end="", flush=True)
        while shown < len(ids) and ids[shown] in done:
            shown += 1
            if shown < len(ids):
                print()
                header(shown)
                print(texts[ids[shown]], end="", flush=True)
    total = time.monotonic() - t0
    print(f"\n\n{len(ids)} requests, {n_tokens} tokens in {total:.1f} s "
          f"({n_tokens / total:.1f} tok/s in one continuous batch)", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.models import catalog
    from engine.models.gguf_convert import bundled_gguf_path, cache_dir, convert_gguf
    src = catalog.resolve(args.gguf) if args.gguf and catalog.lookup(args.gguf) else \
        Path(args.gguf) if args.gguf else bundled_gguf_path()
    if not src.is_file():
        raise ValueError(f"no GGUF file at {str(src)!r}: give a .gguf file or a catalogue name (`pdserve models`)")
    out = Path(args.out) if args.out else cache_dir() / src.stem.split(".")[0]
    convert_gguf(src, out)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="pdserve: disaggregated prefill/decode LLM serving.")
    p.add_argument("--version", action="version", version="pdserve 0.1.0")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate a completion for one prompt and stream its text. The prompt "
                                   "is plain text completion (tokenized as tokenizer(prompt)); --chat wraps "
                                   "it in the model's chat template.")
    g.add_argument("prompt", help="the prompt text")
    _client_args(g)
    g.add_argument("--local", action="store_true",
                   help="run the engine in this process instead of asking a server (engine options apply)")
    g.add_argument("--chat", action="store_true", help="format the prompt as one user chat message")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (text, token_ids, finish_reason and the "
                        "usage: tokens, TTFT, TPOT, workers; with --local: timing) instead of streaming text")
    _sampling_args(g, max_tokens=128)
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start the cluster and serve gRPC (--local: in-process demo)",
                       description="Start a local Ray (dashboard off, no auth token file, a private temp "
                                   "dir) or join one (--address), create the prefill and decode pools of "
                                   "the config, and serve pdserve.v1.Generation (plus health and "
                                   "reflection) and the OpenAI API until Ctrl-C. MODEL (or --model) "
                                   "replaces the config's `model`, e.g. `pdserve serve qwen2.5-coder-0.5b` "
                                   "or `pdserve serve ./model.gguf`. With --local: load the model in this "
                                   "process and stream answers to example chat prompts (a base model "
                                   "without a chat template: continued as plain text) in one continuous batch.")
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (the same as --model): " + MODEL_HELP)
    s.add_argument("--config", default=None,
                   help="cluster config YAML (default: built-in defaults, as in deploy/local.yaml)")
    s.add_argument("--address", default=None, help="join this running Ray cluster instead of starting one")
    s.add_argument("--host", default=None, help="gRPC listen host (overrides router.host; default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="gRPC listen port (overrides router.port; default 50051)")
    s.add_argument("--http-port", type=int, default=None,
                   help="the OpenAI-compatible HTTP API's port on --host (overrides router.http_port; default "
                        "8000; 0 = a free port; --set router.http_port=null turns it off)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="the router's Prometheus /metrics port (overrides metrics.port; 0 = a free port)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, the value read as YAML (e.g. --set decode.replicas=2 "
                        "--set kv_transfer.transport=zmq); repeatable; applied after --config")
    sec = s.add_argument_group("security (router.auth; each overrides its security.* key)")
    sec.add_argument("--tls-cert", default=None, help="PEM server certificate: serve gRPC over TLS")
    sec.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None, help="PEM CA: accept only clients with a certificate it signed")
    sec.add_argument("--tokens-file", default=None,
                     help="bearer tokens, `token` or `token name` per line (also $PDSERVE_TOKENS): every call "
                          "but health needs one, and a request answers only to its own token")
    sec.add_argument("--insecure", action="store_true", default=None,
                     help="serve a non-loopback --host without TLS or authentication (refused otherwise)")
    s.add_argument("--local", action="store_true", help="in-process demo, no cluster (engine options apply)")
    s.add_argument("--prompt", action="append", help="--local: a chat prompt instead of the examples (repeatable)")
    _sampling_args(s, max_tokens=96)
    _engine_args(s, cluster=True)
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="show the cluster's workers as a table",
                        description="Ask a running server for each worker's role, state, running and "
                                    "waiting requests, KV blocks used/total and tokens/s.")
    _client_args(st)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--check-blocks", action="store_true",
                    help="also ask every worker which requests hold KV blocks and report those held by no live "
                         "request (a leak); exit 3 if any (or if a worker did not answer)")
    st.set_defaults(func=cmd_status)

    sub.add_parser("bench", help="serving benchmark: TTFT/TPOT/goodput over gRPC (see `pdserve bench --help`)",
                   add_help=False)  # its own parser (bench/serving.py) takes every argument after `bench`

    c = sub.add_parser("convert", help="convert a llama GGUF checkpoint to an fp32 HF-format folder",
                       description="Dequantize a llama-architecture GGUF into an fp32 HF-format folder "
                                   "(config.json, model.safetensors, tokenizer). Default: the bundled "
                                   "SmolLM2 into the cache dir ($PDSERVE_CACHE or ~/.cache/pdserve). Not "
                                   "needed to serve a GGUF: `serve`, `generate --model` take the file (or a "
                                   "catalogue name) as it is, any supported architecture.")
    c.add_argument("--gguf", help="the .gguf file, or a catalogue name of a llama model (default: the bundled one)")
    c.add_argument("--out", help="output folder")
    c.set_defaults(func=cmd_convert)
    from cli.quant import add_commands
    add_commands(sub)  # quantize, eval-ppl
    from cli.pull import add_commands as add_pull_commands
    add_pull_commands(sub)  # pull, models
    from cli.plan import add_commands as add_plan_commands
    add_plan_commands(sub)  # plan (bench/simulate.py)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from bench.serving import main as bench_main
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input (InvalidRequestError, ModelLoadError, config errors)
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
