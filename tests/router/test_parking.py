"""Streams their client does not read are parked (router.parking): their requests aborted on
their workers, placed again only once the client reads, from prompt + streamed tokens; one
stream for the client, nothing repeated or lost. The relay's clock first (router.unread), then
the router's jobs on a worker pool without Ray (tests/router/fake_pools.py)."""

from __future__ import annotations

import asyncio

import pytest

from router.jobs import Job, JobState, Parked
from router.parking import Hold, park
from router.unread import Unread, relay
from tests.router.fake_pools import FakePools
from tests.router.front_door_fakes import until_async
from tests.router.test_preemption import _router, _start
from tests.router.test_unread import TINY_S, Source
from worker.protocol import Key, Tokens


class Recorder:
    """A Parkable that records the relay's calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def park(self) -> None:
        self.calls.append("park")

    def unpark(self) -> None:
        self.calls.append("unpark")


def test_a_consumer_that_pauses_past_park_s_parks_the_hold_and_taking_a_message_unparks_it():
    src, rec = Source(n=6), Recorder()

    async def pause_then_read():
        stream = relay(src.gen(), 20 * TINY_S, hold=rec, park_s=TINY_S)
        got = [await anext(stream)]
        await until_async(lambda: rec.calls == ["park"])  # a message waited park_s
        assert not src.closed  # parked, not ended
        got += [m async for m in stream]
        return got
    assert asyncio.run(pause_then_read()) == [1, 2, 3, 4, 5, 6]
    assert rec.calls == ["park", "unpark"]


def test_a_consumer_that_never_reads_again_is_parked_then_ended_without_an_unpark():
    src, rec = Source(), Recorder()

    async def stop_reading():
        stream = relay(src.gen(), 3 * TINY_S, hold=rec, park_s=TINY_S)
        await anext(stream)
        await until_async(lambda: src.closed)
        with pytest.raises(Unread):
            async for _ in stream:
                pass
    asyncio.run(stop_reading())
    assert rec.calls == ["park"]  # ended, not let go: its requests were closed instead


@pytest.mark.parametrize("park_s", [0.0, 5.0])
def test_parking_off_or_past_the_unread_timeout_never_parks(park_s):
    src, rec = Source(), Recorder()

    async def stop_reading():
        stream = relay(src.gen(), TINY_S, hold=rec, park_s=park_s)
        await anext(stream)
        await until_async(lambda: src.closed)
    asyncio.run(stop_reading())
    assert rec.calls == []


def test_a_parked_job_frees_its_worker_waits_for_its_client_then_resumes_as_one_stream(tokenizer):
    pools = FakePools(("decode-0", "colocated", 4))
    r = _router(pools, tokenizer)
    w = pools.workers["decode-0"]

    async def scenario():
        job, task = _start(r, "r", "batch", [1, 2, 3], 6)  # (its client pulls every response)
        await until_async(lambda: job.state is JobState.RUNNING)
        r._on_records(w, [Tokens(job.key, 0, [10, 11], "", None)])
        await until_async(lambda: len(job.generated) == 2)
        assert park(job, pools.abort)
        assert pools.of("abort") == [("abort", "decode-0")]  # freed at once
        assert not park(job, pools.abort)  # (parked already: nothing more to free)
        await until_async(lambda: job.attempt == 1 and job.state is JobState.PLACING)
        r._on_records(w, [Tokens(Key("r", 0), 2, [99], "", None)])  # attempt 0's last: dropped
        for _ in range(20):
            await asyncio.sleep(0)
        assert [s[:2] for s in pools.submitted] == [("r", 0)]  # not placed while parked
        job.reading.set()  # its client reads again
        await until_async(lambda: job.state is JobState.RUNNING)
        assert pools.submitted[-1] == ("r", 1, [1, 2, 3, 10, 11], 4)  # prompt + streamed, what is left
        r._on_records(w, [Tokens(job.key, 0, [12, 13, 14, 15], "", "length")])
        return await task, job
    out, job = asyncio.run(scenario())
    assert out == [10, 11, 12, 13, 14, 15]
    assert job.parks == 1 and job.failures == 0 and r.metrics.retries.n == 0  # a park is no failure


def test_an_abort_ends_a_parked_job_without_placing_it_again(tokenizer):
    from router.jobs import Aborted
    pools = FakePools(("decode-0", "colocated", 4))
    r = _router(pools, tokenizer)
    w = pools.workers["decode-0"]

    async def scenario():
        job, task = _start(r, "r", "batch", [1, 2, 3], 6)
        await until_async(lambda: job.state is JobState.RUNNING)
        r._on_records(w, [Tokens(job.key, 0, [10], "", None)])
        await until_async(lambda: len(job.generated) == 1)
        park(job, pools.abort)
        await until_async(lambda: job.attempt == 1)
        job.put(None, Aborted())  # the client cancels (or the router stops) while parked
        return await task
    assert asyncio.run(scenario()) == [10]
    assert [s[:2] for s in pools.submitted] == [("r", 0)]


def test_a_hold_parks_its_running_jobs_and_any_added_while_parked():
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    hold = Hold(pools.abort)
    running = Job("a", [1, 2, 3], _params())
    running.placed(pools.workers["prefill-0"], pools.workers["decode-0"])
    placing = Job("b", [1, 2, 3], _params())
    hold.add(running)
    hold.add(placing)
    hold.park()
    assert sorted(pools.of("abort")) == [("abort", "decode-0"), ("abort", "prefill-0")]
    assert running.events.get_nowait() == (0, None, Parked()) and placing.events.empty()  # (nothing to free)
    assert not running.reading.is_set() and not placing.reading.is_set()
    late = Job("c", [4], _params())
    hold.add(late)  # another choice of the same stream starts while it is parked
    assert not late.reading.is_set()
    hold.remove(placing)
    hold.unpark()
    assert running.reading.is_set() and late.reading.is_set() and not placing.reading.is_set()


def _params():
    from engine.request import SamplingParams
    return SamplingParams(max_tokens=4)


def test_a_request_parked_max_parks_times_is_left_to_run():
    """A client that reads in fits and starts would cost a re-run per message: after MAX_PARKS
    parks the request runs on (its tokens wait in the router until its stream is read or ended)."""
    from router.parking import MAX_PARKS
    pools = FakePools(("decode-0", "colocated", 4))
    job = Job("a", [1, 2, 3], _params())
    for k in range(MAX_PARKS + 1):
        job.reading.set()
        job.placed(pools.workers["decode-0"], pools.workers["decode-0"])
        assert park(job, pools.abort) == (k < MAX_PARKS)
    assert job.parks == MAX_PARKS and job.reading.is_set() and job.decode is not None


def test_a_parked_request_holds_nothing_counts_once_and_fails_only_on_failures():
    from router.holdings import NOTHING, Holdings, counted_as
    pools = FakePools(("prefill-0", "prefill", 64), ("decode-0", "decode", 64))
    live, parked = Holdings(), Counter()
    job = Job("a", [1, 2, 3], _params(), prefix_hashes=[11], attempt=2, first_attempt=2)  # (rebuilt at attempt 2)
    job.placed(pools.workers["prefill-0"], pools.workers["decode-0"])
    live.update(job)
    assert counted_as(job) != NOTHING
    hold = Hold(pools.abort, parked, live)
    hold.add(job)
    hold.park()
    assert counted_as(job) == NOTHING and parked.n == 1  # what placement reads: nothing held there now
    hold.park()  # (the stream stalls again before the job took its Parked event: no second park)
    assert parked.n == 1 and job.parks == 1
    job.rerun(None)
    assert job.failures == 0  # neither the park nor the attempts of the router before count


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, k: int = 1) -> None:
        self.n += k
