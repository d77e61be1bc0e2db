"""Autoscaling policy on synthetic signal traces: delays, hysteresis, limits, no flapping."""

from __future__ import annotations

import time
from types import SimpleNamespace

from router.autoscale import DecodeTargets, PoolState, PrefillTargets, Signals, decide, pool_signals
from router.cluster_view import cluster_view

P = PrefillTargets(min_replicas=1, max_replicas=3, up_delay_s=5, down_delay_s=20, target_queued_tokens=1000,
                   target_ttft_ms=2000)
D = DecodeTargets(min_replicas=1, max_replicas=3, up_delay_s=5, down_delay_s=20, kv_high=0.8, kv_low=0.3,
                  target_tpot_ms=100)


def replay(role, trace, targets, workers=1, dt=1.0):
    """Feed ``trace`` (a function of time -> Signals kwargs) once a second; returns the sizes."""
    state, sizes = PoolState(), []
    for i in range(len(trace)):
        delta, _ = decide(role, i * dt, Signals(workers=workers, **trace[i]), targets, state)
        workers += delta
        sizes.append(workers)
    return sizes


def test_sustained_backlog_grows_after_the_delay_one_worker_at_a_time_up_to_max():
    sizes = replay("prefill", [{"queued_prompt_tokens": 50_000}] * 30, P)
    assert sizes[4] == 1 and sizes[5] == 2  # held 5 s before the first change
    assert sizes[10] == 2 and sizes[11] == 3  # and 5 s again after it
    assert max(sizes) == 3  # max_replicas


def test_oscillating_load_does_not_flap():
    trace = [{"queued_prompt_tokens": 50_000 if (i // 2) % 2 else 0} for i in range(120)]
    assert set(replay("prefill", trace, P)) == {1}
    trace = [{"kv_utilization": 0.9 if (i // 3) % 2 else 0.1} for i in range(120)]
    assert set(replay("decode", trace, D, workers=2)) == {2}


def test_idle_pool_shrinks_after_the_down_delay_to_min():
    sizes = replay("decode", [{"kv_utilization": 0.05}] * 60, D, workers=3)
    assert sizes[19] == 3 and sizes[20] == 2 and sizes[40] == 2 and sizes[41] == 1 and sizes[-1] == 1


def test_dead_band_holds_the_size():
    assert set(replay("decode", [{"kv_utilization": 0.5}] * 60, D, workers=2)) == {2}
    assert set(replay("prefill", [{"queued_prompt_tokens": 500, "ttft_p90_s": 1.5}] * 60, P, workers=2)) == {2}


def test_each_pool_follows_its_own_signals():
    # Long prompts, short answers: prefill backlog grows prefill; decode memory is idle.
    assert replay("prefill", [{"queued_prompt_tokens": 9000}] * 8, P)[-1] == 2
    assert replay("decode", [{"kv_utilization": 0.1}] * 8, D)[-1] == 1
    # Waiting admissions or slow TPOT grow decode.
    assert replay("decode", [{"waiting_admission": 3}] * 8, D)[-1] == 2
    assert replay("decode", [{"kv_utilization": 0.5, "tpot_p90_s": 0.3}] * 8, D)[-1] == 2


def test_limits_apply_at_once():
    assert replay("prefill", [{}], P, workers=0) == [1]
    assert replay("decode", [{"kv_utilization": 0.5}], D, workers=5) == [4]


def test_controller_grows_and_drains_through_the_pools():
    from types import SimpleNamespace

    from router.autoscale import PoolController
    from router.cluster_view import ClusterView, WorkerView
    from router.config import load_config
    from worker.protocol import WorkerStatus
    cfg = load_config(None, {"autoscale.enabled": True, "autoscale.prefill.up_delay_s": 1.0,
                             "autoscale.prefill.down_delay_s": 1.0, "autoscale.decode.down_delay_s": 100.0,
                             "autoscale.prefill.target_queued_tokens": 100}).autoscale

    class Pools:
        def __init__(self):
            self.workers = {}
            for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
                self.workers[wid] = SimpleNamespace(worker_id=wid, role=role, state="ready", reserved_blocks=0,
                                                    status=WorkerStatus(role, "i", 1, kv_blocks_used=50,
                                                                        kv_blocks_total=100, block_size=16))

        def grow(self, role):
            w = SimpleNamespace(worker_id=f"{role}-new", role=role, state="ready", reserved_blocks=0, status=None)
            self.workers[w.worker_id] = w
            return w

        def drain(self, role, holds):
            w = self.workers.pop(f"{role}-new")
            return w
    router = SimpleNamespace(pools=Pools(), recent=[], queued=0, jobs={}, colocated=False, holds=lambda w: False)

    def view():  # (its workers as the router's snapshot shows them)
        return ClusterView(tuple(WorkerView(w.worker_id, w.role, w.state, w.status, reserved_blocks=w.reserved_blocks)
                                 for w in router.pools.workers.values()), queued=router.queued)
    ctl = PoolController(cfg, router.pools, view, router.holds, router.colocated)
    router.pools.workers["prefill-0"].status.queued_prompt_tokens = 5000
    assert ctl.step(0.0) == [] and ctl.step(0.5) == []
    assert ctl.step(1.0) == ["prefill +1 (prefill-new): queued prompt tokens 5000/worker > 100"]
    router.pools.workers["prefill-0"].status.queued_prompt_tokens = 0
    assert ctl.step(2.0) == [] and ctl.step(3.1)[0].startswith("prefill -1 (draining prefill-new)")
    assert len(ctl.events) == 2 and "prefill-new" not in router.pools.workers


def test_recent_latencies_keep_only_the_window():
    """The pool signals read the last ``window_s`` of finished requests: older ones are gone
    as new ones finish, so the router's memory stays flat under any steady load; ``cap``
    bounds a burst."""
    from router.autoscale import Recent, pool_signals
    r = Recent(window_s=30.0)
    for i in range(100):  # a request finishing every second for 100 s: the last 30 s stay
        r.add(float(i), 0.5 + i, 0.01)
    assert len(r) == 31 and min(x.at for x in r) == 69.0
    burst = Recent(window_s=30.0, cap=100)
    for i in range(1000):
        burst.add(5.0, 1.0, None)
    assert len(burst) == 100
    from types import SimpleNamespace
    router = SimpleNamespace(pools=SimpleNamespace(workers={}), recent=r, queued=0, jobs={})
    assert pool_signals(_view(router), "prefill", now=99.0, window_s=10.0).ttft_p90_s == 0.5 + 98  # (89..99: p90 is 98)


def test_running_streams_count_in_tpot_before_they_finish():
    """A batch gone slow shows in TPOT p90 while its long answers still run, not minutes
    later when they finish; a stream with fewer than LIVE_MIN_TOKENS tokens does not count
    (its first gap may hold a KV transfer)."""
    from types import SimpleNamespace

    from router.autoscale import LIVE_MIN_TOKENS, Recent, pool_signals
    from router.jobs import Job
    r = Recent(window_s=30.0)
    for i in range(10):
        r.add(90.0 + i, 0.2, 0.05)  # finished chats, 50 ms each

    def running(n: int, tpot: float) -> Job:
        j = Job(f"r{n}-{tpot}", [1, 2, 3], None)
        j.generated, j.first_token_time = list(range(n)), 10.0
        j.last_token_time = 10.0 + tpot * (n - 1)
        j.marks.extend((10.0 + tpot * i, i + 1) for i in range(n))  # one token per batch
        return j
    router = SimpleNamespace(pools=SimpleNamespace(workers={}), recent=r, queued=0, jobs={})
    assert pool_signals(_view(router), "decode", now=99.0, window_s=30.0).tpot_p90_s == 0.05
    slow = [running(LIVE_MIN_TOKENS, 0.2) for _ in range(5)]
    router.jobs = {j.request_id + str(i): j for i, j in enumerate(slow)}
    # 10 finished at 50 ms and 5 running at 200 ms: the p90 (index int(0.9 * 14) = 12) is 200 ms
    assert abs(pool_signals(_view(router), "decode", now=99.0, window_s=30.0).tpot_p90_s - 0.2) < 1e-9
    router.jobs = {str(i): running(LIVE_MIN_TOKENS - 1, 0.2) for i in range(5)}
    assert pool_signals(_view(router), "decode", now=99.0, window_s=30.0).tpot_p90_s == 0.05


def test_a_running_stream_counts_by_its_pace_now_not_its_average_so_far():
    """A stream that decoded 200 tokens at 50 ms, then its batch grew and the last 20 came at
    200 ms: TPOT so far is ~64 ms, its pace (the last PACE_BATCHES batches) 200 ms, and the
    signal reads the pace. Batches of several tokens (speculation) count per token."""
    from types import SimpleNamespace

    from router.autoscale import Recent, pool_signals
    from router.jobs import PACE_BATCHES, Job
    j = Job("r", [1, 2, 3], None)
    t = 0.0
    for i in range(220):
        t += 0.05 if i < 200 else 0.2
        j.marks.append((t, i + 1))
    j.generated, j.first_token_time, j.last_token_time = list(range(220)), 0.05, t
    assert abs(j.tpot - (199 * 0.05 + 20 * 0.2) / 219) < 1e-9 and abs(j.pace - 0.2) < 1e-9
    router = SimpleNamespace(pools=SimpleNamespace(workers={}), recent=Recent(30.0), queued=0, jobs={"r": j})
    assert abs(pool_signals(_view(router), "decode", now=t, window_s=30.0).tpot_p90_s - 0.2) < 1e-9
    j.marks.clear()
    j.marks.extend((0.3 * b, 3 * b) for b in range(PACE_BATCHES + 1))  # 3 tokens per 0.3 s batch
    assert abs(j.pace - 0.1) < 1e-9


def _view(router):
    """The snapshot the router hands pool_signals (router.cluster_view), of a made-up router."""
    from router.cluster_view import cluster_view
    return cluster_view(router.pools.workers.values(), router.jobs.values(), router.recent, router.queued)


# ---- issue 44: signals from running requests, per request class (bugs 1 and 2) ---------------
def _placed_job(rid: str, prompt_tokens: int, waited_s: float, now: float):
    from engine.request import SamplingParams
    from router.jobs import Job
    j = Job(rid, [1] * prompt_tokens, SamplingParams(max_tokens=1000), arrival=now - waited_s)
    w = SimpleNamespace(worker_id="w")
    j.placed(w, w, "pool:long")
    j.placed_time = j.arrival  # (placed at once: no admission wait)
    return j


def test_a_ttft_enters_the_signals_at_the_first_token_not_when_the_answer_ends():
    """Bug 1: a 1,000-token answer runs for minutes; its TTFT must reach the pool signals
    when its first token streams, and the prefill's reported cached tokens reach placement."""
    import asyncio

    from router.autoscale import Recent, pool_signals
    from router.server import Router
    from worker.protocol import Tokens
    router = Router.__new__(Router)  # (only what _stream touches)
    router.recent, seen = Recent(30.0), []
    router.placer = SimpleNamespace(prefilled=lambda job, cached: seen.append((job.request_id, cached)))
    now = time.monotonic()
    job = _placed_job("r", 100, 1.5, now)
    first = Tokens(job.key, 0, [5], "a", prompt_tokens=100, cached_tokens=32)

    async def first_response():
        job.put(job.prefill, first)
        stream = router._stream(job)
        out = await stream.__anext__()
        await stream.aclose()
        return out
    assert list(asyncio.run(first_response()).token_ids) == [5]
    assert seen == [("r", 32)]
    s = pool_signals(cluster_view([], [job], router.recent), "prefill", time.monotonic(), 30.0)
    assert s.ttft_p90_s is not None and abs(s.ttft_p90_s - job.queue_free_ttft) < 1e-9 and s.awaiting_first_token == 0


def test_no_ttft_data_is_not_idle_while_a_request_awaits_its_first_token():
    """Bug 1: TTFT p90 None (no first token in the window) read as idle, so a pool busy with
    long prompts looked idle until their first tokens came."""
    from router.autoscale import pressure
    assert pressure("prefill", Signals(workers=1), P)[1]  # nothing at all: idle
    assert not pressure("prefill", Signals(workers=1, awaiting_first_token=2), P)[1]
    now = 1000.0
    view = cluster_view([], [_placed_job("r", 100, 0.4, now)], now=now)
    s = pool_signals(view, "prefill", now, 30.0, P)
    assert s.awaiting_first_token == 1 and s.ttft_p90_s is None and not pressure("prefill", s, P)[1]


def test_ttft_is_judged_by_each_request_class_target():
    """Bug 2: a document's TTFT is mostly its own prefill; held to the chats' target it calls
    the pool slow. Each sample is scaled by its class's target (prompts over
    long_prompt_tokens: target_ttft_long_ms), and a request still waiting past its class's
    target counts by its wait."""
    from router.autoscale import PrefillTargets, Recent, pressure
    t = PrefillTargets(target_ttft_ms=2000, long_prompt_tokens=1024, target_ttft_long_ms=10000)
    r = Recent(30.0)
    for i in range(10):
        r.add(90.0 + i, 6.0, None, 2000)  # documents at 6 s: within their 10 s target
        r.add(90.0 + i, 0.3, None, 100)  # chats at 0.3 s
    view = cluster_view([], [], r, now=99.0)
    s = pool_signals(view, "prefill", 99.0, 30.0, t)
    assert abs(s.ttft_p90_s - 6.0 * 2000 / 10000) < 1e-9 and not pressure("prefill", s, t)[0]
    assert pressure("prefill", pool_signals(view, "prefill", 99.0, 30.0, PrefillTargets(
        target_ttft_ms=2000, target_ttft_long_ms=2000)), t)[0]  # one target for all: "slow"
    stuck = [_placed_job(f"d{i}", 2000, 25.0, 99.0) for i in range(5)]  # 25 s waiting: past 10 s
    s = pool_signals(cluster_view([], stuck, r, now=99.0), "prefill", 99.0, 30.0, t)
    assert abs(s.ttft_p90_s - 25.0 * 2000 / 10000) < 1e-9 and pressure("prefill", s, t)[0]


def test_a_wait_in_the_admission_queue_is_not_the_prefill_pools_ttft():
    """A request that waited 10 s for decode memory, then had its first token 0.5 s after its
    placement: the prefill pool is judged by the 0.5 s (the wait is the decode pool's
    ``waiting_admission``); one placed 3 s ago still prefilling has waited 3 s, not 13."""
    from router.autoscale import Recent, pool_signals
    now = 1000.0
    done = _placed_job("a", 100, 10.5, now)
    done.placed_time, done.first_token_time = now - 0.5, now
    assert done.ttft == 10.5 and done.queue_free_ttft == 0.5
    recent = Recent(30.0)
    recent.add(now, done.queue_free_ttft, None, 100)
    waiting = _placed_job("b", 100, 13.0, now)
    waiting.placed_time = now - 3.0
    view = cluster_view([], [waiting], recent, now=now)
    assert view.awaiting == ((3.0, 100),)
    s = pool_signals(view, "prefill", now, 30.0, P)
    assert s.ttft_p90_s == 0.5 and s.awaiting_first_token == 1
