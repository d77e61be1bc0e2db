"""Engine benchmark: pdserve's LLMEngine against HF transformers on the bundled model, one process.

Workloads (random token-id prompts, distinct per prompt and per repetition, so the prefix cache
never helps; every output is checked for ``num_cached_tokens == 0``):

- decode at batch 1, 8, 32: 128-token prompts, 128 new tokens, greedy, ``ignore_eos``; a
  warm-up run of the same shape, then the fastest of ``--decode-reps`` runs (a busy machine
  stalls single runs). ``decode`` tok/s is the steady rate: tokens produced after every request
  has its first token, divided by the time since then. ``e2e`` tok/s is all new tokens over the
  whole run, prefill included. HF (batch 1 only) uses the same definition for ``decode``:
  ``(N - 1) / (t(generate N) - t(generate 1))``, each time the fastest of a few calls; its
  ``e2e`` is ``N / t(generate N)``.
- prefill on 512- and 2,048-token prompts: ``max_tokens=1``, tok/s = prompt length / time to
  first token, best of a few after a warm-up. The token budget is 2,048 so a 2,048 prompt is one
  forward. HF: one forward over the prompt with ``logits_to_keep=1`` (as ``generate`` does).
- memory roofline: ``weight_bytes_per_token`` is every parameter a decode step reads (all
  linears, LM head, norms; not the embedding lookup), counted from our model's parameters;
  ``read_bandwidth_gb_s`` is a ``sum()`` over a 512 MiB fp32 tensor, ``copy_bandwidth_gb_s`` a
  256 MiB ``copy_`` counting read + write (2 x 256 MiB per copy); both best of 5, GB = 1e9 B;
  ``roofline_tok_s_b1`` = read bandwidth / weight bytes per token.

``peak_rss_mb`` is the process peak (ru_maxrss) after the engine workloads, before the bandwidth
probes and the HF model are allocated: Python + torch + engine, its model-loading transient
included; ``rss_after_engine_mb`` is what the engine still holds then (model + KV cache);
``peak_rss_mb_total`` is the peak at the end.

Prints a progress line per phase on stderr, a table on stdout, and as the last stdout line one
flat JSON object. Runs as ``python bench/engine.py`` or ``python -m bench.engine``.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence

import psutil
import torch
from torch import nn

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams


PROMPT_LEN = 128
PREFILL_BUDGET = 2048  # max_num_batched_tokens: a 2,048-token prompt is one forward
FIRST_ID = 100  # random prompt ids stay clear of the special tokens at the start of the vocab


class Progress:
    """``[k/N] phase ...`` lines on stderr, with the seconds since start."""

    def __init__(self, total: int) -> None:
        self.total, self.k, self.t0 = total, 0, time.perf_counter()

    def __call__(self, msg: str) -> None:
        self.k += 1
        print(f"[{self.k}/{self.total}] {msg} ... (t={time.perf_counter() - self.t0:.0f}s)",
              file=sys.stderr, flush=True)


class Prompts:
    """Random token-id prompts; a fresh draw every call so no two prompts share a prefix."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def __call__(self, batch: int, length: int) -> list[list[int]]:
        return torch.randint(FIRST_ID, self.vocab, (batch, length), generator=self.gen).tolist()


def rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---- pdserve --------------------------------------------------------------------------------
def run_engine(eng: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict:
    """Step ``prompts`` to completion as one batch; returns outputs and the decode-window timing."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [eng.add_request(list(p), sp) for p in prompts]
    started: set[str] = set()
    final: dict[str, RequestOutput] = {}
    produced, steps = 0, 0
    t_dec, produced_at_dec = None, 0
    while eng.has_unfinished():
        outs = eng.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            produced += len(o.new_token_ids)
            if o.new_token_ids:
                started.add(o.request_id)
            if o.finished:
                final[o.request_id] = o
        if t_dec is None and len(started) == len(ids):
            t_dec, produced_at_dec = now, produced  # every prompt is prefilled: decode from here
    t_end = time.perf_counter()
    outs = [final[i] for i in ids]
    for o in outs:
        assert len(o.token_ids) == max_tokens, f"{o.request_id}: {len(o.token_ids)} != {max_tokens}"
        assert o.num_cached_tokens == 0, f"{o.request_id}: prefix cache hit ({o.num_cached_tokens})"
    dec_tokens = produced - produced_at_dec
    return {
        "outputs": outs,
        "steps": steps,
        "e2e_tok_s": produced / (t_end - t0),
        "decode_tok_s": dec_tokens / (t_end - t_dec) if dec_tokens else math.nan,
    }


def engine_decode(eng: LLMEngine, prompts: Prompts, batch: int, new_tokens: int, reps: int) -> dict:
    run_engine(eng, prompts(batch, PROMPT_LEN), min(8, new_tokens))  # warm-up, same shapes
    runs = [run_engine(eng, prompts(batch, PROMPT_LEN), new_tokens) for _ in range(reps)]
    r = max(runs, key=lambda x: x["decode_tok_s"])
    outs = r["outputs"]
    r["ttft"] = sum(o.ttft for o in outs) / len(outs)
    r["tpot"] = sum(o.mean_tpot for o in outs) / len(outs)
    return r


def engine_prefill(eng: LLMEngine, prompts: Prompts, length: int, reps: int) -> dict:
    run_engine(eng, prompts(1, length), 1)  # warm-up
    runs = [run_engine(eng, prompts(1, length), 1) for _ in range(reps)]
    ttft = min(r["outputs"][0].ttft for r in runs)
    return {"tok_s": length / ttft, "ttft": ttft, "steps": runs[0]["steps"]}


def profile_decode(eng: LLMEngine, prompts: Prompts, steps: int = 20, rows: int = 25) -> str:
    """torch.profiler over ``steps`` batch-1 decode steps; the top ops by self CPU time."""
    # (heavy: torch.profiler, only with --profile, loaded only by what uses them)
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    rid = eng.add_request(prompts(1, PROMPT_LEN)[0], sp)
    while not any(o.new_token_ids for o in eng.step()):  # prefill
        pass
    for _ in range(3):  # warm decode steps
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = time.perf_counter() - t0
    eng.abort(rid)
    avgs = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in avgs) / 1e3  # ms, on the calling thread
    head = (f"profile: {steps} batch-1 decode steps, {wall / steps * 1e3:.1f} ms/step under the "
            f"profiler; ATen ops' self CPU time {in_ops / steps:.1f} ms/step, the rest "
            f"({max(0.0, wall * 1e3 - in_ops) / steps:.1f} ms/step) is Python/dispatch outside ops")
    return head + "\n" + avgs.table(sort_by="self_cpu_time_total", row_limit=rows)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of parameters one decode step reads: everything but the embedding table (a lookup
    touches one row). Our LM head is its own (untied) tensor, so it is counted here."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            continue
        total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


# ---- memory bandwidth -------------------------------------------------------------------------
def best_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gb_s(mib: int = 256, reps: int = 5) -> float:
    """``dst.copy_(src)`` of ``mib`` MiB; counts read + write (2 x size per copy)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_time(lambda: dst.copy_(src), reps) / 1e9


def read_bandwidth_gb_s(mib: int = 512, reps: int = 5) -> float:
    """``x.sum()`` over ``mib`` MiB of fp32 with the current thread count; counts bytes read."""
    x = torch.ones(mib * 2**20 // 4)
    return x.nbytes / best_time(lambda: x.sum(), reps) / 1e9


# ---- HF transformers --------------------------------------------------------------------------
def hf_generate_s(model, ids: list[int], n: int, pad: int) -> float:
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t0
    assert out.shape[1] == len(ids) + n, out.shape
    return dt


def hf_decode(model, prompts: Prompts, new_tokens: int, pad: int, reps: int) -> dict:
    hf_generate_s(model, prompts(1, PROMPT_LEN)[0], min(8, new_tokens), pad)  # warm-up
    t1 = min(hf_generate_s(model, prompts(1, PROMPT_LEN)[0], 1, pad) for _ in range(max(2, reps)))
    tn = min(hf_generate_s(model, prompts(1, PROMPT_LEN)[0], new_tokens, pad) for _ in range(reps))
    return {"decode_tok_s": (new_tokens - 1) / (tn - t1), "e2e_tok_s": new_tokens / tn, "ttft": t1}


def hf_prefill(model, prompts: Prompts, length: int, reps: int) -> dict:
    def fwd() -> float:
        x = torch.tensor(prompts(1, length))
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(input_ids=x, logits_to_keep=1)
            return time.perf_counter() - t0

    fwd()  # warm-up
    t = min(fwd() for _ in range(reps))
    return {"tok_s": length / t, "ttft": t}


# ---- report -----------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(res: dict, args: argparse.Namespace) -> str:
    n = args.new_tokens
    g = res.get
    rows = [
        ("decode b1 (tok/s)", g("decode_tok_s_b1"), g("hf_decode_tok_s_b1"), ".1f",
         f"steady: {n - 1} tokens after the first / their time; HF: {n - 1}/(t(gen {n}) - t(gen 1))"),
        ("e2e b1 (tok/s)", g("e2e_tok_s_b1"), g("hf_e2e_tok_s_b1"), ".1f",
         f"{n} new tokens / whole request time, prefill of {PROMPT_LEN} included"),
        ("ttft b1 (s)", g("ttft_s_b1"), g("hf_ttft_s_b1"), ".3f", f"{PROMPT_LEN}-token prompt; HF: t(gen 1)"),
        ("tpot b1 (ms)", g("tpot_ms_b1"), None, ".1f", "engine's mean time per output token"),
        ("decode b8 (tok/s)", g("decode_tok_s_b8"), None, ".1f", "steady, summed over the batch"),
        ("e2e b8 (tok/s)", g("e2e_tok_s_b8"), None, ".1f", ""),
        ("decode b32 (tok/s)", g("decode_tok_s_b32"), None, ".1f", "steady, summed over the batch"),
        ("e2e b32 (tok/s)", g("e2e_tok_s_b32"), None, ".1f", ""),
        ("prefill 512 (tok/s)", g("prefill_tok_s_512"), g("hf_prefill_tok_s_512"), ".0f",
         "512 / ttft, best of reps; HF: one forward, logits_to_keep=1"),
        ("prefill 2048 (tok/s)", g("prefill_tok_s_2048"), g("hf_prefill_tok_s_2048"), ".0f",
         f"budget {PREFILL_BUDGET} tokens: {fmt(g('prefill_2048_steps'), 'd')} step(s)"
         + ("" if g("prefill_tok_s_2048_chunked") is None else
            f"; default budget (chunked): {g('prefill_tok_s_2048_chunked'):.0f} tok/s")),
    ]
    w = 22
    lines = [f"pdserve engine benchmark: {res['model']}, {res['dtype']}, {res['threads']} threads, "
             f"torch {res['torch_version']}{', QUICK' if args.quick else ''}",
             f"{'workload':<{w}} {'pdserve':>9} {'HF':>9} {'ours/HF':>8}  note",
             "-" * 100]
    for name, ours, hf, spec, note in rows:
        if ours is None and hf is None:
            continue
        r = ratio(ours, hf)
        lines.append(f"{name:<{w}} {fmt(ours, spec):>9} {fmt(hf, spec):>9} "
                     f"{fmt(r, '.2f') + 'x' if r else '-':>8}  {note}")
    lines += [
        "-" * 100,
        f"memory: read {res['read_bandwidth_gb_s']:.1f} GB/s (sum over 512 MiB), copy "
        f"{res['copy_bandwidth_gb_s']:.1f} GB/s (256 MiB copy_, read+write counted)",
        f"roofline b1: {res['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token -> "
        f"{res['roofline_tok_s_b1']:.1f} tok/s; decode b1 reaches {res['decode_b1_vs_roofline']:.0%} of it",
        f"decode b32 / b1: {fmt(g('decode_b32_vs_b1'), '.1f')}x",
        f"RSS: peak {res['peak_rss_mb']:.0f} MB by the end of the engine runs (model loading included), "
        f"{res['rss_after_engine_mb']:.0f} MB held after them (KV cache {res['kv_cache_mb']:.0f} MB); "
        f"peak {res['peak_rss_mb_total']:.0f} MB with HF",
        f"wall time {res['wall_s']:.0f} s (engine load {res['engine_load_s']:.1f} s, HF load "
        f"{res['hf_load_s']:.1f} s)",
    ]
    return "\n".join(lines)


def sig(v):
    return float(f"{v:.4g}") if isinstance(v, float) and math.isfinite(v) else v


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark pdserve's engine against HF transformers on the bundled SmolLM2-135M, "
                    "in one process: decode at batch 1/8/32 (128-token prompts, 128 new tokens), "
                    "prefill of 512/2048-token prompts, memory bandwidth and the batch-1 roofline, "
                    "peak RSS. Prints progress on stderr, a table on stdout and, as the last stdout "
                    "line, one flat JSON object.",
        epilog="Timings are wall-clock on a shared machine: compare runs on the same machine only.")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights/activations dtype for both engines (default float32)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (< 90 s): 32 new tokens, batch 1 and 8 only, prefill 512 only")
    p.add_argument("--profile", action="store_true",
                   help="also run torch.profiler over 20 batch-1 decode steps and print the top ops "
                        "by self CPU time")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--decode-reps", type=int, default=None,
                   help="timed runs per decode workload after the warm-up, fastest taken: a busy "
                        "machine stalls single runs (default 2, --quick 1)")
    p.add_argument("--prefill-reps", type=int, default=None,
                   help="timed repetitions per prefill size, best taken (default 3, --quick 2)")
    args = p.parse_args(argv)
    args.new_tokens = 32 if args.quick else 128
    args.batches = (1, 8) if args.quick else (1, 8, 32)
    args.prefill_lens = (512,) if args.quick else (512, 2048)
    args.prefill_reps = args.prefill_reps or (2 if args.quick else 3)
    args.decode_reps = args.decode_reps or (1 if args.quick else 2)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    default_budget = SchedulerConfig().max_num_batched_tokens
    chunked = default_budget < max(args.prefill_lens)
    phases = (1 + len(args.batches) + len(args.prefill_lens) + chunked + args.profile
              + 1 + 1 + 1 + len(args.prefill_lens))
    progress = Progress(phases)
    res: dict = {"dtype": args.dtype, "threads": torch.get_num_threads(), "torch_version": torch.__version__,
                 "quick": args.quick, "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens,
                 "decode_reps": args.decode_reps, "prefill_reps": args.prefill_reps}

    # KV cache sized for the largest workload (+ a margin), so RSS is not dominated by idle cache.
    need = max(max(args.batches) * (PROMPT_LEN + args.new_tokens), max(args.prefill_lens) + 1)
    cache = CacheConfig(num_blocks=-(-need // 16) + 64, block_size=16)
    sched = SchedulerConfig(max_num_batched_tokens=PREFILL_BUDGET, max_num_seqs=64)
    progress(f"load pdserve engine ({args.dtype})")
    eng = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads, cache=cache, scheduler=sched),
                    progress=True)
    model_path = eng.model_path
    res["model"] = model_path.name
    res["engine_load_s"] = eng.load_seconds
    res["kv_cache_mb"] = sum(k.nbytes + v.nbytes for k, v in eng.runner.kv_caches) / 2**20
    prompts = Prompts(eng.model_config.vocab_size)

    for b in args.batches:
        progress(f"decode b{b}: {PROMPT_LEN}-token prompts, {args.new_tokens} new tokens")
        r = engine_decode(eng, prompts, b, args.new_tokens, args.decode_reps)
        res[f"decode_tok_s_b{b}"] = r["decode_tok_s"]
        res[f"e2e_tok_s_b{b}"] = r["e2e_tok_s"]
        if b == 1:
            res["ttft_s_b1"], res["tpot_ms_b1"] = r["ttft"], r["tpot"] * 1e3
    for n in args.prefill_lens:
        progress(f"prefill {n} tokens (budget {PREFILL_BUDGET})")
        r = engine_prefill(eng, prompts, n, args.prefill_reps)
        res[f"prefill_tok_s_{n}"] = r["tok_s"]
        res[f"prefill_{n}_steps"] = r["steps"]
    profile_text = None
    if args.profile:
        progress("profile 20 batch-1 decode steps")
        profile_text = profile_decode(eng, prompts)
    res["weight_bytes_per_token"] = weight_bytes_per_token(eng.model)
    del eng
    if chunked:  # only when the default token budget would chunk the longest prompt
        n = max(args.prefill_lens)
        progress(f"prefill {n} tokens, default budget {default_budget} (chunked)")
        eng = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads, cache=cache), progress=False)
        res[f"prefill_tok_s_{n}_chunked"] = engine_prefill(eng, prompts, n, args.prefill_reps)["tok_s"]
        del eng
    res["peak_rss_mb"] = rss_peak_mb()
    res["rss_after_engine_mb"] = psutil.Process().memory_info().rss / 2**20

    progress("memory bandwidth: 256 MiB copy, 512 MiB sum")
    res["copy_bandwidth_gb_s"] = copy_bandwidth_gb_s()
    res["read_bandwidth_gb_s"] = read_bandwidth_gb_s()

    progress("load HF transformers model")
    # (heavy: transformers, which the engine does not load, loaded only by what uses them)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, args.dtype)).eval()
    res["hf_load_s"] = time.perf_counter() - t0
    pad = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0

    progress(f"HF decode b1: generate({args.new_tokens}) and generate(1)")
    r = hf_decode(hf, prompts, args.new_tokens, pad, args.decode_reps)
    res["hf_decode_tok_s_b1"], res["hf_e2e_tok_s_b1"], res["hf_ttft_s_b1"] = (
        r["decode_tok_s"], r["e2e_tok_s"], r["ttft"])
    for n in args.prefill_lens:
        progress(f"HF prefill {n} tokens: one forward")
        res[f"hf_prefill_tok_s_{n}"] = hf_prefill(hf, prompts, n, args.prefill_reps)["tok_s"]

    # Ratios and the roofline; keys the workload set skipped are null.
    for k in ("decode_tok_s_b32", "prefill_tok_s_2048", "hf_prefill_tok_s_2048"):
        res.setdefault(k, None)
    res["decode_b1_vs_hf"] = ratio(res["decode_tok_s_b1"], res["hf_decode_tok_s_b1"])
    res["decode_b32_vs_b1"] = ratio(res["decode_tok_s_b32"], res["decode_tok_s_b1"])
    res["prefill_2048_vs_hf"] = ratio(res["prefill_tok_s_2048"], res["hf_prefill_tok_s_2048"])
    res["prefill_512_vs_hf"] = ratio(res["prefill_tok_s_512"], res["hf_prefill_tok_s_512"])
    res["roofline_tok_s_b1"] = res["read_bandwidth_gb_s"] * 1e9 / res["weight_bytes_per_token"]
    res["decode_b1_vs_roofline"] = res["decode_tok_s_b1"] / res["roofline_tok_s_b1"]
    res["peak_rss_mb_total"] = rss_peak_mb()
    res["rss_now_mb"] = psutil.Process().memory_info().rss / 2**20
    res["wall_s"] = time.perf_counter() - t_start

    if profile_text:
        print(profile_text + "\n")
    print(table(res, args))
    print(json.dumps({k: sig(v) for k, v in res.items()}), flush=True)
    return res


if __name__ == "__main__":
    main()
