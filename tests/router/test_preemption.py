"""Preemption (router.preempt): the pure decision on made-up clusters, then the router's whole
path over a fake pool: a high-priority request waiting for KV preempts a low-priority decode,
which re-runs from its prompt plus the tokens it streamed, and its client sees one stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.request import SamplingParams
from pdserve.v1 import pdserve_pb2 as pb
from router.admission import Admission
from router.autoscale import Recent
from router.config import load_config
from router.holdings import Holdings
from router.jobs import Aborted, Job, JobState, Preempted
from router.metrics import token_families
from router.place import Placer
from router.placement import Demand, WorkerLoad
from router.policy import Policy, TokenPolicy
from router.preempt import Preemptor, Running, choose
from router.server import Router
from tests.router.fake_pools import FakePools
from tests.router.front_door_fakes import until_async
from tests.router.test_place_orchestration import Counter
from worker.protocol import Tokens

HIGH, NORMAL, LOW = 0, 1, 2
DEMAND = Demand(prompt_tokens=100, max_tokens=28)  # 128 tokens: 8 blocks of 16


def _w(wid: str, free: int, seqs: int | None = None) -> WorkerLoad:
    return WorkerLoad(wid, "decode", free, 64, 16, free_seqs=seqs)


def _r(jid: str, rank: int, wid: str = "d0", tokens: int = 128, generated: int = 10, arrival: float = 0.0,
       preemptions: int = 0) -> Running:
    return Running(jid, rank, wid, tokens, 0, generated, arrival, preemptions)


def _ids(victims) -> list[str]:
    return [v.job_id for v in victims]


def test_never_for_an_equal_or_lower_class_and_never_when_room_exists():
    full = [_w("d0", 0)]
    assert choose(NORMAL, DEMAND, full, [_r("a", NORMAL), _r("b", HIGH)]) == ()
    assert choose(LOW, DEMAND, full, [_r("a", LOW)]) == ()
    assert _ids(choose(HIGH, DEMAND, full, [_r("a", NORMAL)])) == ["a"]
    # a worker with room: nothing is preempted (the wait is for something else, or brief)
    assert choose(HIGH, DEMAND, [_w("d0", 0), _w("d1", 8)], [_r("a", LOW)]) == ()


def test_victims_are_lowest_class_then_least_progress_then_most_recent():
    full = [_w("d0", 0)]
    running = [_r("normal", NORMAL, generated=1), _r("low-far", LOW, generated=50),
               _r("low-near", LOW, generated=5, arrival=1.0), _r("low-near-newer", LOW, generated=5, arrival=2.0)]
    assert _ids(choose(HIGH, DEMAND, full, running)) == ["low-near-newer"]


def test_as_many_as_make_room_on_one_worker_and_the_cheapest_worker_wins():
    # d0: two small low requests must both go; d1: one low request is enough
    small = dict(tokens=64)  # 4 blocks each
    running = [_r("a", LOW, "d0", **small), _r("b", LOW, "d0", **small), _r("c", LOW, "d1")]
    assert _ids(choose(HIGH, DEMAND, [_w("d0", 0), _w("d1", 0)], running)) == ["c"]
    assert sorted(_ids(choose(HIGH, DEMAND, [_w("d0", 0)], running[:2]))) == ["a", "b"]
    # touching only the lowest class beats fewer victims of a higher one
    running = [_r("n", NORMAL, "d0"), _r("l1", LOW, "d1", **small), _r("l2", LOW, "d1", **small)]
    assert sorted(_ids(choose(HIGH, DEMAND, [_w("d0", 0), _w("d1", 0)], running))) == ["l1", "l2"]


def test_no_preemption_that_would_not_make_room():
    running = [_r("a", LOW, tokens=32)]  # 2 blocks back: still 6 short
    assert choose(HIGH, DEMAND, [_w("d0", 0)], running) == ()
    # a full sequence table counts too: a seat must come free
    assert _ids(choose(HIGH, DEMAND, [_w("d0", 64, seqs=0)], [_r("a", LOW, tokens=16)])) == ["a"]


def test_preemptions_per_request_are_bounded_and_zero_is_off():
    full = [_w("d0", 0)]
    assert choose(HIGH, DEMAND, full, [_r("a", LOW, preemptions=2)], max_preemptions=2) == ()
    assert _ids(choose(HIGH, DEMAND, full, [_r("a", LOW, preemptions=1)], max_preemptions=2)) == ["a"]
    assert choose(HIGH, DEMAND, full, [_r("a", LOW)], max_preemptions=0) == ()


def test_room_being_freed_is_not_preempted_for_again():
    gone = _r("a", LOW)
    assert choose(HIGH, DEMAND, [_w("d0", 0)], [_r("b", LOW)], freeing=[gone]) == ()


# ---- the router's path, over a fake pool -----------------------------------------------------
POLICY = Policy({"alice": TokenPolicy(priority="high"), "batch": TokenPolicy(priority="low")})


def _router(pools: FakePools, tokenizer) -> Router:
    """A Router with what placement and streaming touch: a real Placer, Preemptor and
    Admission over ``pools``; the test plays the worker (it sends the records)."""
    r = object.__new__(Router)
    r.cfg = load_config(None, {"mode": "colocated"})
    r.tokenizer, r.jobs, r.pools, r.recent = tokenizer, {}, pools, Recent(30.0)
    r.admission = Admission(POLICY)
    r.metrics = SimpleNamespace(retries=Counter(), prefix_hit_tokens=Counter(), decode_prefix_tokens=Counter(),
                                prefill_placements=Counter())
    r.placer = Placer(r.cfg, pools, r.admission, Holdings(), r.metrics,
                      preemptor=Preemptor(pools, r.admission, 2, lambda: r.jobs.values()))
    return r


def _start(r: Router, rid: str, owner: str, prompt: list[int], max_tokens: int) -> tuple[Job, asyncio.Task]:
    job = Job(rid, prompt, SamplingParams(max_tokens=max_tokens), owner=owner,
              lease=r.admission.admit(owner, len(prompt)))
    r.jobs[rid] = job

    async def client() -> list[int]:
        out = []
        async for resp in r._run(job):
            out += resp.token_ids
        return out
    return job, asyncio.create_task(client())


def test_a_high_request_preempts_a_low_decode_which_resumes_without_a_gap(tokenizer):
    pools = FakePools(("decode-0", "colocated", 1))  # one block: one request of <= 16 tokens
    r = _router(pools, tokenizer)
    w = pools.workers["decode-0"]

    async def scenario():
        low, low_task = _start(r, "low", "batch", [1, 2, 3], 6)
        await until_async(lambda: low.state is JobState.RUNNING)
        for k, t in enumerate([10, 11]):  # the worker streams two tokens of the first attempt
            r._on_records(w, [Tokens(low.key, k, [t], "", None)])
        await until_async(lambda: len(low.generated) == 2)
        high, high_task = _start(r, "high", "alice", [4, 5, 6], 4)
        await until_async(lambda: pools.of("abort"))  # preempted: aborted on its worker at once
        late = Tokens(low.key, 2, [99], "", None)  # the old attempt's last record, after the abort
        pools.free["decode-0"] += 1  # ... which the worker's next report shows
        await until_async(lambda: high.state is JobState.RUNNING and low.attempt == 1)
        r._on_records(w, [late])  # (of attempt 0: dropped)
        assert low.preemptions == 1 and low.state is JobState.PLACING
        r._on_records(w, [Tokens(high.key, 0, [20, 21, 22, 23], "", "length")])
        assert await high_task == [20, 21, 22, 23]
        r.jobs.pop("high")
        pools.free["decode-0"] += 1  # high ended: its block is back; low re-runs there
        await until_async(lambda: low.state is JobState.RUNNING)
        assert pools.submitted[-1] == ("low", 1, [1, 2, 3, 10, 11], 4)  # prompt + streamed, what is left
        r._on_records(w, [Tokens(low.key, 0, [12, 13, 14, 15], "", "length")])
        return await low_task
    assert asyncio.run(scenario()) == [10, 11, 12, 13, 14, 15]  # one stream: nothing twice, nothing lost
    assert pools.of("abort") == [("abort", "decode-0")]  # once: the room being freed was waited for
    assert r.metrics.retries.n == 0  # a preemption is no failure (MAX_ATTEMPTS counts failures)
    families = {f.name: f for f in token_families(r.admission.stats())}
    assert {s.labels["token"]: s.value for s in families["pdserve_token_requests_preempted"].samples} == \
        {"alice": 0, "batch": 1}


def test_an_abort_queued_behind_a_preemption_ends_the_job_instead_of_its_rerun(tokenizer):
    """Abort is job-wide: one queued in the preempted attempt, before the stream took the
    preemption, is not skipped as stale once the re-run begins (the job would run to its end)."""
    pools = FakePools(("decode-0", "colocated", 1))
    r = _router(pools, tokenizer)
    w = pools.workers["decode-0"]

    async def scenario():
        low = Job("low", [1, 2, 3], SamplingParams(max_tokens=6), owner="batch",
                  lease=r.admission.admit("batch", 3))
        r.jobs["low"] = low
        out = []

        async def client():
            async for resp in r._run(low):
                out.append(resp)
        task = asyncio.create_task(client())
        await until_async(lambda: low.state is JobState.RUNNING)
        r._on_records(w, [Tokens(low.key, 0, [10], "", None)])
        await until_async(lambda: len(low.generated) == 1)
        r.placer.preemptor.preempt(low, why="test")  # queues Preempted (attempt 0) ...
        low.put(None, Aborted())  # ... and the client's Abort lands behind it, same attempt
        await task
        return out
    out = asyncio.run(scenario())
    assert [t for resp in out for t in resp.token_ids] == [10]
    assert out[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert [s[:2] for s in pools.submitted] == [("low", 0)]  # not placed again


@pytest.mark.parametrize("max_preemptions", [0, 1])
def test_a_request_preempted_its_limit_is_left_alone(max_preemptions):
    pools = FakePools(("decode-0", "colocated", 0))
    adm = Admission(POLICY)
    low = Job("low", [1, 2, 3], SamplingParams(max_tokens=6), lease=adm.admit("batch", 3), preemptions=1)
    low.placed(pools.workers["decode-0"], pools.workers["decode-0"])
    p = Preemptor(pools, adm, max_preemptions, lambda: [low])
    high = Job("high", [4, 5, 6], SamplingParams(max_tokens=4), lease=adm.admit("alice", 3))
    assert p.make_room(high, Demand(3, 4), pools.loads("colocated"), 1.0) == 0
    assert low.state is JobState.RUNNING and low.events.empty() and not pools.of("abort")


def test_preempting_frees_both_workers_of_a_disaggregated_attempt_and_queues_the_event():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 0))
    adm = Admission(POLICY)
    low = Job("low", [1, 2, 3], SamplingParams(max_tokens=6), lease=adm.admit("batch", 3))
    low.placed(pools.workers["prefill-0"], pools.workers["decode-0"])
    p = Preemptor(pools, adm, 2, lambda: [low])
    high = Job("high", [4, 5, 6], SamplingParams(max_tokens=4), lease=adm.admit("alice", 3))
    assert p.make_room(high, Demand(3, 4), pools.loads("decode"), 1.0) == 1
    assert sorted(pools.of("abort")) == [("abort", "decode-0"), ("abort", "prefill-0")]
    assert low.prefill is None and low.decode is None
    assert low.events.get_nowait() == (0, None, Preempted())
    assert adm.stats()["batch"].preempted == 1


def test_room_on_its_way_holds_further_preemption_until_it_settles():
    """After a preemption the worker's reports may not show the freed blocks yet: no second
    victim meanwhile; if the room never shows (SETTLE_S later), the next one goes."""
    from router.preempt import SETTLE_S
    pools, adm, now = FakePools(("decode-0", "colocated", 0)), Admission(POLICY), [100.0]
    lows = []
    for k in range(2):
        low = Job(f"low{k}", [1, 2, 3], SamplingParams(max_tokens=6), lease=adm.admit("batch", 3))
        low.placed(pools.workers["decode-0"], pools.workers["decode-0"])
        lows.append(low)
    p = Preemptor(pools, adm, 2, lambda: [j for j in lows if j.decode is not None], clock=lambda: now[0])
    high = Job("high", [4, 5, 6], SamplingParams(max_tokens=4), lease=adm.admit("alice", 3))
    assert p.make_room(high, Demand(3, 4), pools.loads("colocated"), 1.0) == 1
    assert p.make_room(high, Demand(3, 4), pools.loads("colocated"), 1.0) == 0  # its room is on its way
    now[0] += SETTLE_S
    assert p.make_room(high, Demand(3, 4), pools.loads("colocated"), 1.0) == 1
    assert [j.preemptions for j in lows] == [1, 1] and len(pools.of("abort")) == 2
