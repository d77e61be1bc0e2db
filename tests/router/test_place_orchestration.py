"""Placement orchestration (router.place) over a fake pool (tests/router/fake_pools.py), no Ray:
each test steps one job through PLACING and asserts where it went, which calls were made,
and that nothing leaked (no reservation left unfreed, nobody left waiting)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import grpc
import pytest

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from router.admission import Admission
from router.config import load_config
from router.holdings import Holdings
from router.jobs import Job, JobState
from router.place import Placer
from router.placement import Demand, Local, PoolView, Remote, Wait, WorkerLoad, plan
from router.prefix_index import PrefixIndex, block_hashes
from router.reject import Reject
from router.worker_state import UNREACHABLE, WorkerState
from tests.router.fake_pools import FakePools
from worker.protocol import Reservation


class Counter:
    def __init__(self) -> None:
        self.n, self.by = 0, {}

    def inc(self, n: int = 1) -> None:
        self.n += n

    def labels(self, *key):
        return SimpleNamespace(inc=lambda n=1: self.by.__setitem__(key, self.by.get(key, 0) + n))


def _placer(pools: FakePools, mode: str = "disaggregated", prefix: PrefixIndex | None = None, **router) -> Placer:
    cfg = load_config(None, {"mode": mode, **{f"router.{k}": v for k, v in router.items()}})
    metrics = SimpleNamespace(prefix_hit_tokens=Counter(), decode_prefix_tokens=Counter(),
                              prefill_placements=Counter())
    return Placer(cfg, pools, Admission(), Holdings(), metrics, prefix, adaptive=mode == "adaptive")


def _place(placer: Placer, prompt_tokens: int = 20) -> Job:
    job = Job("r", list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=8))
    job.lease = placer.admission.admit("", prompt_tokens)
    asyncio.run(placer.place(job))
    return job


def _nothing_left(placer: Placer, pools: FakePools) -> None:
    assert placer.queued == 0 and placer.admission.queued == 0 and pools.leaked == 0


def test_disaggregated_reserves_on_decode_then_prefills_on_the_pool():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    placer = _placer(pools)
    job = _place(placer)
    assert job.state is JobState.RUNNING and (job.prefill_id, job.decode_id) == ("prefill-0", "decode-0")
    assert job.placement == "pool:off"
    assert pools.of("prefill") == [("prefill", "prefill-0", "kv://decode-0")]
    assert placer.metrics.prefill_placements.by == {("pool", "off"): 1}
    _nothing_left(placer, pools)


def test_colocated_submits_to_one_worker():
    pools = FakePools(("decode-0", "colocated", 64))
    placer = _placer(pools, "colocated")
    job = _place(placer)
    assert job.state is JobState.RUNNING and job.prefill is job.decode and job.placement == "colocated"
    assert pools.of("submit") == [("submit", "decode-0")] and not pools.of("reserve")
    assert pools.of("reserved") == [("reserved", "decode-0", 2, 20)]  # 20 + 8 tokens: 2 blocks, 20 to prefill


def test_a_full_decode_worker_is_skipped_until_it_reports():
    """reserve answers None (full): its free blocks count as promised, the next try goes elsewhere."""
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64), ("decode-1", "decode", 32))
    pools.answers["decode-0"] = [None]
    placer = _placer(pools)
    job = _place(placer)
    assert job.decode_id == "decode-1" and [c[1] for c in pools.of("reserve")] == ["decode-0", "decode-1"]
    _nothing_left(placer, pools)


def test_an_unreachable_decode_worker_is_tried_no_more_once_lost():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64), ("decode-1", "decode", 32))

    def lost(w):
        w.state = WorkerState.DEAD  # (what Pools.lost does before the call answers UNREACHABLE)
        return UNREACHABLE
    pools.answers["decode-0"] = [lost]
    placer = _placer(pools)
    job = _place(placer)
    assert job.decode_id == "decode-1"
    _nothing_left(placer, pools)


@pytest.mark.parametrize("who", ["prefill-0", "decode-0"])
def test_a_worker_that_drains_while_decode_answers_frees_the_reservation(who):
    """Either worker left (drain, switch roles) during the reserve: the reservation is freed and
    the job placed again, on the workers that are still ready."""
    pools = FakePools(("prefill-0", "prefill", 64), ("prefill-1", "prefill", 32), ("decode-0", "decode", 64),
                      ("decode-1", "decode", 32))

    def drain(w):
        pools.workers[who].state = WorkerState.DRAINING
        return Reservation(b"s" * 32, 0)
    pools.answers["decode-0"] = [drain]
    placer = _placer(pools)
    job = _place(placer)
    assert ("abort", "decode-0") in pools.calls and who not in (job.prefill_id, job.decode_id)
    _nothing_left(placer, pools)


def test_a_local_prefill_that_misses_its_prefix_goes_to_the_pool():
    """Local by a prefix the index believed cached (the worker says it is not): the pool
    prefills it (``cache_miss``)."""
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    pools.answers["decode-0"] = [False]  # submit: not cached there, nothing taken
    placer = _placer(pools, local_prefill_tokens=64)
    job = _place(placer)
    assert pools.of("submit") == [("submit", "decode-0")] and job.placement == "pool:cache_miss"
    _nothing_left(placer, pools)


def test_a_short_prompt_prefills_on_its_decode_worker():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    placer = _placer(pools, local_prefill_tokens=64)
    job = _place(placer)
    assert job.placement == "local:short" and job.prefill is job.decode and not pools.of("reserve")


def test_a_local_worker_that_drains_meanwhile_is_aborted_there():
    pools = FakePools(("decode-0", "colocated", 64), ("decode-1", "colocated", 32))

    def drain(w):
        w.state = WorkerState.DRAINING
        return True
    pools.answers["decode-0"] = [drain]
    placer = _placer(pools, "colocated")
    job = _place(placer)
    assert job.decode_id == "decode-1" and pools.of("abort") == [("abort", "decode-0")]


def test_bad_input_a_worker_finds_is_invalid_argument():
    pools = FakePools(("decode-0", "colocated", 64))
    pools.answers["decode-0"] = [InvalidRequestError("a token id past the vocabulary")]
    placer = _placer(pools, "colocated")
    with pytest.raises(Reject) as e:
        _place(placer)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in str(e.value)
    _nothing_left(placer, pools)


def test_no_room_waits_then_is_refused_after_the_queue_timeout():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 1))
    placer = _placer(pools, queue_timeout_s=0.05)
    with pytest.raises(Reject) as e:
        _place(placer)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "router.queue_timeout_s" in str(e.value)
    assert pools.waits > 0 and not pools.of("reserve")
    _nothing_left(placer, pools)


def test_a_full_queue_refuses_at_once_and_no_worker_left_is_unavailable():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 1))
    placer = _placer(pools, max_queue=1)
    placer.queued = 1  # another request waits already
    with pytest.raises(Reject) as e:
        _place(placer)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and pools.waits == 0 and placer.queued == 1
    placer.queued = 0
    pools.workers["decode-0"].state = WorkerState.GONE
    with pytest.raises(Reject) as e:
        _place(placer)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    _nothing_left(placer, pools)


def test_plan_is_pure_over_a_snapshot():
    d = WorkerLoad("d", "decode", 64, 64, 16)
    p = WorkerLoad("p", "prefill", 64, 64, 16)
    job = Demand(prompt_tokens=20, max_tokens=8)
    assert plan(PoolView(False, [d], [p]), job) == Remote(p, d, 2, "off")
    assert plan(PoolView(False, [d], [p], local_prefill_tokens=32), job) == Local(d, 2, "local", "short")
    assert plan(PoolView(False, [d], [p], local_prefill_tokens=32), dataclasses.replace(job, missed=True)) \
        == Remote(p, d, 2, "cache_miss")
    assert plan(PoolView(False, [d], [], no_prefill_pool=True), job) == Local(d, 2, "local", "no_pool")
    assert isinstance(plan(PoolView(False, [d], [p], turn=False), job), Wait)  # another goes first
    assert isinstance(plan(PoolView(False, [d], []), job), Wait)  # no prefill worker
    assert plan(PoolView(True, [dataclasses.replace(d, role="colocated")]), job).where == "colocated"


# ---- the real Pools' calls: Ray's errors mapped where the call is made (router.pools) -----------
def _pools_with(remote):
    """A real Pools (no actors started) with one ready decode worker whose calls run ``remote``."""
    from router.pools import Pools
    from router.worker_state import Worker
    lost = []
    pools = Pools(load_config(None, {}), "m", lambda w, r: None, lost.append)
    pools.liveness.bring_up = lambda w: asyncio.sleep(0)  # (no Ray to bring it back here)
    aborts: list = []
    actor = SimpleNamespace(reserve=SimpleNamespace(remote=remote), abort=SimpleNamespace(remote=aborts.append))
    w = pools.workers["decode-0"] = Worker("decode-0", "decode", actor, state="ready")
    return pools, w, lost, aborts


def test_pools_map_a_dead_actor_to_unreachable_and_lose_the_worker():
    from ray.exceptions import RayActorError

    async def remote(*a):
        raise RayActorError()
    pools, w, lost, _ = _pools_with(remote)

    async def main():
        return await pools.reserve(w, "k", [1, 2], None, None)
    assert asyncio.run(main()) is UNREACHABLE and lost == [w] and w.state is WorkerState.DEAD


def test_pools_raise_the_workers_invalid_request_error_and_abort_a_cancelled_call():
    from ray.exceptions import RayTaskError

    async def bad(*a):
        raise RayTaskError("reserve", "trace", InvalidRequestError("bad token id"))
    pools, w, _, _ = _pools_with(bad)
    with pytest.raises(InvalidRequestError, match="bad token id"):
        asyncio.run(pools.reserve(w, "k", [1, 2], None, None))

    async def slow(*a):
        await asyncio.sleep(10)
    pools, w, _, aborts = _pools_with(slow)

    async def cancelled():
        call = asyncio.ensure_future(pools.reserve(w, "k", [1, 2], None, None))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    asyncio.run(cancelled())
    assert aborts == ["k"]  # the client gave up during the call: the worker frees what it took


# ---- issue 44: no phantom prefix entries (bug 4), no walk over the live jobs (bug 6) -------------
def _refused(placer: Placer, prompt_tokens: int) -> None:
    with pytest.raises(Reject) as e:
        _place(placer, prompt_tokens)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("answer", ["full", "lost"])
def test_a_reservation_that_fails_leaves_no_prefix_entry(answer):
    """The prompt was recorded on its prefill worker before decode answered: a refused
    reservation, or a decode worker lost meanwhile, left a phantom prefix there that later
    prompts were drawn to. It is recorded once the placement succeeded."""
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))

    def lost(w):
        w.state = WorkerState.DEAD
        return UNREACHABLE
    pools.answers["decode-0"] = [None if answer == "full" else lost]
    idx = PrefixIndex()
    placer = _placer(pools, prefix=idx, queue_timeout_s=0.05)
    _refused(placer, 100)
    assert idx.size("prefill-0") == 0 and idx.size("decode-0") == 0
    _nothing_left(placer, pools)


def test_a_cache_miss_removes_the_entry_the_local_prefill_was_sent_for():
    """The decode worker says it does not hold the prefix the index lists there (submit with
    ``check`` answers False): the entry goes (before, it stayed, and was even recorded again)."""
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    ids = list(range(1, 101))
    idx = PrefixIndex()
    idx.record("decode-0", block_hashes(ids, 16), 64)  # believed: 96 of its 100 tokens
    pools.answers["decode-0"] = [False, None]  # submit: not cached; then the pool's reserve: full
    placer = _placer(pools, prefix=idx, local_prefill_tokens=64, queue_timeout_s=0.05)
    _refused(placer, 100)
    assert pools.of("submit") == [("submit", "decode-0")] and pools.of("reserve") == [("reserve", "decode-0")]
    assert idx.hit_blocks("decode-0", block_hashes(ids, 16)) == 0
    _nothing_left(placer, pools)


def test_a_prefill_that_found_less_cached_corrects_the_index():
    """The prefill reports the prompt tokens it found cached: fewer than the index expected
    means the worker evicted blocks the index still lists; as many of its least recent
    entries go (not the prompt it just took), and a later prompt is not drawn to them."""
    pools = FakePools(("prefill-0", "prefill", 64), ("prefill-1", "prefill", 64), ("decode-0", "decode", 64))
    idx = PrefixIndex()
    old = list(range(500, 564))  # 4 blocks placed there long ago
    idx.record("prefill-0", block_hashes(old, 16), 64)
    idx.record("prefill-0", block_hashes(list(range(1, 101)), 16)[:4], 64)  # the prompt's first 64 tokens
    placer = _placer(pools, prefix=idx)
    job = _place(placer, 100)
    assert job.prefill_id == "prefill-0" and job.uncached == 100 - 64
    job.generated.append(7)  # (its first token: what router.server hands on)
    placer.prefilled(job, 0)  # it found nothing cached: 4 blocks it was believed to hold are gone
    assert idx.hit_blocks("prefill-0", block_hashes(old, 16)) == 0
    assert idx.hit_blocks("prefill-0", block_hashes(list(range(1, 101)), 16)) == 6  # the prompt stays
    assert placer.live.queued("prefill-0") == 0  # its first token: no longer queued there


def test_a_placement_walks_no_live_job(monkeypatch):
    """Bug 6: each try walked every live job (and queued jobs retry every 0.1 s): with
    thousands running, quadratic work on the event loop. The placer reads router.holdings,
    kept as each job changes: a try touches no other job."""
    import router.holdings as holdings
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    placer = _placer(pools, prefix=PrefixIndex())
    w = SimpleNamespace(worker_id="prefill-0")
    for i in range(5000):  # live jobs sharing the prompt's first block, half still prefilling
        j = Job(f"x{i}", list(range(1, 40)), SamplingParams(max_tokens=8))
        j.prefix_hashes, j.uncached = block_hashes(j.prompt_ids, 16), 7
        j.placed(w, w, "pool:off")
        j.generated = [1] if i % 2 else []
        placer.live.update(j)
    counted = []
    real = holdings.counted_as
    monkeypatch.setattr(holdings, "counted_as", lambda job: counted.append(job.request_id) or real(job))
    job = _place(placer, 40)
    assert job.state is JobState.RUNNING and set(counted) == {"r"}
    assert placer.live.queued("prefill-0") == 2500 * 7 + job.uncached


def test_a_decode_worker_that_had_less_cached_corrects_the_index():
    """Decode's reservation says where the transfer starts (the prompt tokens it holds): fewer
    than the index listed there means it evicted that many blocks; the least recent go."""
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    idx = PrefixIndex()
    old = list(range(500, 564))
    idx.record("decode-0", block_hashes(old, 16), 64)
    idx.record("decode-0", block_hashes(list(range(1, 101)), 16)[:4], 64)  # believed: 64 tokens there
    pools.answers["decode-0"] = [Reservation(b"s" * 32, 0)]  # it holds none of them
    _place(_placer(pools, prefix=idx), 100)
    assert idx.hit_blocks("decode-0", block_hashes(old, 16)) == 0
    assert idx.hit_blocks("decode-0", block_hashes(list(range(1, 101)), 16)) == 6
