"""Perplexity of a catalogue GGUF model at each precision pdserve can serve it in.

Choices, each loaded on its own (one model in memory at a time) from the same file and scored on
the same token ids (the file's own tokenizer) with ``engine.quant.eval.perplexity`` (sliding
windows of ``--window`` tokens advancing by ``--stride``):

    float    dequantize=True: every tensor dequantized to fp32, the reference
    shipped  as shipped: 4-bit blocks INT4 g32 with the file's codes, 5-8 bit INT8
    int8     quantization="int8": every linear INT8
    int4     quantization="int4": every linear INT4
    shipped-a8  as shipped, activations="int8" (EngineConfig): every INT4/INT8 linear multiplies
             activations quantized per group of 32, as decode steps do in that mode. Scored with
             every linear call on that GEMV whatever its row count (a served prefill of 128+
             rows keeps fp32 activations, so this is the decode arithmetic throughout: a bound
             on what the mode costs, not less)

Prints a table and, as the last stdout line, one JSON object with ``ppl_<choice>_<tag>`` and
``ppl_increase_<choice>_<tag>`` (ppl / ppl of float - 1; not for float itself), with the model's
tag as in bench/vs_llamacpp.py (``1p5b``, ``0p5b``, ``gemma3_270m``, ``smollm2``).
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence

import torch

from bench.vs_llamacpp import MODELS, model_tag, served_as_shipped
from engine.layers.attention import get_attention_backend
from engine.models.loader import load_model, resolve_model_path
from engine.quant.linear import base as linear  # DEQUANT_ROWS: the kinds read it there
from engine.quant.eval import HELDOUT, perplexity, read_text

# choice -> (quantization, dequantize, activations)
CHOICES = {"float": (None, True, "float32"), "shipped": (None, False, "float32"), "int8": ("int8", False, "float32"),
           "int4": ("int4", False, "float32"), "shipped-a8": (None, False, "int8")}
DEFAULT_CHOICES = ("float", "shipped", "int8", "int4")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gguf_ppl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="a catalogue model (pulled)")
    p.add_argument("--text", default=None,
                   help="text file to score (default: engine/quant/data/heldout_prose.txt)")
    p.add_argument("--choices", default=",".join(DEFAULT_CHOICES),
                   help=f"which of {','.join(CHOICES)} (default {','.join(DEFAULT_CHOICES)})")
    p.add_argument("--window", type=int, default=512, help="tokens per forward (default 512)")
    p.add_argument("--stride", type=int, default=256, help="new tokens scored per window (default 256)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens (default all)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: the first 64 tokens, windows of 64")
    return p


def ppl_results(tag: str, ppl: dict[str, float]) -> dict:
    """``ppl_<choice>_<tag>`` for each choice, ``ppl_increase_<choice>_<tag>`` against float."""
    out = {f"ppl_{c}_{tag}": round(v, 4) for c, v in ppl.items()}
    if "float" in ppl:
        out.update({f"ppl_increase_{c}_{tag}": round(v / ppl["float"] - 1, 4) for c, v in ppl.items() if c != "float"})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    choices = [c.strip() for c in args.choices.split(",") if c.strip()]
    if not choices or any(c not in CHOICES for c in choices):
        raise SystemExit(f"bench.gguf_ppl: --choices takes {', '.join(CHOICES)}, got {args.choices!r}")
    if args.quick:
        args.max_tokens, args.window, args.stride = 64, 64, 32
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer  # (heavy: transformers, which the engine does not load)

    text_path = args.text or str(HELDOUT["prose"])
    text = read_text(text_path)
    folder = resolve_model_path(served_as_shipped(args.model), progress=False)
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    n = min(len(ids), args.max_tokens or len(ids))
    log(f"{args.model}: {n} tokens of {text_path}, windows of {args.window} by {args.stride}")
    ppl: dict[str, float] = {}
    secs: dict[str, float] = {}
    for c in choices:
        quant, deq, act = CHOICES[c]
        t0 = time.perf_counter()
        model = load_model(folder, get_attention_backend("sdpa"), torch.float32, quantization=quant, dequantize=deq,
                           activations=act)
        t1 = time.perf_counter()
        rows = linear.DEQUANT_ROWS
        if act == "int8":  # every call on the INT8-activation GEMV, as a decode step runs it
            linear.DEQUANT_ROWS = 1 << 30
        try:
            ppl[c] = perplexity(model, ids, args.window, args.stride, args.max_tokens)
        finally:
            linear.DEQUANT_ROWS = rows
        secs[c] = time.perf_counter() - t1
        log(f"{c}: perplexity {ppl[c]:.4f} (load {t1 - t0:.0f}s, score {secs[c]:.0f}s)")
        del model
        gc.collect()
    tag = model_tag(args.model)
    res = ppl_results(tag, ppl)
    print(f"perplexity of {args.model} on {n} tokens ({text_path}), windows of {args.window} by {args.stride}"
          f"{', QUICK' if args.quick else ''}")
    print(f"{'choice':<10}{'ppl':>10}{'vs float':>10}")
    for c in choices:
        inc = res.get(f"ppl_increase_{c}_{tag}")
        print(f"{c:<10}{ppl[c]:>10.4f}{'' if inc is None else f'{inc:+.2%}':>10}")
    print(json.dumps({"model": args.model, "model_tag": tag, "text": text_path, "tokens": n, "window": args.window,
                      "stride": args.stride, "quick": args.quick, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
