"""``pdserve quantize`` and ``pdserve eval-ppl``: offline conversion and quality evaluation.

Both run in this process on CPU (no cluster). ``add_commands(subparsers)`` registers them on
the main ``pdserve`` parser (cli/main.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time


class ProgressBar:
    """Messages like "layer 3/30" as a bar on stderr (one line per update when not a terminal)."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream, self.t0 = stream, time.monotonic()
        self.tty = getattr(stream, "isatty", lambda: False)()

    def __call__(self, msg: str) -> None:
        m = re.search(r"(\d+)/(\d+)", msg)
        bar = ""
        if m:
            i, n = int(m.group(1)), int(m.group(2))
            w = 24
            bar = "[" + "#" * (w * i // max(n, 1)) + "." * (w - w * i // max(n, 1)) + "] "
        line = f"{bar}{msg} ({time.monotonic() - self.t0:.0f}s)"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if m and m.group(1) == m.group(2):
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


def add_commands(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser(
        "quantize", help="quantize a model offline (INT8/INT4, RTN/GPTQ/AWQ, protected layers) into a folder",
        description="Quantize the linear layers of an HF-format Llama-family model and save a checkpoint "
                    "folder that a decode worker loads directly (decode.model in the cluster config, or "
                    "--model). Calibrates on your own text (--calib) or a bundled sample, prints a "
                    "sensitivity table with --protect auto, and a before/after quality summary "
                    "(calibration perplexity and held-out prose/code perplexity).")
    q.add_argument("--model", default=None,
                   help="full-precision model: an HF-format folder, a cached Hugging Face id or catalogue name "
                        "of one (default: the bundled SmolLM2); not a GGUF (its weights are quantized already)")
    q.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq"],
                   help="round-to-nearest, GPTQ (Hessian error compensation) or AWQ (activation-aware scaling)")
    q.add_argument("--bits", type=int, default=8, help="8 (per output channel) or 4 (per group)")
    q.add_argument("--group-size", type=int, default=None,
                   help="INT4 group size: 32, 64 or 128 (default 128, or 64/32 for layers 128 does not divide)")
    q.add_argument("--asym", action="store_true", help="asymmetric (scale + zero point) instead of symmetric")
    q.add_argument("--w8a8", action="store_true",
                   help="SmoothQuant W8A8: INT8 weights and INT8 activations (x86 CPU int8 GEMM only)")
    q.add_argument("--smooth-alpha", type=float, default=0.5, help="SmoothQuant migration strength (0..1)")
    q.add_argument("--no-act-order", action="store_true",
                   help="GPTQ: quantize columns left to right instead of by decreasing Hessian diagonal")
    q.add_argument("--damp", type=float, default=0.01, help="GPTQ damping (fraction of mean Hessian diagonal)")
    q.add_argument("--no-lm-head", action="store_true", help="keep the LM head in full precision")
    q.add_argument("--calib", default=None, help="calibration text: .txt, or .jsonl with a \"text\" field per line")
    q.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens to use (default 2048)")
    q.add_argument("--protect", nargs="+", default=[], metavar="PATTERN",
                   help="keep matching layers in full precision: globs (layers.2?.*), names (o_proj, "
                        "down_proj, lm_head, layers.29), last:N; or 'auto' with --max-ppl-increase")
    q.add_argument("--max-ppl-increase", type=float, default=None,
                   help="with --protect auto: calibration perplexity budget as a fraction (0.05 = 5%%)")
    q.add_argument("--scan-unit", default="linear", choices=["linear", "layer"],
                   help="sensitivity scan granularity (layer: one decoder layer at a time, faster)")
    q.add_argument("--out", required=True, help="output folder for the quantized checkpoint")
    q.add_argument("--format", default="pdserve", choices=["pdserve", "gptq"], dest="layout",
                   help="folder layout: pdserve (every format; default) or gptq (Hugging Face GPTQ v1, INT4 "
                        "only, one group size: what vLLM, transformers+optimum and GPTQModel load)")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser(
        "eval-ppl", help="perplexity of a model (full precision or quantized) on a text file",
        description="Sliding-window perplexity: windows of --window tokens advancing by --stride, each "
                    "token scored once. Default texts: the bundled held-out prose and code samples.")
    e.add_argument("--model", default=None,
                   help="model folder (full precision or quantized), a catalogue name, a .gguf file (its weights "
                        "as shipped, unless --dequantize) or a cached Hugging Face id (default: bundled)")
    e.add_argument("--dequantize", action="store_true",
                   help="a GGUF model: its weights dequantized to float32 instead of as shipped (INT4/INT8)")
    e.add_argument("--text", nargs="+", default=None, help="text file(s) (default: bundled prose and code)")
    e.add_argument("--quantization", default=None,
                   help="apply this quantization at load (int8, int4, int4-g64, w8a8) before evaluating")
    e.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    e.add_argument("--stride", type=int, default=256, help="tokens scored per window (default 256)")
    e.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of each text")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    e.set_defaults(func=cmd_eval_ppl)


def cmd_quantize(args: argparse.Namespace) -> int:
    # (heavy: torch and the engine, loaded only by the command that runs them)
    from engine.models.loader import resolve_model_path
    from engine.quant.config import QuantConfig
    from engine.quant.offline import convert

    protect = list(args.protect)
    auto = "auto" in protect
    if auto:
        protect.remove("auto")
        if args.max_ppl_increase is None:
            raise ValueError("--protect auto needs --max-ppl-increase (e.g. 0.05 for 5%)")
    elif args.max_ppl_increase is not None:
        raise ValueError("--max-ppl-increase only applies with --protect auto")
    cfg = QuantConfig(bits=args.bits, group_size=args.group_size, symmetric=not args.asym,
                      method=args.method, lm_head=not args.no_lm_head, protect=tuple(protect),
                      activations="int8" if args.w8a8 else "none", smooth_alpha=args.smooth_alpha,
                      act_order=not args.no_act_order, damp=args.damp)
    path = resolve_model_path(args.model, progress=True)
    from engine.models import gguf  # (heavy: the engine)
    if gguf.source(path) is not None:  # the offline methods start from full-precision linears
        raise ValueError(f"{args.model!r} is a GGUF model, quantized already: it is served as shipped (INT4/INT8 "
                         "per tensor), or dequantized with --dtype; quantize takes a full-precision HF-format folder")
    bar = ProgressBar()
    convert(path, cfg, args.out, calib=args.calib, auto_protect=args.max_ppl_increase if auto else None,
            scan_unit=args.scan_unit, calib_tokens=args.calib_tokens, progress=bar, layout=args.layout)
    bar.done()
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    # (heavy: torch, transformers and the engine, loaded only by the command that runs them)
    import torch
    from transformers import AutoTokenizer

    # (heavy: the engine)
    from engine.layers.attention import get_attention_backend
    from engine.models.loader import load_model, resolve_model_path
    from engine.quant.eval import HELDOUT, perplexity, read_text

    texts = {k: str(v) for k, v in HELDOUT.items()} if not args.text else {t: t for t in args.text}
    contents = {k: read_text(v) for k, v in texts.items()}  # fail on a bad file before loading
    path = resolve_model_path(args.model, progress=True)
    model = load_model(path, get_attention_backend("sdpa"), torch.float32, quantization=args.quantization,
                       dequantize=args.dequantize)
    tok = AutoTokenizer.from_pretrained(str(path))
    out = {}
    for name, text in contents.items():
        ids = tok(text)["input_ids"]
        t0 = time.monotonic()
        ppl = perplexity(model, ids, args.window, args.stride, args.max_tokens,
                         progress=None if args.json else
                         (lambda d, n: print(f"\r{name}: {d}/{n} tokens", end="", file=sys.stderr, flush=True)))
        out[name] = ppl
        if not args.json:
            n = min(len(ids), args.max_tokens or len(ids))
            print(f"\r{name}: perplexity {ppl:.3f} ({n} tokens, {time.monotonic() - t0:.1f}s)")
    if args.json:
        print(json.dumps({"model": str(path), "perplexity": out}))
    return 0
