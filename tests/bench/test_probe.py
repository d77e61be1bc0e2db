"""The front door's black-box probe (bench/probe.py) at small counts against a live `pdserve
serve` with two tokens: every attack at once, no 500 or INTERNAL/UNKNOWN anywhere, the second
token served over HTTP and gRPC while they are held, each refusal the documented one."""

from __future__ import annotations

import asyncio
import tempfile

import yaml

from bench.probe import Counts, Fairness, fairness_table, probe, serve
from router.policy import parse_policy


def test_the_probe_finds_no_500_and_the_second_token_is_served():
    counts = Counts(idle_conns=20, slowloris=5, grpc_idle=5, watches=80, unread=6, unread_max_tokens=32,
                    nesting_kb=100, victim_requests=2, victim_max_tokens=4, hold_s=1.0)
    with tempfile.TemporaryDirectory() as d, serve(2, ["mode=colocated", "decode.compile_decode=false"], d) as t:
        tally, summary = asyncio.run(probe(t, counts))
    out = tally.outcomes
    assert summary["http_500_or_grpc_internal"] == 0, dict(out)
    assert not tally.victim_failures, tally.victim_failures
    for phase in ("idle", "attack"):
        assert out[f"victim http ({phase})"] == {"200": 2} and out[f"victim grpc ({phase})"] == {"OK": 2}
    assert out["watch"] == {"SERVING": 64, "RESOURCE_EXHAUSTED": 16}  # front_door.health_watches
    assert out["unread"]["200"] == 2 and out["unread"]["429"] == 4  # the greedy token's max_concurrent
    assert {k: dict(out[k]) for k in ("nesting", "surrogate prompt", "surrogate content", "surrogate stop",
                                      "text/plain", "foreign host", "grpc not utf-8")} == {
        "nesting": {"400": 1}, "surrogate prompt": {"400": 1}, "surrogate content": {"400": 1},
        "surrogate stop": {"400": 1}, "text/plain": {"415": 1}, "foreign host": {"403": 1},
        "grpc not utf-8": {"INVALID_ARGUMENT": 1}}


def test_the_fairness_mode_writes_the_weights_into_the_policy_and_reports_their_ratio():
    policy = parse_policy(yaml.safe_load(Fairness().policy()), "probe")
    assert (policy.of("greedy").weight, policy.of("victim").weight) == (3.0, 1.0)
    assert policy.of("greedy").priority == policy.of("victim").priority  # one class: fair share, not strict
    row = fairness_table({"fairness_weights": [3.0, 1.0], "fairness_throughput_ratio": 2.99,
                          "fairness_expected_ratio": 3.0, "fairness_within_15pct": True,
                          "fairness_tokens_per_s_greedy": 104.7, "fairness_tokens_per_s_victim": 35.0})
    assert row.splitlines()[1].split() == ["3:1", "104.7", "35.0", "2.99", "3.00", "True"]
