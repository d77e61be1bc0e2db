"""Verify steps in the scheduler with a fake runner: rollback, blocks, preemption, aborts.

The fake runner keeps a fake paged KV store (slot -> (request, position, token)). Before each
step it checks that every already-computed position of a request holds that request's real
token: a rejected draft left "computed" (a rollback that went wrong) or a block freed too early
shows up at once. The "model" is greedy and depends only on the token history, and drafts are
its true continuation with random corruptions, so each request must produce exactly what it
produces alone, whatever was accepted, batched, preempted or aborted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.kv_cache import BlockManager
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler, StepPlan, StepResult


def fake_token(token_ids: list[int]) -> int:
    h = 0
    for t in token_ids:
        h = (h * 31 + t + 1) % 1_000_003
    return h % 50 + 10


def alone(r: Request, max_model_len: int = 10_000) -> list[int]:
    tokens, out = list(r.prompt_token_ids), []
    while len(out) < r.sampling_params.max_tokens and len(tokens) < max_model_len:
        t = fake_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in r.eos_token_ids:
            break
    return out


@dataclass
class FakeSpecRunner:
    bm: BlockManager
    rng: random.Random
    corrupt: float = 0.3
    slots: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    accepted: int = 0
    rejected: int = 0

    def slot(self, r: Request, pos: int) -> int:
        bs = self.bm.block_size
        return r.block_ids[pos // bs] * bs + pos % bs

    def propose(self, plan: StepPlan) -> None:
        for s in plan.speculative:
            seq, draft = list(s.request.all_token_ids), []
            for _ in range(self.rng.randint(0, s.max_spec_tokens)):
                t = fake_token(seq)
                if self.rng.random() < self.corrupt:
                    t += 100  # a wrong draft
                draft.append(t)
                seq.append(t)
            s.set_draft(draft)

    def __call__(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for s in plan.scheduled:
            r = s.request
            start = r.num_computed_tokens
            toks = r.all_token_ids[start:start + s.num_new_tokens - len(s.spec_token_ids)] + s.spec_token_ids
            assert len(r.block_ids) >= self.bm.blocks_needed(start + len(toks)), "blocks do not cover the step"
            real = r.all_token_ids
            for pos in range(start):
                _, p, tok = self.slots[self.slot(r, pos)]
                assert (p, tok) == (pos, real[pos]), f"{r.request_id}: wrong KV at {pos} (bad rollback?)"
            for i, tok in enumerate(toks):
                pos = start + i
                assert self.bm.ref_count[r.block_ids[pos // self.bm.block_size]] == 1, "write into a shared block"
                self.slots[self.slot(r, pos)] = (r.request_id, pos, tok)
            if not s.samples:
                continue
            seq = real[:start + s.num_new_tokens - len(s.spec_token_ids)]
            out = []
            for d in s.spec_token_ids:  # greedy acceptance: keep drafts while they are right
                t = fake_token(seq)
                if d != t:
                    break
                out.append(d)
                seq.append(d)
            self.accepted += len(out)
            self.rejected += len(out) < len(s.spec_token_ids)
            result.sampled[r.request_id] = out + [fake_token(seq)]
        return result


def check(s: Scheduler) -> None:
    s.bm.check_invariants()
    held: dict[int, int] = {}
    for r in s.running:
        for b in r.block_ids:
            held[b] = held.get(b, 0) + 1
    for r in s.waiting:
        assert r.block_ids == []
    assert all(s.bm.ref_count[b] == held.get(b, 0) for b in range(s.bm.num_blocks))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(8, 48), n_req=st.integers(1, 8), abort_some=st.booleans())
def test_verify_steps_roll_back_and_never_leak(seed, num_blocks, block_size, budget, n_req, abort_some):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6), bm, num_blocks * block_size)
    runner = FakeSpecRunner(bm, rng)
    shared = [rng.randint(1, 9) for _ in range(rng.randint(0, 12))]  # common prefix: cache hits
    # (prompts stay shorter than the context, as the engine requires)
    reqs = []
    for i in range(n_req):
        prompt = shared + [rng.randint(1, 9) for _ in range(rng.randint(1, 10))]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 24), temperature=0),
                    eos_token_ids=(13,))
        r.spec_k = rng.choice([0, 1, 3, 8])  # different K, and plain requests, in one batch
        reqs.append(r)
        s.add(r)
    aborted = set()
    steps = 0
    while s.has_unfinished():
        steps += 1
        assert steps < 2000, "no progress"
        plan = s.schedule()
        assert plan.num_tokens + sum(x.max_spec_tokens for x in plan.scheduled) <= budget
        runner.propose(plan)
        result = runner(plan)
        if abort_some and rng.random() < 0.05 and s.running:
            victim = rng.choice(s.running)  # aborted while the step ran
            s.abort(victim.request_id)
            aborted.add(victim.request_id)
        s.update(plan, result)
        check(s)
        for r in s.running:
            assert len(r.block_ids) <= bm.blocks_needed(r.num_tokens)  # nothing held past the end
    for r in reqs:
        if r.request_id not in aborted:
            assert r.output_token_ids == alone(r, s.max_model_len), r.request_id
    assert bm.num_used_blocks == 0 and not s.requests


def test_rejected_positions_are_recomputed_and_not_cached():
    """A verify of 4 wrong drafts keeps only the target's token; the next step recomputes from
    there, and no block holding a rejected token is ever registered in the prefix cache."""
    bm = BlockManager(16, 4)
    s = Scheduler(SchedulerConfig(), bm, 64)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0))
    s.add(r)
    runner = FakeSpecRunner(bm, random.Random(0), corrupt=1.0)
    s.update(plan := s.schedule(), runner(plan))  # prefill: first token
    r.spec_k = 4
    plan = s.schedule()
    assert plan.scheduled[0].max_spec_tokens == 4 and len(r.block_ids) == bm.blocks_needed(4 + 4)
    plan.scheduled[0].set_draft([100, 101, 102, 103])
    s.update(plan, runner(plan))
    assert r.num_computed_tokens == 4 and r.num_tokens == 5  # last token computed, drafts rolled back
    assert len(r.block_ids) == bm.blocks_needed(5)  # the blocks past the end went back
    assert all(bm.block_hash[b] is None for b in r.block_ids[1:])
    hashed = {bm.block_hash[b] for b in r.block_ids if bm.block_hash[b] is not None}
    assert hashed == {bm.hash_block(None, r.all_token_ids[:4])}
    r.spec_k = 0
    while s.has_unfinished():
        s.update(plan := s.schedule(), runner(plan))
    assert r.output_token_ids == alone(r)
    assert bm.num_used_blocks == 0
