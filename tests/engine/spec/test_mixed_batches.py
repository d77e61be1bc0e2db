"""Speculative and plain requests, different K, greedy and sampled, in one continuous batch on a
tiny random model: greedy outputs equal plain decoding, and aborts and preemptions leak nothing."""

from __future__ import annotations

import random

import pytest

from engine.request import SamplingParams


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    # Repeated phrases so n-gram lookup finds matches; random tails so requests differ.
    out = []
    for _ in range(n):
        phrase = [rng.randint(100, 140) for _ in range(rng.randint(2, 6))]
        out.append(phrase * rng.randint(2, 5) + [rng.randint(100, 140) for _ in range(rng.randint(1, 20))])
    return out


def _fixed_costs(policy) -> None:
    """Feed the adaptive policy made-up costs instead of measured ones, so its choice of K (and
    whether it drafts at all) does not depend on this machine's speed or load: a step costs
    10 ms + 0.5 ms per token, a draft forward 1 ms, a catch-up token 0.1 ms."""
    step, draft, catchup = policy.observe_step, policy.observe_draft, policy.observe_catchup
    policy.observe_step = lambda n, seconds: step(n, 0.010 + 0.0005 * n)
    policy.observe_draft = lambda forwards, seconds: draft(forwards, 0.001 * forwards)
    policy.observe_catchup = lambda tokens, seconds: catchup(tokens, 0.0001 * tokens)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_mixed_batch_greedy_identity_with_preemption(method, make_spec_engine, tiny_llama):
    target = tiny_llama("tiny-target", 0)
    # Adaptive K for n-gram; fixed K for the draft (K still differs: capped by max_tokens left).
    spec = dict(method=method, num_speculative_tokens=5, adaptive=method == "ngram")
    if method == "draft":  # a different random model: a mediocre draft
        spec["draft_model"] = str(tiny_llama("tiny-draft", 3, layers=1))
    rng = random.Random(1)
    prompts = _prompts(rng, 12)
    params = [SamplingParams(max_tokens=rng.randint(5, 40), temperature=0) for _ in prompts]
    plain = make_spec_engine(None, model=target, num_blocks=400, block_size=4)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    # Few blocks: requests preempt one another (recompute) while drafts are being verified.
    eng = make_spec_engine(spec, model=target, num_blocks=48, block_size=4, max_num_seqs=8)
    _fixed_costs(eng.spec.policy)
    seen_k: set[tuple[int, ...]] = set()
    propose = eng.spec.proposer.propose

    def recording(items, gen):
        seen_k.add(tuple(sorted(s.max_spec_tokens for s in items)))
        return propose(items, gen)
    eng.spec.proposer.propose = recording
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got == want
    assert eng.spec.stats()["verify_steps"] > 0
    assert any(len(set(k)) > 1 for k in seen_k), "never had different K in one step"
    assert eng.block_manager.num_used_blocks == 0


def test_aborts_and_sampling_leak_nothing(make_spec_engine, tiny_llama):
    target = tiny_llama("tiny-target", 0)
    draft = tiny_llama("tiny-draft", 3, layers=1)
    eng = make_spec_engine(dict(method="draft", draft_model=str(draft), num_speculative_tokens=4),
                           model=target, num_blocks=40, block_size=4, max_num_seqs=6)
    rng = random.Random(2)
    ids = []
    for i, p in enumerate(_prompts(rng, 10)):
        sp = SamplingParams(max_tokens=30, temperature=0 if i % 2 else 0.8, top_k=20 if i % 3 else 0,
                            repetition_penalty=1.2 if i % 4 == 0 else 1.0, seed=i)
        ids.append(eng.add_request(p, sp))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps in (3, 7, 12):  # abort mid-verify, in any queue
            eng.abort(ids[steps % len(ids)])
        eng.block_manager.check_invariants()
    assert eng.spec.stats()["verify_steps"] > 0
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.spec.proposer._computed  # per-request draft state forgotten


def test_stop_string_inside_accepted_drafts(make_spec_engine, tiny_llama, model_path):
    """A verify that accepts several tokens may run past a stop string: the output stops exactly
    where one-token steps would (same tokens, same text, same finish reason)."""
    target = tiny_llama("tiny-target", 0)
    prompt = list(range(300, 340))
    plain = make_spec_engine(None, model=target, num_blocks=100, block_size=4)
    free = plain.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    assert stop.strip()
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    want = plain.generate([prompt], sp)[0]
    assert want.finish_reason == "stop"
    eng = make_spec_engine(dict(method="draft", draft_model=str(target), num_speculative_tokens=8, adaptive=False),
                           model=target, num_blocks=100, block_size=4)  # itself as draft: all accepted
    got = eng.generate([prompt], sp)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert eng.spec.stats()["mean_tokens_per_verify"] > 2
