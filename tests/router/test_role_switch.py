"""A role switch as the router's pools carry it out, without Ray: the worker leaves its pool at
once, joins the other only when it holds nothing (no request of the router's, no admitting call
in flight, nothing running, no block), gets the KV connections of its new role, and a worker
lost on the way comes back in the new role. (On real actors: tests/cluster/test_adaptive.py.)"""

from __future__ import annotations

import asyncio
import time

from router.config import load_config
from router.pools import Pools, Worker
from tests.router.front_door_fakes import until_async
from worker.protocol import WorkerStatus


def _pools(on_lost=lambda w: None) -> Pools:
    pools = Pools(load_config(None, {"mode": "adaptive"}), "/nowhere", lambda w, r: None, on_lost)
    pools.wired: list[tuple[str, str]] = []

    async def wire(w):  # (the real one calls the actors: here it records who was wired as what)
        pools.wired.append((w.worker_id, w.role))
    pools.liveness.wire = wire
    return pools


def _status(**kw) -> WorkerStatus:
    return WorkerStatus(role="adaptive", incarnation="i", pid=1, kv_blocks_used=kw.pop("used", 0), kv_blocks_total=64,
                        block_size=16, **kw)


def _report(w: Worker, **kw) -> None:
    w.reported(_status(**kw))
    w.last_seen = time.monotonic()


async def _stop(pools: Pools) -> None:
    for t in list(pools._tasks):
        t.cancel()
    await asyncio.gather(*pools._tasks, return_exceptions=True)


def test_a_switch_waits_for_what_the_worker_holds_then_joins_the_other_pool():
    async def run():
        pools = _pools()
        w = pools.workers["decode-0"] = Worker("decode-0", "decode", None, state="ready", adaptive=True)
        _report(w, running=1, used=4)
        holding = {"job": True}
        pools.reserved("decode-0", 2)  # a reserve in flight
        assert pools.switch("decode", "prefill", lambda x: holding["job"]) is w
        assert w.state == "draining" and w.role == "decode" and w.next_role == "prefill"
        assert pools.switch("decode", "prefill", lambda x: False) is None  # no other ready decode worker
        await asyncio.sleep(0.6)
        _report(w)  # idle, but the router still holds a job there and the call is unreported
        await asyncio.sleep(0.6)
        assert w.state == "draining"
        holding["job"] = False
        await asyncio.sleep(0.6)
        assert w.state == "draining"  # the reserve's call is not in any report yet
        _report(w, admitted=1)
        await until_async(lambda: w.state == "ready")
        assert (w.role, w.next_role) == ("prefill", None) and pools.wired == [("decode-0", "prefill")]
        await _stop(pools)
    asyncio.run(run())


def test_a_worker_lost_while_it_switches_comes_back_in_its_new_role():
    async def run():
        lost = []
        pools = _pools(lost.append)
        pools.liveness.bring_up = lambda w: asyncio.sleep(0)  # (no actor to bring up here)
        w = pools.workers["prefill-0"] = Worker("prefill-0", "prefill", None, state="ready", adaptive=True)
        _report(w, running=1)
        pools.switch("prefill", "decode", lambda x: False)
        pools.liveness.lost(w, "test")
        assert (w.state, w.role, w.next_role) == ("dead", "decode", None) and lost == [w]
        await _stop(pools)
    asyncio.run(run())


def test_the_controller_traces_each_decision_with_the_signals_it_read():
    """``RoleController.trace``: per decision, both pools' snapshots and the want they made
    (what bench/serving.py reports, to tell which signal held a switch back)."""
    from types import SimpleNamespace

    from router.cluster_view import cluster_view
    from router.roles import RoleController
    cfg = load_config(None, {"mode": "adaptive", "roles.min_prefill": 0})  # (else the one prefill worker stays)
    pools = _pools()
    p = pools.workers["prefill-0"] = Worker("prefill-0", "prefill", None, state="ready", adaptive=True)
    d = pools.workers["decode-0"] = Worker("decode-0", "decode", None, state="ready", adaptive=True)
    _report(p)
    _report(d, used=60)  # 60 of 64 blocks: over kv_high, and no prompt backlog anywhere
    switched = SimpleNamespace(labels=lambda role: SimpleNamespace(inc=lambda: None))
    ctl = RoleController(cfg.roles, cfg.autoscale, pools, lambda: cluster_view(pools.workers.values(), []),
                         lambda w: False, switched)
    assert ctl.step(0.0) is None  # the want must hold switch_delay_s first
    _, s_p, s_d, want = ctl.trace[-1]
    assert want == ("prefill", "decode") and s_d.kv_utilization == 60 / 64 and s_p.queued_prompt_tokens == 0
    _report(d, used=10)  # decode idle too (KV under kv_low): no want
    assert ctl.step(1.0) is None and ctl.trace[-1][3] is None and len(ctl.trace) == 2
    # A decode worker's local prefill is no backlog while a prefill worker is there; with none
    # left, it is all of it.
    _report(d, used=10, queued_prompt_tokens=78)
    ctl.step(2.0)
    assert ctl.trace[-1][1].queued_prompt_tokens == 0
    p.state = "draining"
    ctl.step(3.0)  # (draining: one switch at a time, no decision)
    del pools.workers["prefill-0"]
    ctl.step(4.0)
    assert ctl.trace[-1][1].queued_prompt_tokens == 78 and ctl.trace[-1][1].workers == 0


def test_the_controller_switches_more_workers_the_same_way_while_one_drains():
    """A decode worker on its way to prefill still drains its streams: a prompt backlog moves
    the next one meanwhile (roles.decide_moving), a worker retiring holds the decision."""
    from types import SimpleNamespace

    from router.cluster_view import cluster_view
    from router.roles import RoleController
    cfg = load_config(None, {"mode": "adaptive", "roles.switch_delay_s": 1})
    pools = _pools()
    p = pools.workers["prefill-0"] = Worker("prefill-0", "prefill", None, state="ready", adaptive=True)
    _report(p, queued_prompt_tokens=100_000)
    for i in range(3):
        d = pools.workers[f"decode-{i}"] = Worker(f"decode-{i}", "decode", None, state="ready", adaptive=True)
        _report(d, running=1, used=4)
    pools.workers["decode-0"].state, pools.workers["decode-0"].next_role = "draining", "prefill"
    switched = SimpleNamespace(labels=lambda role: SimpleNamespace(inc=lambda: None))

    async def run():
        ctl = RoleController(cfg.roles, cfg.autoscale, pools, lambda: cluster_view(pools.workers.values(), []),
                             lambda w: True, switched)
        assert ctl.step(0.0) is None  # (the want must hold switch_delay_s)
        done = ctl.step(1.0)
        # (the draining one counted where it goes: the backlog is over two workers)
        assert done is not None and "decode -> prefill: prefill: queued prompt tokens 50000/worker" in done
        assert sum(w.state == "draining" and w.next_role == "prefill" for w in pools.workers.values()) == 2
        pools.workers["decode-1"].state = "draining"  # retiring (no next role): no decision,
        assert ctl.step(5.0) is None and ctl.step(9.0) is None  # though the backlog is still there
        assert ctl.trace[-1][1].queued_prompt_tokens == 100_000
        assert sum(w.state == "draining" and w.next_role == "prefill" for w in pools.workers.values()) == 2
        await _stop(pools)
    asyncio.run(run())
