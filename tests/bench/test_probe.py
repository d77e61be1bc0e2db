"""The front door's black-box probe (bench/probe.py) at small counts against a live `pdserve
serve` with two tokens: every attack at once (reconnect floods on both ports and unread streams
over both protocols among them), no 500 or INTERNAL/UNKNOWN anywhere, the second token served
over HTTP and gRPC while they are held, each refusal the documented one; and the preemption
probe: the high-priority token served over each protocol while the low one's stream, SSE or
gRPC, is preempted and resumes as one stream."""

from __future__ import annotations

import asyncio
import tempfile

import yaml

from bench.probe import Counts, probe
from bench.probe_fairness import Fairness, fairness_table
from bench.probe_preempt import Preemption, ok, run
from bench.probe_wire import serve
from router.policy import parse_policy


def test_the_probe_finds_no_500_and_the_second_token_is_served():
    # greedy_wait_s: a hang guard only (its unread gRPC stream is ended after 1 s unread)
    counts = Counts(idle_conns=20, slowloris=5, grpc_idle=5, watches=80, unread=4, grpc_unread=1,
                    unread_max_tokens=32, nesting_kb=100, victim_requests=2, victim_max_tokens=4, hold_s=1.0,
                    reconnect=1, reconnect_rate=100.0, greedy_wait_s=120.0)
    sets = ["mode=colocated", "decode.compile_decode=false", "front_door.unread_stream_timeout_s=1"]
    with tempfile.TemporaryDirectory() as d, serve(1, sets, d) as t:  # the greedy token: 1 request at a time
        tally, summary = asyncio.run(probe(t, counts))
    out = tally.outcomes
    assert summary["http_500_or_grpc_internal"] == 0, dict(out)
    assert not tally.victim_failures, tally.victim_failures
    for phase in ("idle", "attack"):
        assert out[f"victim http ({phase})"] == {"200": 2} and out[f"victim grpc ({phase})"] == {"OK": 2}
    assert out["watch"] == {"SERVING": 16, "RESOURCE_EXHAUSTED": 64}  # front_door.health_watches_per_client
    # its unread gRPC stream (opened first) holds the greedy token's one place: every SSE one is a 429 ...
    assert out["grpc unread"] == {"OK": 1} and out["unread"] == {"429": 4}
    # ... until the server ends it unread, freeing the place: the greedy token is served again
    assert out["greedy again http"] == {"200": 1} and out["greedy again grpc"] == {"OK": 1}
    assert out["grpc unread end"] == {"RESOURCE_EXHAUSTED (unread_stream_timeout_s)": 1}
    # connections opened and reset back to back, from another address, on both ports
    assert out["http reconnect"]["cycles"] > 0 and out["grpc reconnect"]["cycles"] > 0
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


def test_the_preemption_probe_preempts_the_low_stream_on_each_protocol_and_it_resumes_as_one():
    p = Preemption(rounds=1, victim_max_tokens=8, kv_cache_gb=0.005)  # (about 110 tokens: shorter greedy streams)
    sets = ["mode=colocated", "decode.compile_decode=false", f"decode.kv_cache_gb={p.kv_cache_gb}"]
    with tempfile.TemporaryDirectory() as d, serve(0, sets, d, p.policy()) as t:
        tally, summary = asyncio.run(run(t, p))
    out = tally.outcomes
    assert not tally.victim_failures and summary["http_500_or_grpc_internal"] == 0, dict(out)
    for proto, ok_ in (("http", "200"), ("grpc", "OK")):
        assert out[f"victim {proto} (idle)"] == {ok_: 1} and out[f"victim {proto} (preempting)"] == {ok_: 1}
    # each greedy stream (SSE once, gRPC once) has every token, the undisturbed run's text
    assert out["greedy sse stream"] == {"identical": 1} and out["greedy grpc stream"] == {"identical": 1}
    assert summary["preempted_greedy"] == 2  # once for each victim request, read from /metrics
    assert ok(summary, tally)
