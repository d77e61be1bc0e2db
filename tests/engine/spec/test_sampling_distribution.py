"""Sampling with speculation has the target's distribution: a chi-square test on a
small-vocabulary model, and the same test failing once the acceptance rule is broken.

Target and draft are different random 16-token models, so drafts are often rejected and the
residual path matters. Each request is seeded (runs are reproducible); the first output token
comes from the prompt's forward, tokens 1 and 2 from a verify of K=2 drafts. Their marginal
distributions are compared with the exact ones computed from the target's logits, after the
same temperature / top-k / top-p / min-p filters.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.sampler import logits_to_probs

VOCAB = 16
PROMPT = [3, 7, 5, 9]
N = 1200
P_SIGNIFICANCE = 1e-3  # as in conftest
PARAMS = dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    target = tiny_llama("small-target", 0, vocab=VOCAB, logit_scale=10.0)
    draft = tiny_llama("small-draft", 1, vocab=VOCAB, logit_scale=10.0)

    def make(spec: SpeculativeConfig | None) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(target), num_threads=1, cache=CacheConfig(num_blocks=600, block_size=4),
                                      scheduler=SchedulerConfig(max_num_seqs=128), speculative=spec),
                         progress=False)
    return make(None), make(SpeculativeConfig(method="draft", draft_model=str(draft), num_speculative_tokens=2,
                                              adaptive=False))


def exact_marginals(engine: LLMEngine, sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 1) and P(token 2) from the target's filtered distributions, summed over paths."""
    def dist(seq: list[int]) -> torch.Tensor:
        from engine.sampler import apply_penalties
        logits = engine.prompt_logits(seq)[-1:]
        logits = apply_penalties(logits, [sp], [PROMPT], [seq[len(PROMPT):]])
        return logits_to_probs(logits, [sp])[0].double()

    p0 = dist(PROMPT)
    m1 = torch.zeros(VOCAB, dtype=torch.float64)
    m2 = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        if p0[a] == 0:
            continue
        p1 = dist(PROMPT + [a])
        m1 += p0[a] * p1
        for b in range(VOCAB):
            if p1[b] > 0:
                m2 += p0[a] * p1[b] * dist(PROMPT + [a, b])
    return m1, m2


def sample_counts(engine: LLMEngine) -> tuple[torch.Tensor, torch.Tensor]:
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **PARAMS) for s in range(N)]
    outs = engine.generate([PROMPT] * N, params)
    toks = torch.tensor([o.token_ids for o in outs])
    assert toks.shape == (N, 3)
    assert engine.block_manager.num_used_blocks == 0
    return torch.bincount(toks[:, 1], minlength=VOCAB), torch.bincount(toks[:, 2], minlength=VOCAB)


def test_speculative_sampling_matches_target_distribution(engines, monkeypatch, chi_square_p, broken_rule):
    plain, spec = engines
    sp = SamplingParams(max_tokens=3, **PARAMS)
    m1, m2 = exact_marginals(plain, sp)
    assert (m1 > 0).sum() > 4 and (m2 > 0).sum() > 4  # the test has distributions to tell apart

    c1, c2 = sample_counts(spec)
    stats = spec.spec.stats()
    assert 0.05 < stats["acceptance_rate"] < 0.95  # both accept and reject paths ran
    assert chi_square_p(c1, m1) > P_SIGNIFICANCE
    assert chi_square_p(c2, m2) > P_SIGNIFICANCE
    # Plain sampling passes the same test (a sanity check of the exact marginals).
    p1, p2 = sample_counts(plain)
    assert chi_square_p(p1, m1) > P_SIGNIFICANCE and chi_square_p(p2, m2) > P_SIGNIFICANCE

    # Break the rule once (resample from p instead of max(0, p - q)): the test must notice.
    import engine.spec.verify as verify_mod
    monkeypatch.setattr(verify_mod, "accept_draft", broken_rule)
    b1, b2 = sample_counts(spec)
    assert min(chi_square_p(b1, m1), chi_square_p(b2, m2)) < P_SIGNIFICANCE

