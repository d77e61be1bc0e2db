"""The cluster simulator (bench/simulate.py, bench/sim/): deterministic, conserving, driven by
the router's real policy functions, and exact on scenarios small enough to work out by hand.
Every test uses the fixed cost model beside this file (round numbers, no timing)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import bench.sim.policy as policy
from bench.sim.cluster import MODES, Cluster, ClusterSpec
from bench.sim.costs import from_json, load
from bench.sim.report import summarize
from bench.sim.traces import SLO, Spec, make_trace
from bench.sim.workers import SimJob, SimWorker
from bench.simulate import main as sim_main
from router.placement import Wait
from router.prefix_index import block_hashes

COST = load(Path(__file__).with_name("sim_cost_fixed.json"))


def _spec(mode: str, n: int = 4, p: int = 1, **kw) -> ClusterSpec:
    return ClusterSpec(mode, n, prefill=0 if mode.startswith("colocated") else p, **kw)


def _run(mode: str, workload: str = "mix", rate: float = 1.5, duration: float = 120.0, seed: int = 3, **kw):
    c = Cluster(_spec(mode, **kw), COST)
    jobs = c.run(make_trace(workload, rate, duration, seed))
    return c, jobs


@pytest.mark.parametrize("mode", ["disaggregated-local", "adaptive"])
def test_same_seed_same_result(mode):
    a = summarize(_run(mode, "bursty")[1], SLO, 120.0)
    b = summarize(_run(mode, "bursty")[1], SLO, 120.0)
    assert a == b
    assert summarize(_run(mode, "bursty", seed=4)[1], SLO, 120.0) != a


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("workload", ["mix", "agentic"])
def test_every_request_ends_and_every_block_is_freed(mode, workload):
    # rate high enough that some wait in the router's queue (and, disaggregated 1:3, time out)
    c, jobs = _run(mode, workload, rate=3.0)
    assert jobs and all((j.finish is not None) != bool(j.refused) for j in jobs)
    for j in jobs:
        if not j.refused:
            assert j.spec.arrival <= j.placed_at <= j.first_token <= j.finish
            assert j.dblocks == 0 and j.pblocks == 0
    assert not c.queue and not c.live
    for w in c.workers.values():  # (KV below zero asserts inside SimWorker.free)
        assert w.used == 0 and w.overflow == 0 and not (w.waiting or w.ready or w.running or w.outgoing)
        assert w.max_used <= w.total


def test_the_real_functions_decide(monkeypatch):
    """Every placement is the answer of router.placement.plan (spied, not replaced)."""
    answers = []
    real = policy.plan

    def spy(view, demand):
        step = real(view, demand)
        answers.append(step)
        return step

    monkeypatch.setattr(policy, "plan", spy)
    c, jobs = _run("disaggregated-local", "agentic", rate=1.0)
    placed = [j for j in jobs if not j.refused]
    got = {(s.decode.worker_id, getattr(getattr(s, "prefill", None), "worker_id", s.decode.worker_id))
           for s in answers if not isinstance(s, Wait)}
    assert {(j.decode_id, j.prefill_id) for j in placed} <= got
    assert {j.placement.split(":")[0] for j in placed} == {"local", "pool"}
    for name in ("plan", "prefix_view", "expect_prefix"):
        assert c.calls.get(name, 0) > 0, name
    c2, _ = _run("adaptive", "mix", rate=3.0)
    assert c2.calls["roles.decide"] > 0 and c2.switches  # the real roles.decide switched workers


def test_a_cached_prefix_draws_its_prompt_to_the_worker_the_index_names():
    bs = COST.block_size
    shared = list(range(5000, 5000 + 20 * bs))
    trace = [Spec(0, 0.0, "chat", shared + [1, 2, 3], 4)]
    trace += [Spec(i, 0.001 * i, "chat", list(range(10000 * i, 10000 * i + 300)), 200) for i in (1, 2, 3)]
    trace.append(Spec(4, 30.0, "chat", shared + list(range(9000, 9040)), 4))
    c = Cluster(_spec("colocated+chunked"), COST)
    jobs = c.run(trace)
    hashes = block_hashes(trace[4].prompt, bs)
    # (the index after the run: the later prompt was recorded where it went, too)
    named = [w for w in c.workers if c.index.hit_blocks(w, hashes) >= 20]
    assert named == [jobs[0].decode_id] == [jobs[4].decode_id]
    assert jobs[4].shared == 20  # the worker's own cache held it: only the rest was computed


def test_lone_request_ttft_is_prefill_plus_transfer_exactly():
    n, m = 100, 11
    c = Cluster(_spec("disaggregated", n=2, p=1), COST)
    (job,) = c.run([Spec(0, 1.0, "chat", list(range(1000, 1000 + n)), m)])
    prefill_ms = 20.0 + 1.0 * n  # base + per prompt token (fixed costs)
    transfer_ms = 1.0 + n * 1e6 / 1e9 * 1e3  # latency + n tokens' KV at 1 GB/s
    assert job.first_token - 1.0 == pytest.approx((prefill_ms + transfer_ms) / 1e3, abs=1e-9)
    # then m - 1 decode steps of one row over contexts n .. n + m - 2
    decode_ms = sum(20.0 + 1.0 + 0.5 * (n + i) / 1e3 for i in range(m - 1))
    assert job.finish - job.first_token == pytest.approx(decode_ms / 1e3, abs=1e-9)
    assert (job.prefill_id, job.decode_id) == ("w000", "w001")


def test_colocated_queue_order_by_hand():
    """One colocated worker, unchunked: the second prompt waits for the first's step, and the
    first's decode waits for the second's prefill (prefill steps go first)."""
    c = Cluster(_spec("colocated", n=1), COST)
    a, b = c.run([Spec(0, 0.0, "chat", list(range(100, 200)), 3), Spec(1, 0.01, "chat", list(range(300, 350)), 3)])
    assert a.first_token == pytest.approx(0.120)
    assert b.first_token == pytest.approx(0.120 + 0.070)  # 20 + 50 tokens
    # then two decode steps of the batch of both (contexts 100 + 50, then 102)
    assert a.finish == pytest.approx(0.190 + (22 + 0.5 * 0.150) / 1e3 + (22 + 0.5 * 0.152) / 1e3)


def _walk(index, jobs, loads, hashes, n, bs):
    """prefix_view as it was before issue 44's bug 6: a walk over every live job on every try
    (the oracle the kept holdings must agree with)."""
    import collections
    import dataclasses

    from router.jobs import JobState
    most, queued, in_use = (n - 1) // bs, collections.Counter(), {}
    for job in jobs:
        if job.prefilling:
            queued[job.prefill_id] += job.uncached
        if job.state == JobState.RUNNING and job.prefix_hashes:
            k = 0
            while k < min(len(job.prefix_hashes), len(hashes)) and job.prefix_hashes[k] == hashes[k]:
                k += 1
            for wid in ({job.prefill_id} | ({job.decode_id} if not job.prefilling else set())) - {""}:
                if min(most, k):
                    in_use[wid] = max(in_use.get(wid, 0), min(most, k) * bs)
    cached = {w.worker_id: min(most, index.hit_blocks(w.worker_id, hashes)) * bs for w in loads}
    return [dataclasses.replace(w, queued_prompt_tokens=queued[w.worker_id]) for w in loads], (cached, in_use)


@pytest.mark.parametrize("mode", ["disaggregated-local", "colocated+chunked"])
def test_kept_holdings_equal_a_walk_over_every_live_job(monkeypatch, mode):
    """Issue 44, bug 6: a placement reads what the live jobs hold from router.holdings, kept
    as they change, instead of walking every live job per try; on a whole agentic run (shared,
    growing prefixes) every view equals the walk's."""
    c = Cluster(_spec(mode, n=4, p=2), COST)
    real, seen = policy.prefix_view, []

    def checked(index, live, loads, hashes, n, bs):
        got = real(index, live, loads, hashes, n, bs)
        want_loads, (want_cached, want_in_use) = _walk(index, c.live, loads, hashes, n, bs)
        assert got[0] == want_loads and got[1].cached == want_cached and dict(got[1].in_use) == want_in_use
        seen.append(bool(want_in_use))
        return got
    monkeypatch.setattr(policy, "prefix_view", checked)
    jobs = c.run(make_trace("agentic", 2.0, 120.0, 5))
    assert any(seen) and len(seen) > 100 and not c.live and len(c.holdings) == 0
    assert all(j.finish is not None or j.refused for j in jobs)


def test_a_clusters_overheads_add_to_every_step_and_to_each_requests_ttft():
    """cluster.loop_ms rides on every step (decode runs' closed form too); cluster.request_ms
    on each request's TTFT: the simulated router sees the request that much after it is sent."""
    import dataclasses
    n, m = 100, 11
    cost = dataclasses.replace(COST, loop_ms=3.0, request_ms=150.0)
    c = Cluster(_spec("disaggregated", n=2, p=1), cost)
    (job,) = c.run([Spec(0, 1.0, "chat", list(range(1000, 1000 + n)), m)])
    prefill_ms = 20.0 + 3.0 + 1.0 * n
    transfer_ms = 1.0 + n * 1e6 / 1e9 * 1e3
    assert job.first_token - 1.0 == pytest.approx((150.0 + prefill_ms + transfer_ms) / 1e3, abs=1e-9)
    decode_ms = sum(20.0 + 3.0 + 1.0 + 0.5 * (n + i) / 1e3 for i in range(m - 1))
    assert job.finish - job.first_token == pytest.approx(decode_ms / 1e3, abs=1e-9)
    assert cost.decode_run_ms(4, 1000, 10) == pytest.approx(sum(cost.step_ms(4, 1000 + 4 * i) for i in range(10)))
    assert cost.decode_steps_within(4, 1000, cost.decode_run_ms(4, 1000, 7) + 1e-6) == 7
    # the JSON keeps them (as "cluster"); a file without them is the engine alone (0)
    back = from_json(json.loads(json.dumps(cost.to_json())))
    assert (back.loop_ms, back.request_ms) == (3.0, 150.0) and (COST.loop_ms, COST.request_ms) == (0.0, 0.0)
    with pytest.raises(ValueError, match="cluster.request_ms"):
        from_json({**cost.to_json(), "cluster": {"request_ms": -1}})


def test_the_profiles_cluster_overheads_are_the_medians_less_the_engines_own_steps():
    """bench.sim.profile.overheads: loop_ms = median TPOT - a lone decode step at the answer's
    middle context; request_ms = median TTFT - (the prompt's step with its loop_ms, as the
    simulator charges it, + its transfer on a 1-thread (disaggregated) profile; no transfer on a
    colocated one); never below 0."""
    import dataclasses

    from bench.sim.profile import CLUSTER_ANSWER, CLUSTER_PROMPT, overheads
    step = 20.0 + 1.0 * CLUSTER_PROMPT
    transfer = 1.0 + CLUSTER_PROMPT * 1e6 / 1e9 * 1e3
    lone = 20.0 + 1.0 + 0.5 * (CLUSTER_PROMPT + CLUSTER_ANSWER // 2) / 1e3
    ttfts, tpots = [step + transfer + x for x in (90.0, 100.0, 500.0)], [lone + x for x in (4.0, 5.0, 50.0)]
    assert overheads(COST, ttfts, tpots) == pytest.approx((100.0 - 5.0, 5.0))
    two = dataclasses.replace(COST, threads=2, loop_ms=7.0)  # (a cost's own loop_ms is not the engine's)
    assert overheads(two, [step + 40.0], [lone]) == pytest.approx((40.0, 0.0))
    # the simulator then gives a lone request the measured TTFT: request_ms + (step + loop) + transfer
    request_ms, loop_ms = overheads(COST, ttfts, tpots)
    c = Cluster(_spec("disaggregated", n=2, p=1), dataclasses.replace(COST, request_ms=request_ms, loop_ms=loop_ms))
    (job,) = c.run([Spec(0, 1.0, "chat", list(range(1000, 1000 + CLUSTER_PROMPT)), CLUSTER_ANSWER)])
    assert (job.first_token - 1.0) * 1e3 == pytest.approx(step + transfer + 100.0)
    assert overheads(COST, [1.0], [1.0]) == (0.0, 0.0)


def test_a_decode_worker_awaiting_a_transfer_is_not_idle_to_placement():
    """A decode worker whose only request is one it reserved for, its prompt still in the pool,
    reports that request's tokens as still to generate (worker/step_loop.py counts requests
    waiting for KV); so a second long prompt arriving while the pool is busy goes to the pool,
    not to the "idle" decode worker (local:pool_busy). The real cluster did so on the mix, the
    simulator did not: its chats then queued behind a local document (validate, 2026-12-06)."""
    long = 500  # over local_prefill_tokens (96): never "short"
    c = Cluster(_spec("disaggregated-local", n=2, p=1), COST)
    a, b = c.run([Spec(0, 1.0, "document", list(range(1000, 1000 + long)), 8),
                  Spec(1, 1.1, "document", list(range(5000, 5000 + long)), 8)])
    assert (a.placement, b.placement) == ("pool:long", "pool:long")
    w = c.workers["w001"]
    assert w.incoming == [] and w.holds_nothing()


def test_decode_run_closed_form_matches_steps():
    for b, ctx in ((1, 100), (7, 5000), (64, 60000)):
        steps = [COST.step_ms(b, ctx + i * b) for i in range(50)]
        assert COST.decode_run_ms(b, ctx, 50) == pytest.approx(sum(steps))
        for k in (0, 1, 17, 49):
            assert COST.decode_steps_within(b, ctx, sum(steps[:k]) + 1e-6) == k


def test_cost_model_errors_name_the_field():
    d = json.loads(Path(__file__).with_name("sim_cost_fixed.json").read_text())
    with pytest.raises(ValueError, match="format"):
        from_json({**d, "format": "x"})
    with pytest.raises(ValueError, match="'step'"):
        from_json({k: v for k, v in d.items() if k != "step"})
    with pytest.raises(ValueError, match="base_ms"):
        from_json({**d, "step": {**d["step"], "base_ms": -1}})
    with pytest.raises(ValueError, match="unknown mode"):
        ClusterSpec("round-robin", 4)
    with pytest.raises(ValueError, match="known: chat"):
        make_trace("sharegpt", 1.0, 10.0)


def test_simulate_run_prints_table_and_json(capsys):
    cost = str(Path(__file__).with_name("sim_cost_fixed.json"))
    assert sim_main(["run", "--cost", cost, "--workers", "2,4", "--duration", "30", "--rate", "0.5",
                     "--splits", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(out[-1])["rows"]
    assert {(r["workers"], r["mode"]) for r in rows} == {(n, m) for n in (2, 4) for m in MODES}
    assert "TTFT p50" in out[0]


def test_pdserve_plan(capsys):
    from cli.main import build_parser, main
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--help"])
    assert "--tpot-slo" in capsys.readouterr().out
    cost = str(Path(__file__).with_name("sim_cost_fixed.json"))
    assert main(["plan", "--cost", cost, "--workload", "chat", "--workers", "2", "--duration", "30",
                 "--ttft-slo", "2", "--tpot-slo", "0.2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    modes = {got["recommended"]["mode"]} | {r["mode"] for r in got["alternatives"]}
    assert modes == set(MODES) and got["slo"]["chat"] == [2.0, 0.2]
    assert got["recommended"]["goodput_per_worker"] >= max(r["goodput_per_worker"] for r in got["alternatives"])


def test_documents_held_to_their_own_ttft_target_do_not_drain_decode():
    """Issue 44, bug 2: on 6 workers, documents' TTFT (their own long prefill) never meets
    the chats' 3 s target. Held to that one target, the pool reads as slow and decode
    workers move to prefill down to min_decode; with per-class targets (documents 20 s)
    nothing moves, and both classes meet their own targets."""
    from router.autoscale import PrefillTargets

    def run(long_ms: float):
        targets = PrefillTargets(target_ttft_ms=3000.0, target_ttft_long_ms=long_ms)
        c = Cluster(_spec("adaptive", n=6, p=1, prefill_targets=targets), COST)
        # (1.2 req/s: within the one prefill worker's reach. At 1.5 it is past it, a real
        # backlog that rightly asks for a second one, since decode workers awaiting transfers
        # no longer count as idle and take documents off the pool: local:pool_busy)
        return c, summarize(c.run(make_trace("mix", 1.2, 300.0, 3)), SLO, 300.0)
    one, _ = run(3000.0)  # one target for every request: the bug, as it was
    assert sum(w.role == "decode" for w in one.workers.values()) == 1
    per_class, s = run(20000.0)
    assert not [x for x in per_class.switches if x[3] == "prefill"]
    assert sum(w.role == "decode" for w in per_class.workers.values()) == 5
    assert s["document_ttft_ms_p90"] < 20000 and s["chat_ttft_ms_p90"] < 3000


def test_the_phase_trace_alternates_prompt_heavy_and_decode_heavy_halves():
    from bench.sim.traces import PHASE_S
    trace = make_trace("phase", 2.0, 4 * PHASE_S, 1)
    for half in range(4):
        part = [s for s in trace if half * PHASE_S <= s.arrival < (half + 1) * PHASE_S]
        docs = [s for s in part if s.cls == "document"]
        if half % 2 == 0:  # prompts: half documents, every answer short
            assert 0.35 < len(docs) / len(part) < 0.65 and max(s.max_tokens for s in part) <= 64
        else:  # decode: chats wanting long answers only
            assert not docs and min(s.max_tokens for s in part) >= 256


def test_adaptive_follows_the_phases_both_ways_and_ends_clean():
    """On the phase load the controller (router.roles, the real one) moves decode workers to
    prefill while documents come, and back while long answers run: both ways in each cycle."""
    from bench.sim.traces import PHASE_S
    c = Cluster(_spec("adaptive", n=8, p=2), COST)
    jobs = c.run(make_trace("phase", 3.0, 4 * PHASE_S, 2))
    assert all((j.finish is not None) != bool(j.refused) for j in jobs)
    assert all(w.used == 0 for w in c.workers.values())

    def ways(lo, hi):
        return {(old, new) for t, _, old, new, _ in c.switches if lo <= t < hi}
    for cycle in range(2):
        t0 = 2 * cycle * PHASE_S
        assert ("decode", "prefill") in ways(t0, t0 + PHASE_S)
        assert ("prefill", "decode") in ways(t0 + PHASE_S, t0 + 2 * PHASE_S)


def test_adaptive_slo_runs_the_controller_with_the_slos_as_its_targets(monkeypatch):
    """The labelled row adaptive-slo: the role controller's targets are the SLOs served to
    (chats' TTFT up to 1,024 prompt tokens, documents' above, the tightest TPOT); adaptive
    keeps the controller's defaults."""
    from bench.simulate import simulate, slo_targets
    from router.autoscale import DecodeTargets, PrefillTargets
    tp, td = slo_targets({"chat": (3.0, 0.25), "document": (20.0, 0.3), "agent": (5.0, 0.2)})
    assert (tp.target_ttft_ms, tp.target_ttft_long_ms, tp.long_prompt_tokens) == (3000.0, 20000.0, 1024)
    assert td.target_tpot_ms == 200.0
    seen = []
    real = Cluster.__init__

    def spy(self, spec, cost):
        seen.append((spec.mode, spec.prefill_targets, spec.decode_targets))
        real(self, spec, cost)
    monkeypatch.setattr(Cluster, "__init__", spy)
    for mode in ("adaptive-slo", "adaptive"):
        simulate(_spec(mode, n=4, p=1), COST, "mix", 0.2, 30.0, 0, SLO)
    tp, td = slo_targets(SLO)
    assert seen == [("adaptive-slo", tp, td), ("adaptive", PrefillTargets(), DecodeTargets())]


def test_a_decode_run_beside_a_busy_neighbour_on_its_node_slows_by_the_measured_factor():
    """Workers on one node share its memory bandwidth (costs.py node_decode_x): a stream
    decoding while its neighbour prefills a long prompt loses P (1 - 1/x) of progress, P the
    prompt's step. The slow pace starts and ends at a step boundary of the stream's run (the run
    is cut at its next step when the neighbour starts or stops), so the slowed span is P less up
    to one step s, or more by up to one slow step x s: the delay lies in
    [(P - s)(1 - 1/x), (P + x s)(1 - 1/x)]. Alone (node_workers 1), or with x = 1, nothing changes."""
    import dataclasses
    x, short, answer, long = 1.5, 50, 400, 1000
    trace = [Spec(0, 1.0, "chat", list(range(1000, 1000 + short)), answer),
             Spec(1, 2.0, "document", list(range(5000, 5000 + long)), 1)]  # (arrives mid-answer)
    slow = dataclasses.replace(COST, node_decode_x=x)

    def finish(cost, node_workers):
        a, b = Cluster(_spec("disaggregated", n=2, p=1, node_workers=node_workers), cost).run(trace)
        assert b.placement.startswith("pool") and b.first_token < a.finish  # (its prefill overlaps a's answer)
        return a.finish
    alone = finish(slow, 1)
    assert finish(COST, 2) == alone  # x = 1: the same as alone
    p, s = COST.step_ms(0, 0, [(long, 0)]), COST.step_ms(1, short + answer)
    delay_ms = (finish(slow, 2) - alone) * 1e3
    assert (p - s) * (1 - 1 / x) <= delay_ms <= (p + x * s) * (1 - 1 / x)
    # node_prefill_x: the prompt step beside the busy decode worker takes x times as long
    px = dataclasses.replace(COST, node_prefill_x=2.0)
    lone = Cluster(_spec("disaggregated", n=2, p=1, node_workers=1), px).run(trace)[1].first_token
    assert Cluster(_spec("disaggregated", n=2, p=1, node_workers=2), px).run(trace)[1].first_token - lone == \
        pytest.approx(p / 1e3, abs=1e-9)
    # a prompt step started on a quiet node goes on at the slow pace from when its neighbour starts:
    # b's step starts when a's ends (t_s), a's decode starts when its KV lands (t_d, 1 transfer later)
    early = [trace[0], dataclasses.replace(trace[1], arrival=1.0001)]
    b = Cluster(_spec("disaggregated", n=2, p=1, node_workers=2), px).run(early)[1]
    t_s = 1.0 + COST.step_ms(0, 0, [(short, 0)]) / 1e3
    t_d = t_s + COST.transfer_ms(short) / 1e3
    assert b.first_token == pytest.approx(t_d + (p / 1e3 - (t_d - t_s)) * 2.0 + COST.transfer_ms(long) / 1e3,
                                          abs=1e-9)
    # prefill workers (the first ones) spread over the nodes: 8 workers, 2 prefill, 2 a node
    c = Cluster(_spec("disaggregated", n=8, p=2, node_workers=2), slow)
    assert [[n.role for n in c.workers[f"w00{i}"].neighbours] for i in (0, 1)] == [["decode"], ["decode"]]
    # the JSON keeps the factors (as "node"); a file without them is 1 (no neighbour measured); below 1 is refused
    back = from_json(json.loads(json.dumps(slow.to_json())))
    assert (back.node_decode_x, back.node_prefill_x) == (x, 1.0) and COST.node_decode_x == 1.0
    with pytest.raises(ValueError, match="node.decode_x"):
        from_json({**slow.to_json(), "node": {"decode_x": 0.9}})
    # the profile's factor: median beside / median alone, never below 1 (a faster step beside a busy
    # neighbour is noise)
    from bench.sim.profile import node_factor
    assert node_factor([10.0, 10.0, 99.0], [15.0, 15.0, 1.0]) == 1.5 and node_factor([10.0], [9.0]) == 1.0


def test_plan_climbs_from_the_grid_to_the_peak_split():
    """The grid (2, 4, ..., 12 prefill workers of 16) missed the mix's peak at 13:3; climb tries the
    best's untried neighbours until the best has both: a single-peaked curve's top, whatever the
    grid's step; never a split outside 1..n-1."""
    from bench.simulate import climb, splits_for
    curve = {p: 0.4 - 0.03 * abs(p - 13) for p in range(1, 16)}
    seen = []

    def f(p):
        seen.append(p)
        return curve[p]
    grid = {p: curve[p] for p in splits_for(16, "grid")}
    got = climb(f, grid, 16)
    assert max(got, key=got.get) == 13 and seen == [11, 13, 14] and set(grid) < set(got)
    edge = climb(lambda p: curve[p] if p < 16 else 1 / 0, {15: curve[15], 14: curve[14]}, 16)
    assert max(edge, key=edge.get) == 13
    assert climb(f, {}, 16) == {}


def test_lone_long_prompts_give_the_clusters_prefill_factor_and_the_decode_sides_intake():
    """bench.sim.profile.long_overheads inverts what the simulator charges: a lone long prompt's
    TTFT and TPOT from a simulator given prefill_x and land_ms_per_ktok give both back (by hand:
    the prompt's tokens prefill_x times as long; the decode worker takes the KV in before its
    first step); a colocated profile has no intake; clamped at 1 and 0; the JSON keeps them."""
    import dataclasses

    from bench.sim.profile import CLUSTER_LONG_ANSWER as A, CLUSTER_LONG_PROMPT as P, long_overheads
    cost = dataclasses.replace(COST, request_ms=50.0, loop_ms=2.0)
    px, land = 1.25, 40.0
    c = Cluster(_spec("disaggregated", n=2, p=1), dataclasses.replace(cost, prefill_x=px, land_ms_per_ktok=land))
    (job,) = c.run([Spec(0, 1.0, "long", list(range(1000, 1000 + P)), A)])
    ttft, tpot = (job.first_token - 1.0) * 1e3, (job.finish - job.first_token) * 1e3 / (A - 1)
    tokens = cost.step_ms(0, 0, [(P, 0)]) - cost.step_ms(0, 0)
    assert ttft == pytest.approx(50.0 + cost.step_ms(0, 0) + px * tokens + cost.transfer_ms(P))
    assert tpot * (A - 1) == pytest.approx(land * P / 1e3 + cost.decode_run_ms(1, P, A - 1))
    assert long_overheads(cost, [ttft - 5, ttft, ttft + 500], [tpot, tpot, tpot + 1]) == pytest.approx((px, land))
    two = dataclasses.replace(cost, threads=2)
    c = Cluster(_spec("colocated", n=1), dataclasses.replace(two, prefill_x=px, land_ms_per_ktok=land))
    (job,) = c.run([Spec(0, 1.0, "long", list(range(1000, 1000 + P)), A)])
    assert long_overheads(two, [(job.first_token - 1.0) * 1e3], [1.0]) == pytest.approx((px, 0.0))
    assert long_overheads(cost, [1.0], [1.0]) == (1.0, 0.0)
    back = from_json(json.loads(json.dumps(dataclasses.replace(cost, prefill_x=px, land_ms_per_ktok=land).to_json())))
    assert (back.prefill_x, back.land_ms_per_ktok) == (px, land) and (COST.prefill_x, COST.land_ms_per_ktok) == (1, 0)
    with pytest.raises(ValueError, match="cluster.prefill_x"):
        from_json({**cost.to_json(), "cluster": {"prefill_x": 0.5}})
    with pytest.raises(ValueError, match="cluster.land_ms_per_ktok"):
        from_json({**cost.to_json(), "cluster": {"land_ms_per_ktok": -1}})


def test_a_kv_intake_is_charged_once_between_steps_and_never_to_a_later_request():
    """SimWorker.take_in: what lands while a step runs is taken in after it, once (two landings:
    their sum), counted as busy; a worker with nothing to run spends it idle, so a request
    arriving long after a prompt that ended at its first token pays only its own intake."""
    w = SimWorker("w", "decode", COST)
    job = SimJob(Spec(0, 0.0, "chat", list(range(10)), 50), [])
    job.generated = 1
    w.running.append(job)
    w.take_in(100.0)
    w.take_in(50.0)
    end, kind = w.plan(1.0)
    assert kind == "run" and end == pytest.approx(1.15 + COST.decode_run_ms(1, job.ctx, 49) / 1e3)
    assert w.busy_ms == 150.0
    w.end_run(end)
    assert w.plan(end) is None and w.land_pending == 0.0  # (done: nothing charged again)
    cost = dataclasses.replace(COST, land_ms_per_ktok=1000.0)
    c = Cluster(_spec("disaggregated", n=2, p=1), cost)
    one, late = c.run([Spec(0, 1.0, "long", list(range(1000, 2024)), 1),
                       Spec(1, 100.0, "chat", list(range(5000, 5064)), 11)])
    assert late.finish - late.first_token == pytest.approx((cost.land_ms(64) + cost.decode_run_ms(1, 64, 10)) / 1e3)
