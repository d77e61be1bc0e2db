"""The acceptance rule alone: greedy prefix + bonus, and exact rejection sampling (chi-square)."""

from __future__ import annotations

import pytest
import torch

from engine.spec.acceptance import accept_draft

P_SIGNIFICANCE = 1e-3  # as in conftest


def test_greedy_keeps_matching_prefix_then_target_token():
    target = torch.zeros(4, 10)
    for j, t in enumerate([3, 5, 7, 9]):
        target[j, t] = 1.0
    none = lambda j: None  # noqa: E731 - greedy draws nothing
    assert accept_draft([3, 5, 7], target, None, True, none) == [3, 5, 7, 9]  # all + bonus
    assert accept_draft([3, 4, 7], target, None, True, none) == [3, 5]  # first miss corrected
    assert accept_draft([0, 5, 7], target, None, True, none) == [3]
    assert accept_draft([], target[:1], None, True, none) == [3]  # no draft: plain decode


def _first_token_counts(rule, p, q, draft_of, n: int) -> torch.Tensor:
    """Counts of the first emitted token over n seeded trials of ``rule``."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(p.shape[1], dtype=torch.long)
    for _ in range(n):
        x = draft_of(gen)
        out = rule([x], p, q, False, lambda j: gen)
        counts[out[0]] += 1
    return counts


def _setup(vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1)
    p[0, 0] = 0.0  # a token the target never emits, but the draft likes
    q[0, 0] += 0.3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_sampled_first_token_follows_target(deterministic_draft, chi_square_p):
    p, q = _setup()
    if deterministic_draft:  # n-gram style: q is a point mass on the proposed token
        counts = _first_token_counts(accept_draft, p, None, lambda g: 0, 6000)
    else:
        counts = _first_token_counts(accept_draft, p, q,
                                     lambda g: int(torch.multinomial(q[0], 1, generator=g)), 6000)
    assert counts[0] == 0  # p(0) == 0: never emitted, though the draft proposes it
    assert chi_square_p(counts, p[0]) > P_SIGNIFICANCE


def test_chi_square_rejects_a_broken_rule(chi_square_p, broken_rule):
    p, q = _setup()
    draw = lambda g: int(torch.multinomial(q[0], 1, generator=g))  # noqa: E731
    counts = _first_token_counts(broken_rule, p, q, draw, 6000)
    assert chi_square_p(counts, p[0]) < P_SIGNIFICANCE
