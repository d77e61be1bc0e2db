"""Structured outputs' cost at batch 8, and what jump-forward saves (issue 45's keys).

One process, one engine per setting (``LLMEngine``, greedy, the model's chat template asking
each request for a list of people as JSON). Every figure is a step time: in a continuous batch
every running request's time per output token *is* the step's time, so

- ``constrained_tpot_overhead_b8``: median step time of 8 requests under a JSON schema
  (``response_format`` json_schema: a mask per row per step) over that of the same 8 prompts
  unconstrained, minus 1;
- ``unconstrained_tpot_overhead_b8``: 4 unconstrained requests beside 4 constrained ones: their
  step time over the 8 unconstrained's, minus 1 (the constrained rows' masks are on the same
  step: the unconstrained ones wait for them);
- ``jump_forward_speedup_json``: wall time for the 8 constrained requests to finish without
  jump-forward over with it (``EngineConfig.jump_forward``: the schema's keys and punctuation
  without a forward each); ``jump_forward_same_text`` says whether every output's text was the
  same both ways (the forced text is tokenized as the grammar library does, which may differ).

Only steps with all 8 requests decoding count toward a step time (no prefill in them, none
finished). Rounds alternate the settings; medians over rounds with [min-max]. A table on
stdout, then one flat JSON line.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import statistics
import sys
import time

SCHEMA = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"type": "string", "maxLength": 16}}}}
ASKS = ["Six people as JSON, with name, age and city.", "List six friends (name, age, city) as JSON.",
        "Give me six customers as JSON objects: name, age, city.", "JSON: six authors, their age and city.",
        "Six athletes as JSON with name, age and city.", "Invent six neighbours as JSON (name, age, city).",
        "Six teachers, as a JSON list of name, age and city.", "JSON list of six musicians: name, age, city."]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_batch(eng, prompts: list[list[int]], params: list) -> tuple[list[float], float, list[str]]:
    """Step times while every request decodes, the batch's wall time, the outputs' texts."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps, texts = [], {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        full = len(eng.scheduler.running) == len(ids) and all(
            r.output_token_ids and r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running)
        t = time.perf_counter()
        outs = eng.step()
        if full:
            steps.append(time.perf_counter() - t)
        for o in outs:
            if o.finished:
                texts[o.request_id] = o.text
    return steps, time.perf_counter() - t0, [texts[i] for i in ids]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a catalogue name or model folder (default: the bundled SmolLM2)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--max-tokens", type=int, default=160, help="new tokens per request at most (default 160)")
    p.add_argument("--jump-forward", type=int, default=16, help="EngineConfig.jump_forward of the jumping engine")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)

    # (heavy: torch and the engine, loaded after the arguments are checked)
    import torch
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import Guided, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)

    def engine(jump: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, jump_forward=jump, cache=CacheConfig(memory_gb=0.5)),
                         progress=False)
    log("loading two engines (jump-forward off and on) ...")
    plain_eng, jump_eng = engine(0), engine(args.jump_forward)
    prompts = [plain_eng.tokenize(messages=[{"role": "user", "content": a}]) for a in ASKS]
    g = Guided("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    tied = SamplingParams(max_tokens=args.max_tokens, temperature=0, guided=g)
    run_batch(plain_eng, prompts, [tied] * 8)  # warm-up: the grammar compiled, the kernels built
    run_batch(jump_eng, prompts[:2], [tied] * 2)
    rows: dict[str, list[float]] = {k: [] for k in ("u8", "c8", "mixed_u", "wall_plain", "wall_jump")}
    same = True
    for r in range(args.rounds):
        steps_u, _, _ = run_batch(plain_eng, prompts, [free] * 8)
        steps_c, wall_c, text_c = run_batch(plain_eng, prompts, [tied] * 8)
        steps_m, _, _ = run_batch(plain_eng, prompts, [tied, free] * 4)
        _, wall_j, text_j = run_batch(jump_eng, prompts, [tied] * 8)
        same = same and text_c == text_j
        for key, v in (("u8", steps_u), ("c8", steps_c), ("mixed_u", steps_m)):
            rows[key].append(statistics.median(v) if v else float("nan"))
        rows["wall_plain"].append(wall_c)
        rows["wall_jump"].append(wall_j)
        log(f"round {r + 1}/{args.rounds}: step ms unconstrained {rows['u8'][-1] * 1e3:.1f}, constrained "
            f"{rows['c8'][-1] * 1e3:.1f}, mixed {rows['mixed_u'][-1] * 1e3:.1f}; constrained batch "
            f"{wall_c:.1f} s, with jump-forward {wall_j:.1f} s")

    def ratio(a: str, b: str) -> list[float]:
        return sorted(x / y for x, y in zip(rows[a], rows[b]))
    c_over, m_over, jf = ratio("c8", "u8"), ratio("mixed_u", "u8"), ratio("wall_plain", "wall_jump")
    out = {"model": args.model or "smollm2-135m", "rounds": args.rounds, "batch": 8,
           "step_ms_unconstrained_b8": round(statistics.median(rows["u8"]) * 1e3, 2),
           "step_ms_constrained_b8": round(statistics.median(rows["c8"]) * 1e3, 2),
           "constrained_tpot_overhead_b8": round(statistics.median(c_over) - 1, 4),
           "constrained_tpot_overhead_b8_range": [round(c_over[0] - 1, 4), round(c_over[-1] - 1, 4)],
           "unconstrained_tpot_overhead_b8": round(statistics.median(m_over) - 1, 4),
           "unconstrained_tpot_overhead_b8_range": [round(m_over[0] - 1, 4), round(m_over[-1] - 1, 4)],
           "jump_forward_speedup_json": round(statistics.median(jf), 3),
           "jump_forward_speedup_json_range": [round(jf[0], 3), round(jf[-1], 3)],
           "jump_forward_same_text": same}
    print(f"batch 8, {args.rounds} rounds, median [min-max]\n"
          f"  constrained step over unconstrained        {out['constrained_tpot_overhead_b8']:+.1%} "
          f"[{c_over[0] - 1:+.1%} .. {c_over[-1] - 1:+.1%}]\n"
          f"  unconstrained beside constrained           {out['unconstrained_tpot_overhead_b8']:+.1%} "
          f"[{m_over[0] - 1:+.1%} .. {m_over[-1] - 1:+.1%}]\n"
          f"  jump-forward speedup (8 JSON answers)      {out['jump_forward_speedup_json']:.2f}x "
          f"[{jf[0]:.2f} .. {jf[-1]:.2f}], same text: {same}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
