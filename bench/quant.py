"""Quantization benchmark: speed and quality of full precision vs INT8 / INT4 on the bundled model.

Variants (each built like a user would: ``engine.quant`` on the fp32 weights, saved as a
quantized checkpoint, loaded by a fresh LLMEngine):

    fp32            the full-precision engine (oneDNN-prepacked fp32 linears)
    int8            INT8 per channel, RTN
    int4-rtn        INT4 groups of 128 (64 where 128 does not divide 576), RTN
    int4-gptq       the same format, GPTQ on the default calibration sample
    int4-gptq-prot  GPTQ with automatic protection: the fewest decoder layers kept in fp32 so
                    that the calibration perplexity rises at most --max-ppl-increase
    w8a8            SmoothQuant W8A8 (fbgemm int8 x int8), with --w8a8

For each: linear weight bytes read per decode step, decode tokens/s at batch 1 and 16
(128-token random prompts, greedy, best of --reps after a warm-up; steady decode rate),
sliding-window perplexity on the bundled held-out prose and code, and greedy agreement with
fp32 (teacher-forced argmax match on fp32's greedy continuations of a prompt set). Then a
kernel table: one matmul per distinct linear shape at 1 row, fp32 (oneDNN) vs the packed INT8 /
INT4 kernels with bf16 and fp32 activations, a compiled fused INT8 dequantize-matvec (Inductor)
and fbgemm W8A8; in a micro-benchmark the small
layers stay in the 32 MiB L3, so those times flatter every kernel against end-to-end decode.

Prints progress on stderr, a table on stdout and, as the last line, one flat JSON object
(``int8_speedup_b1``, ``int4_speedup_b1``, ``int8_ppl_increase_prose``, ... as fractions).
Run: ``flock /tmp/pdserve-bench.lock .venv/bin/python bench/quant.py [--quick] [--threads 1]``.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from engine.config import CacheConfig, EngineConfig
from engine.layers.linear import PackedLinear
from engine.llm_engine import LLMEngine
from engine.models.gguf_convert import default_model_path
from engine.quant import QuantConfig, quantize
from engine.quant.calib import calib_sequences, load_calib_texts
from engine.quant.checkpoint import save_quantized
from engine.quant.cpu_kernels import cpu_class, w8a8_available
from engine.quant.kernel_report import report
from engine.quant.eval import AGREEMENT_PROMPTS, HELDOUT, greedy_agreement, perplexity
from engine.quant.formats import quantize_weight
from engine.quant.linear import Int4Linear, Int8Linear, QuantLinear, W8A8Linear
from engine.quant.linear.activations import choose_act_dtype
from engine.quant.offline import convert, load_plain
from engine.request import SamplingParams


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def linear_bytes(model: nn.Module) -> int:
    """Bytes of every linear layer's weights (what a decode step streams), LM head included."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes()
        elif isinstance(m, nn.Linear) or type(m).__name__ == "PackedLinear":
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def decode_tok_s(eng: LLMEngine, batch: int, new_tokens: int, reps: int, seed: int) -> float:
    """Steady decode rate: tokens after every request has its first one / time since then."""
    gen = torch.Generator().manual_seed(seed)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for rep in range(reps + 1):  # the first run is the warm-up
        for p in torch.randint(100, vocab, (batch, 128), generator=gen).tolist():
            eng.add_request(p, sp)
        started, t_dec, produced = set(), None, 0
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter()
            if t_dec is not None:
                produced += sum(len(o.new_token_ids) for o in outs)
            for o in outs:
                if o.new_token_ids:
                    started.add(o.request_id)
            if t_dec is None and len(started) == batch:
                t_dec = now
        rate = produced / (time.perf_counter() - t_dec)
        if rep:
            best = max(best, rate)
    return best


def kernel_table(reps: int = 30) -> dict[str, float]:
    """Microseconds per call, one row, per distinct SmolLM2 linear shape and kernel."""

    def best_us(fn) -> float:
        fn()
        b = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            b = min(b, (time.perf_counter() - t) / reps)
        return b * 1e6

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
              "lm_head": (49152, 576)}
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, generator=g) * 0.02
            x = torch.randn(1, k, generator=g)
            lin = nn.Linear(k, n, bias=False)
            lin.weight.data = w
            mods = {"fp32": PackedLinear(lin)}
            i8 = Int8Linear(quantize_weight(w, 8, None, True))
            i4 = Int4Linear(quantize_weight(w, 4, 128 if k % 128 == 0 else 64, True))
            for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32act")):
                for q, qname in ((i8, "int8"), (i4, "int4")):
                    q.set_act_dtype(dt)
                    out[f"kernel_us_{name}_{qname}_{tag}"] = best_us(lambda q=q: q(x))
            out[f"kernel_us_{name}_fp32"] = best_us(lambda: mods["fp32"](x))
            fused = Int8Linear(quantize_weight(w, 8, None, True), kernel="fused")  # compiled dequant-matvec
            fused.set_act_dtype(torch.float32)
            out[f"kernel_us_{name}_int8_fused_fp32act"] = best_us(lambda: fused(x))
            if w8a8_available():
                w8 = W8A8Linear(quantize_weight(w, 8, None, True))
                out[f"kernel_us_{name}_w8a8"] = best_us(lambda: w8(x))
            log(f"kernels {name} done")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps (smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--reps", type=int, default=2, help="timed decode runs per workload (best kept)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens for GPTQ / SmoothQuant")
    ap.add_argument("--heldout-tokens", type=int, default=1024, help="tokens of each held-out text to score")
    ap.add_argument("--max-ppl-increase", type=float, default=0.10,
                    help="budget of the protected INT4-GPTQ variant (calibration ppl, fraction)")
    ap.add_argument("--w8a8", action="store_true", help="also run SmoothQuant W8A8")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset to run (fp32 is always run: the reference), e.g. int8,w8a8")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.reps, args.calib_tokens, args.heldout_tokens = 24, 1, 512, 512
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer  # (heavy: transformers, which the engine does not load)
    path = default_model_path(progress=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    texts = {k: tok(f.read_text())["input_ids"][:args.heldout_tokens] for k, f in HELDOUT.items()}
    seqs = calib_sequences(tok, load_calib_texts(None), 512, args.calib_tokens)
    prompts = [tok(p)["input_ids"] for p in AGREEMENT_PROMPTS]
    variants = ["fp32", "int8", "int4-rtn", "int4-gptq", "int4-gptq-prot"] + (["w8a8"] if args.w8a8 else [])
    if args.variants:
        known = variants + ([] if args.w8a8 else ["w8a8"])
        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in wanted if v not in known]
        if bad:
            ap.error(f"unknown variant(s) {bad}; valid: {', '.join(known)}")
        variants = ["fp32"] + [v for v in known[1:] if v in wanted]
    log(f"CPU class {cpu_class()} (as the kernels run: torch dispatch, measured int8 GEMM)")
    rows: dict[str, dict] = {}
    refs: list[list[int]] = []
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-quant-bench-"))
    for v in variants:
        log(f"{v}: building")
        model = load_plain(path)
        model_dir, extra = path, {}
        if v != "fp32":
            cfg = {"int8": QuantConfig(bits=8), "int4-rtn": QuantConfig(bits=4),
                   "int4-gptq": QuantConfig(bits=4, method="gptq"),
                   "int4-gptq-prot": QuantConfig(bits=4, method="gptq"),
                   "w8a8": QuantConfig(bits=8, activations="int8")}[v]
            if v == "int4-gptq-prot":
                model, cfg, rep = convert(path, cfg, None, auto_protect=args.max_ppl_increase, scan_unit="layer",
                                          calib_tokens=args.calib_tokens, heldout_tokens=256, log=log)
                extra = {"protected": len(rep["auto_protected"]),
                         "calib_increase": rep["auto_protect_calib_increase"]}
            else:
                quantize(model, cfg, seqs)
            model_dir = tmp / v
            save_quantized(model, cfg, model_dir, path)
        log(f"{v}: perplexity")
        ppl = {k: perplexity(model, ids) for k, ids in texts.items()}
        eng = LLMEngine(EngineConfig(model=str(model_dir), num_threads=args.threads,
                                     cache=CacheConfig(memory_gb=0.5)), progress=False)
        if v == "fp32":
            sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            rids = [eng.add_request(p, sp) for p in prompts]
            got: dict[str, list[int]] = {r: [] for r in rids}
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id].extend(o.new_token_ids)
            refs = [got[r] for r in rids]
        if v != "fp32" and v != "w8a8":  # per layer shape: the faster activation dtype, measured now
            chosen = choose_act_dtype(eng.model)
            extra["act_dtypes"] = {f"{k[1]}x{k[2]}": str(d).removeprefix("torch.") for k, (d, _) in chosen.items()}
        extra["kernels"] = report(model)
        agree = greedy_agreement(model, prompts, refs)
        log(f"{v}: decode")
        b1 = decode_tok_s(eng, 1, args.new_tokens, args.reps, 1)
        b16 = decode_tok_s(eng, 16, max(8, args.new_tokens // 2), args.reps, 2)
        rows[v] = {"bytes": linear_bytes(eng.model), "b1": b1, "b16": b16, **{f"ppl_{k}": x for k, x in ppl.items()},
                   "agreement": agree, **extra}
        log(f"{v}: {rows[v]}")
        del eng, model
    kernels = {} if args.no_kernels else kernel_table()

    fp = rows["fp32"]
    print(f"\nthreads={torch.get_num_threads()}, {args.new_tokens} new tokens, held-out {args.heldout_tokens} tokens each")
    print(f"{'variant':<16}{'weight MB':>10}{'b1 tok/s':>10}{'b16 tok/s':>10}{'ppl prose':>11}{'ppl code':>10}"
          f"{'agree':>7}  notes")
    for v, r in rows.items():
        note = f"{r['protected']} module(s) fp32, calib ppl +{100 * r['calib_increase']:.1f}%; " if "protected" in r else ""
        if "act_dtypes" in r:
            note += "act " + ",".join(f"{k}:{d}" for k, d in r["act_dtypes"].items())
        print(f"{v:<16}{r['bytes'] / 1e6:>10.1f}{r['b1']:>10.1f}{r['b16']:>10.1f}{r['ppl_prose']:>11.3f}"
              f"{r['ppl_code']:>10.3f}{r['agreement']:>7.3f}  {note}")
    if kernels:
        print("\nkernel us per call, 1 row (fp32 = oneDNN prepacked; bf16/fp32act = activation dtype):")
        for name in ("qkv", "o", "gate_up", "down", "lm_head"):
            ks = {k.removeprefix(f"kernel_us_{name}_"): x for k, x in kernels.items() if k.startswith(f"kernel_us_{name}_")}
            print(f"  {name:<8} " + "  ".join(f"{k}={x:.0f}" for k, x in ks.items()))
    print(f"CPU class {cpu_class()}; kernels: " + "; ".join(f"{v}: {r['kernels']}" for v, r in rows.items() if v != "fp32"))
    out: dict[str, float | int | str] = {"threads": torch.get_num_threads(), "cpu_class": cpu_class()}
    for v, r in rows.items():
        key = v.replace("-", "_")
        out.update({f"{key}_weight_bytes": r["bytes"], f"{key}_tok_s_b1": round(r["b1"], 2),
                    f"{key}_tok_s_b16": round(r["b16"], 2), f"{key}_ppl_prose": round(r["ppl_prose"], 4),
                    f"{key}_ppl_code": round(r["ppl_code"], 4), f"{key}_greedy_agreement": round(r["agreement"], 4)})
        if v != "fp32":
            out[f"{key}_speedup_b1"] = round(r["b1"] / fp["b1"], 3)
            out[f"{key}_speedup_b16"] = round(r["b16"] / fp["b16"], 3)
            out[f"{key}_ppl_increase_prose"] = round(r["ppl_prose"] / fp["ppl_prose"] - 1, 4)
            out[f"{key}_ppl_increase_code"] = round(r["ppl_code"] / fp["ppl_code"] - 1, 4)
        if "protected" in r:
            out[f"{key}_protected_layers"] = r["protected"]
    # the headline keys the issue names: INT4 = the RTN variant
    for src, dst in (("int4_rtn", "int4"),) if "int4-rtn" in rows else ():
        for suffix in ("speedup_b1", "speedup_b16", "ppl_increase_prose", "ppl_increase_code"):
            out[f"{dst}_{suffix}"] = out[f"{src}_{suffix}"]
    out.update({k: round(x, 1) for k, x in kernels.items()})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
