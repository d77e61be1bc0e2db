"""The ``pdserve`` command line's shared option groups: engine, client (server and security), sampling."""

from __future__ import annotations

import argparse

DEFAULT_SERVER = "127.0.0.1:50051"


MODEL_HELP = ("a catalogue name (`pdserve models`; `pdserve pull NAME` fetches one), a .gguf file (served from its "
              "weights as shipped: 4-bit blocks as INT4, 5-8 bit as INT8), an HF-format folder (Llama, Mistral, "
              "Qwen2, Gemma 3) or a Hugging Face id already in the local Hugging Face cache; default: the bundled "
              "SmolLM2-135M-Instruct")


def engine_args(p: argparse.ArgumentParser, cluster: bool = False) -> None:
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
    g.add_argument("--kv-cache-gb", type=kv_cache_gb, default=None, metavar="GIB|auto",
                   help="memory for the paged KV cache, GiB, or auto (the default): what this machine has left "
                        "after the weights and a reserve (engine/kv_budget.py); its pages become resident as "
                        "blocks are first written"
                        + (" (a cluster takes only auto here, for both pools; a number per pool: --set "
                           "decode.kv_cache_gb=2 ...)" if cluster else ""))
    g.add_argument("--max-batched-tokens", type=int, default=None,
                   help="per-step token budget; longer prompts prefill in chunks (default 2048)" + only)


def kv_cache_gb(value: str) -> float | str:
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


def client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER,
                   help=f"the pdserve server host:port, or several comma-separated, tried in order (default {DEFAULT_SERVER})")
    g = p.add_argument_group("security (as the server requires)")
    g.add_argument("--tls-ca", default=None, help="PEM CA that signed the server's certificate: connect with TLS")
    g.add_argument("--tls-cert", default=None, help="this client's PEM certificate, for servers that want one (mTLS)")
    g.add_argument("--tls-key", default=None, help="the key of --tls-cert")
    g.add_argument("--token", default=None, help="bearer token (default: $PDSERVE_TOKEN); prefer the "
                                                 "variable: a command line is visible to other users")


def sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
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
