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
import sys
from collections.abc import Sequence
from pathlib import Path

from cli import local, remote
from cli.args import MODEL_HELP, client_args, engine_args, sampling_args
from cli.plan import add_commands as add_plan_commands
from cli.pull import add_commands as add_pull_commands
from cli.quant import add_commands as add_quant_commands

LOCAL_ONLY = {"threads": "--threads", "kv_cache_gb": "--kv-cache-gb", "max_batched_tokens": "--max-batched-tokens"}


def cmd_generate(args: argparse.Namespace) -> int:
    return local.generate(args) if args.local else remote.generate(args)


def cmd_status(args: argparse.Namespace) -> int:
    return remote.status(args)


def cmd_serve_cluster(args: argparse.Namespace) -> int:
    # (heavy: the router, Ray and the engines' configs load only when a cluster starts)
    from router.app import serve
    from router.config import ConfigError, load_config
    kv_auto = args.kv_cache_gb == "auto"  # the one engine option a cluster takes: auto, for both pools
    local_only = [flag for name, flag in LOCAL_ONLY.items() if getattr(args, name) is not None
             and not (name == "kv_cache_gb" and kv_auto)]
    if local_only:  # silently ignoring them would serve something other than what was asked
        raise ConfigError(f"{', '.join(local_only)} apply to --local only; a cluster sets them per pool, e.g. "
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
    import yaml  # (heavy: loaded only when a cluster starts)
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
    return local.serve(args) if args.local else cmd_serve_cluster(args)


def cmd_convert(args: argparse.Namespace) -> int:
    # (heavy: the engine imports torch)
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
    _generate_parser(sub)
    _serve_parser(sub)
    _status_parser(sub)
    sub.add_parser("bench", help="serving benchmark: TTFT/TPOT/goodput over gRPC (see `pdserve bench --help`)",
                   add_help=False)  # its own parser (bench/serving.py) takes every argument after `bench`
    _convert_parser(sub)
    add_quant_commands(sub)  # quantize, eval-ppl
    add_pull_commands(sub)  # pull, models
    add_plan_commands(sub)  # plan (bench/simulate.py)
    return p


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate a completion for one prompt and stream its text. The prompt "
                                   "is plain text completion (tokenized as tokenizer(prompt)); --chat wraps "
                                   "it in the model's chat template.")
    g.add_argument("prompt", help="the prompt text")
    client_args(g)
    g.add_argument("--local", action="store_true",
                   help="run the engine in this process instead of asking a server (engine options apply)")
    g.add_argument("--chat", action="store_true", help="format the prompt as one user chat message")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (text, token_ids, finish_reason and the "
                        "usage: tokens, TTFT, TPOT, workers; with --local: timing) instead of streaming text")
    sampling_args(g, max_tokens=128)
    engine_args(g)
    g.set_defaults(func=cmd_generate)


def _serve_parser(sub) -> None:
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
    _serve_security_args(s)
    s.add_argument("--local", action="store_true", help="in-process demo, no cluster (engine options apply)")
    s.add_argument("--prompt", action="append", help="--local: a chat prompt instead of the examples (repeatable)")
    sampling_args(s, max_tokens=96)
    engine_args(s, cluster=True)
    s.set_defaults(func=cmd_serve)


def _serve_security_args(s: argparse.ArgumentParser) -> None:
    sec = s.add_argument_group("security (router.auth; each overrides its security.* key)")
    sec.add_argument("--tls-cert", default=None, help="PEM server certificate: serve gRPC over TLS")
    sec.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None, help="PEM CA: accept only clients with a certificate it signed")
    sec.add_argument("--tokens-file", default=None,
                     help="bearer tokens, `token` or `token name` per line (also $PDSERVE_TOKENS): every call "
                          "but health needs one, and a request answers only to its own token")
    sec.add_argument("--insecure", action="store_true", default=None,
                     help="serve a non-loopback --host without TLS or authentication (refused otherwise)")


def _status_parser(sub) -> None:
    st = sub.add_parser("status", help="show the cluster's workers as a table",
                        description="Ask a running server for each worker's role, state, running and "
                                    "waiting requests, KV blocks used/total and tokens/s.")
    client_args(st)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--check-blocks", action="store_true",
                    help="also ask every worker which requests hold KV blocks and report those held by no live "
                         "request (a leak); exit 3 if any (or if a worker did not answer)")
    st.set_defaults(func=cmd_status)


def _convert_parser(sub) -> None:
    c = sub.add_parser("convert", help="convert a llama GGUF checkpoint to an fp32 HF-format folder",
                       description="Dequantize a llama-architecture GGUF into an fp32 HF-format folder "
                                   "(config.json, model.safetensors, tokenizer). Default: the bundled "
                                   "SmolLM2 into the cache dir ($PDSERVE_CACHE or ~/.cache/pdserve). Not "
                                   "needed to serve a GGUF: `serve`, `generate --model` take the file (or a "
                                   "catalogue name) as it is, any supported architecture.")
    c.add_argument("--gguf", help="the .gguf file, or a catalogue name of a llama model (default: the bundled one)")
    c.add_argument("--out", help="output folder")
    c.set_defaults(func=cmd_convert)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from bench.serving import main as bench_main  # (heavy: the benchmark's own dependencies)
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
