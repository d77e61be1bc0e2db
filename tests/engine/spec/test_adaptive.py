"""Adaptive K: longer drafts when they are accepted and verifying is cheap, none when the
measured gain is below 1, occasional probes that back off, and a worker-wide prior."""

from __future__ import annotations

from engine.spec.adaptive import PROBE_EVERY, AdaptiveK, expected_tokens


def _cheap_verify(p: AdaptiveK) -> None:
    for _ in range(20):  # batch 1 on a CPU: 5 tokens cost barely more than 1
        p.observe_step(1, 0.040)
        p.observe_step(5, 0.044)


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12  # 1 + 0.5 + 0.25


def test_k_follows_acceptance_and_switches_off():
    p, q = AdaptiveK(8), AdaptiveK(8)
    for pol in (p, q):
        _cheap_verify(pol)
    for _ in range(10):
        p.observe_verify("good", 4, 4)
        q.observe_verify("bad", 4, 0)
    assert p.choose("good", 1) >= 4
    assert q.choose("bad", 1) == 0  # alpha ~0: no K gains anything
    assert q.gain(q.alpha("bad"), 1, 1) < 1.0


def test_expensive_verify_turns_mediocre_drafts_off():
    p = AdaptiveK(8)
    for _ in range(20):  # a compute-bound batch: 8 more tokens cost 3x the step
        p.observe_step(8, 0.05)
        p.observe_step(16, 0.15)
    for _ in range(6):
        p.observe_verify("r", 2, 1)  # alpha ~0.5
    assert p.choose("r", 8) == 0


def test_off_requests_probe_with_backoff():
    p = AdaptiveK(8)
    _cheap_verify(p)
    for _ in range(6):
        p.observe_verify("r", 4, 0)
    ks = [p.choose("r", 1) for _ in range(PROBE_EVERY * 4)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes and all(ks[i] == 1 for i in probes)  # a probe is a single draft token
    assert probes[1] - probes[0] > probes[0]  # the wait doubles after a failed probe


def test_new_requests_start_from_the_worker_acceptance():
    p = AdaptiveK(8)
    _cheap_verify(p)
    for i in range(30):
        p.observe_verify(f"old{i}", 4, 0)
    assert p.choose("new", 1) == 0  # the draft proved useless here: do not pay to relearn it


def test_fixed_k_when_not_adaptive():
    p = AdaptiveK(3, adaptive=False)
    p.observe_verify("r", 3, 0)
    assert p.choose("r", 1) == 3


def test_costly_catch_up_keeps_a_request_off():
    p = AdaptiveK(8)
    _cheap_verify(p)
    for _ in range(10):
        p.observe_verify("r", 4, 3)
    assert p.choose("r", 1, stale=0, remaining=50) > 0
    p.observe_catchup(100, 2.0)  # 20 ms per token: a 500-token catch-up costs 10 s
    assert p.choose("r", 1, stale=500, remaining=50) == 0  # 50 tokens cannot pay that back
    assert p.choose("r", 1, stale=500, remaining=100_000) > 0


def test_a_fast_one_token_step_is_measured_apart_from_the_line():
    p = AdaptiveK(8)
    for _ in range(20):  # one-token steps on a fast path; batched steps on the eager line
        p.observe_step(1, 0.020)
        p.observe_step(5, 0.040)
        p.observe_step(9, 0.048)
    assert abs(p.times.predict(1) - 0.020) < 1e-9  # measured, not the line's
    assert 0.038 < p.times.predict(5) < 0.042 and 0.046 < p.times.predict(9) < 0.050
    assert p.times.predict(2) > 0.028  # the batched line, not a blend with the fast path
    for _ in range(10):
        p.observe_verify("weak", 4, 0)
        p.observe_verify("good", 4, 4)
    # against the fast one-token step (not the line's ~0.03 s) weak drafts do not pay
    assert p.choose("weak", 1) == 0 and p.choose("good", 1) >= 4


def test_a_costly_first_extra_token_does_not_price_long_drafts_out():
    """With a fast one-token path, a 2-token verify costs much more than a plain step, but that
    is a fixed jump, not a per-token slope: well-accepted drafts must still get long K."""
    p = AdaptiveK(8)
    for _ in range(30):
        p.observe_step(1, 0.025)
    for _ in range(3):  # probes: one draft each, all accepted
        p.observe_step(2, 0.045)
        p.observe_verify("rep", 1, 1)
    assert p.choose("rep", 1) >= 3
