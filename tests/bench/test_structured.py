"""bench/structured.py: step times count only steps where every request of the batch decodes,
on the bundled model with a JSON schema."""

from __future__ import annotations

import json

from bench.structured import SCHEMA, run_batch
from engine.request import Guided, SamplingParams


def test_step_times_count_only_full_decode_steps(make_engine):
    eng = make_engine(jump_forward=8)
    prompts = [eng.tokenize(messages=[{"role": "user", "content": a}]) for a in ("Three people as JSON.", "Hi")]
    tied = SamplingParams(max_tokens=12, temperature=0, guided=Guided("json_schema", json.dumps(SCHEMA)))
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    steps, wall, texts = run_batch(eng, prompts, [tied, free])
    # the free request stops after 6 tokens: 5 steps after the prefill had both decoding
    assert len(steps) == 5 and all(0 < s <= wall for s in steps)
    assert len(texts) == 2 and texts[0].startswith("[")
