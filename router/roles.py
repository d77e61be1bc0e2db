"""Role switching (``mode: adaptive``): workers move between the prefill and the decode pool
at run time, without a restart, by the same per-pool signals the autoscaler reads.

Every worker of an adaptive cluster runs one engine that can do both (``adaptive_worker``), so
a worker's role is only which calls the router makes to it. The policy, over one snapshot of
each pool (``autoscale.pool_signals``, ``autoscale.pressure`` against ``autoscale.prefill`` and
``autoscale.decode`` targets):

- the prefill pool wants more (a prompt backlog at it, or at the decode workers once no
  prefill worker is left; or TTFT p90 over its class's target) and the decode pool does not
  (KV under ``kv_high``, nobody waiting for admission, TPOT p90 within target) and can spare a
  worker (the others hold its KV under ``kv_high``: its headroom): a decode worker becomes a
  prefill worker, if more than ``roles.min_decode`` are left;
- the other way round (decode memory short, or TPOT p90 over target while a prefill pool
  takes the long prompts: then it is the batch's, which a worker more splits), or the
  prefill pool idle (no backlog, TTFT well under target: a decode worker takes its streams
  and short prompts) while the decode pool is not (KV over ``kv_low`` or TPOT p90 over 0.7x
  target), a prefill worker becomes a decode worker (``roles.min_prefill``; with 0, the last
  one too: then every decode worker prefills its own prompts, as colocated ones; the first
  backlog brings one back);
- both want more: requests waiting for decode memory with no prompt backlog go to decode (no
  prompt can start decoding without it); both late by latency alone, the pool over its
  target by ``TIE_MARGIN`` times more than the other gains the worker; else no change.
  Neither (and the prefill pool not idle): no change.

No role grows past its ``roles.max_prefill`` / ``roles.max_decode`` (null: no limit).

Hysteresis as the autoscaler's: a want must hold for ``switch_delay_s`` without a break (an
idle prefill pool: ``idle_delay_s``, longer, as the autoscaler's shrinking), one worker
switches per decision, and after a switch the next waits ``switch_delay_s`` again. While
workers drain to switch, more may follow the same way on a backlog or memory want (not on
latency, which shows a switch only a window later), the other way waits
(``decide_moving``).
``decide`` is pure over the snapshots (unit-tested on synthetic traces); ``RoleController``
carries its decisions out through ``Pools.switch``: the worker leaves its pool at once (no new
work of the old role), finishes what it holds in the old role, then joins the other pool with
its weights, compiled graphs and prefix cache.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.autoscale import DecodeTargets, PrefillTargets, Signals, pool_signals, pressure
from router.cluster_view import ClusterView
from router.worker_state import Role, WorkerState

log = logging.getLogger("pdserve.roles")


@dataclass(frozen=True)
class RolesConfig:
    interval_s: float = 2.0  # how often the controller decides
    switch_delay_s: float = 5.0  # a want must hold this long; and a switch waits this long after the last
    idle_delay_s: float = 30.0  # ... but an idle prefill pool must stay idle this long to give a worker to decode
    # Workers that stay in each role whatever the load. min_prefill 0: with no prefill worker
    # left, decode workers prefill their own prompts (as colocated workers do).
    min_prefill: int = 1
    min_decode: int = 1
    max_prefill: int | None = None  # the most workers in each role (None: no limit)
    max_decode: int | None = None


@dataclass
class RoleState:
    """What the controller remembers between decisions."""

    want: tuple[str, str] | None = None  # (from role, to role) the snapshots asked for lately
    since: float | None = None  # since when, without a break
    last_switch: float = -math.inf
    history: list[str] = field(default_factory=list)


def decide(now: float, prefill: Signals, decode: Signals, tp: PrefillTargets, td: DecodeTargets,
           cfg: RolesConfig, state: RoleState) -> tuple[tuple[str, str] | None, str]:
    """((from role, to role), reason) for one worker to switch now, or (None, ""); updates
    ``state``."""
    p_up, p_idle, p_why = pressure("prefill", prefill, tp)
    # Decode wants more by its memory (KV utilization, requests waiting for admission) ...
    d_up, _, d_why = pressure("decode", dataclasses.replace(decode, tpot_p90_s=None), td)
    # Requests held in the admission queue (no decode KV for them) cannot start at all,
    # whatever the prefill pool does: with no prompt backlog there, a TTFT over target (of
    # the requests that did get placed) yields to decode's memory. Both wanting was no change
    # (simulated phase load, 16 workers: 15 prefill : 1 decode through the whole
    # decode-heavy half, requests queued for admission).
    if p_up and d_up and decode.waiting_admission > 0 \
            and not pressure("prefill", dataclasses.replace(prefill, ttft_p90_s=None), tp)[0]:
        p_up = False
    # ... or by TPOT over target, but only while a prefill pool takes the long prompts: then
    # the slow steps are the batch's, which one more decode worker splits (a steady trickle of
    # long prompts keeps the prefill pool from ever being idle: issue 44, bug 3). With no
    # prefill worker left, every prompt is prefilled between the decode steps and the TPOT is
    # the prompts' stalls, which one more decode worker does not cure and one more prefill
    # worker does.
    slow = decode.tpot_p90_s is not None and decode.tpot_p90_s * 1e3 > td.target_tpot_ms and prefill.workers > 0
    if slow and not d_up:
        d_up, d_why = True, f"TPOT p90 {decode.tpot_p90_s * 1e3:.0f} ms > {td.target_tpot_ms:.0f} ms"
        # Both slow by latency alone (no request waits for decode memory): the pool further
        # over its target, by TIE_MARGIN, gains the worker. "No change" left a prompt backlog
        # of minutes (TTFT p90 50x its target) behind streams at 1.3x theirs, where the load
        # had turned from long answers to documents (simulated phase load, 16 workers). The
        # margin: with whole workers the two ratios cross at each switch, and without it one
        # worker went back and forth between two splits.
        if p_up:
            p_up, d_up = _tie(_excess(prefill, tp), decode.tpot_p90_s * 1e3 / td.target_tpot_ms)
    # ... but an idle prefill pool gives its worker away only to a decode pool that is not idle
    # itself (TPOT counts here: with no prompt backlog, it is the batch's, which one
    # more decode worker splits). A worker given to an idle decode pool helps no stream, and
    # the next long prompt then lands on a worker with streams (local:no_pool) and stalls them
    # until the switch back: measured on the mix at 0.3 req/s, chats' p99 TPOT 2.4x colocated.
    _, d_idle, _ = pressure("decode", decode, td)
    # Decode's headroom: the workers left must hold the KV in use now under kv_high, else the
    # switch only turns the want around (decode short of memory, a worker back)
    spare = decode.workers > 1 and decode.kv_utilization * decode.workers / (decode.workers - 1) < td.kv_high
    to_prefill = decode.workers > cfg.min_decode and spare and _below(prefill.workers, cfg.max_prefill)
    to_decode = prefill.workers > cfg.min_prefill and _below(decode.workers, cfg.max_decode)
    want, why, delay = None, "", cfg.switch_delay_s
    if p_up and not d_up and to_prefill:
        want, why = ("decode", "prefill"), f"prefill: {p_why}"
    elif d_up and not p_up and to_decode:
        want, why = ("prefill", "decode"), f"decode: {d_why}"
    elif p_idle and not d_idle and to_decode:
        # (slower: a pause between prompt bursts is no reason to give the prefill worker away)
        want, why, delay = ("prefill", "decode"), f"prefill: {p_why}", cfg.idle_delay_s
    if want != state.want:
        state.want, state.since = want, (now if want is not None else None)
    if want is None or now - state.since < delay or now - state.last_switch < cfg.switch_delay_s:
        return None, ""
    # (how long the want held says which wait a late switch sat in: the signals', or the delay)
    why = f"{why} (wanted for {now - state.since:.0f} s)"
    state.last_switch, state.want, state.since = now, None, None
    state.history = (state.history + [f"{want[0]} -> {want[1]}: {why}"])[-20:]
    return want, why


def decide_moving(now: float, prefill: Signals, decode: Signals, moving: list[str | None], tp: PrefillTargets,
                  td: DecodeTargets, cfg: RolesConfig, state: RoleState) -> tuple[tuple[str, str] | None, str]:
    """:func:`decide` while workers are on their way: ``moving`` is the role each draining
    worker will join (None: one retiring, the autoscaler's: no decision until it is gone).

    More of the same way goes on while they drain, each counted in the pool it joins (its
    limits, its backlog per worker), on a prompt backlog or decode memory only: the latency
    signals (30 s windows) show a switch only once the worker has joined and a window has
    passed, and read while it drains they would move worker after worker for one want. A decode
    worker drains its streams first, and long answers take a minute: one switch at a time then
    held the prefill pool at one worker per minute while its backlog grew to minutes
    (simulated phase load, 16 workers). The other way waits until they have joined (its want
    starts holding then: no flapping).
    """
    if any(m is None for m in moving):
        return None, ""
    to_p = sum(m == "prefill" for m in moving)
    p = dataclasses.replace(prefill, workers=prefill.workers + to_p)
    d = dataclasses.replace(decode, workers=decode.workers + len(moving) - to_p)
    if moving:
        p, d = dataclasses.replace(p, ttft_p90_s=None), dataclasses.replace(d, tpot_p90_s=None)
    trial = dataclasses.replace(state)
    want, why = decide(now, p, d, tp, td, cfg, trial)
    way = want or trial.want
    if way is not None and any(m != way[1] for m in moving):
        state.want, state.since = None, None  # (the want of the drains' way broke)
        return None, ""
    state.__dict__.update(trial.__dict__)
    return want, why


def _excess(prefill: Signals, tp: PrefillTargets) -> float:
    """How far over its targets the prefill pool is: the larger of TTFT p90 / target and the
    prompt backlog per worker / target (1: at target)."""
    ttft = prefill.ttft_p90_s * 1e3 / tp.target_ttft_ms if prefill.ttft_p90_s is not None else 0.0
    return max(ttft, prefill.queued_prompt_tokens / max(1, prefill.workers) / tp.target_queued_tokens)


TIE_MARGIN = 1.5  # both pools late: how many times further over its target one must be to win


def _tie(p_excess: float, d_excess: float) -> tuple[bool, bool]:
    """(prefill wants, decode wants) when both are late by latency: the one ``TIE_MARGIN``
    times further over its target (``decide``), else neither."""
    return p_excess > TIE_MARGIN * d_excess, d_excess > TIE_MARGIN * p_excess


def _below(n: int, most: int | None) -> bool:
    """A role of ``n`` workers may gain one (``most``: its roles.max_*, None: no limit)."""
    return most is None or n < most


class RoleController:
    """Runs :func:`decide` every ``interval_s`` over snapshots of the cluster; the pools switch
    the workers.

    Args:
        cfg: ``ClusterConfig.roles``.
        autoscale: ``ClusterConfig.autoscale`` (the targets, and the latency window).
        pools: what switches a worker's role (router.pools.Pools: ``switch``).
        view: the cluster now (router.cluster_view).
        holds: whether a request of the router's runs on a worker (it may not switch yet).
        switched: counts a switch by the role switched to (``RouterMetrics.role_switches``).
    """

    def __init__(self, cfg: RolesConfig, autoscale: Any, pools: Any, view: Callable[[], ClusterView],
                 holds: Callable[[Any], bool], switched: Any) -> None:
        self.cfg, self.autoscale, self.pools, self.view = cfg, autoscale, pools, view
        self.holds, self.switched = holds, switched
        self.state = RoleState()
        self.events: collections.deque[str] = collections.deque(maxlen=50)  # shown by `pdserve status`
        self.switches: list[tuple[float, str, str, str, str]] = []  # (unix time, worker, from, to, why), the last 1000
        # (unix time, prefill Signals, decode Signals, the want after it) of each decision, the
        # last ~hour at the default interval: which signal held a switch back (bench/serving.py)
        self.trace: collections.deque[tuple[float, Signals, Signals, tuple[str, str] | None]] = \
            collections.deque(maxlen=2000)

    def step(self, now: float) -> str | None:
        """One decision; returns what was done."""
        view = self.view()
        moving = [w.next_role and w.next_role.value for w in view.workers if w.state is WorkerState.DRAINING]
        window, tp = self.autoscale.window_s, self.autoscale.prefill
        s_p, s_d = pool_signals(view, "prefill", now, window, tp), pool_signals(view, "decode", now, window, tp)
        # The prompt backlog: what waits at the prefill pool, or with no prefill worker left,
        # at the decode workers (their local prefills are then all of it). With one, a decode
        # worker's local prefills are prompts placement keeps there (short ones, or a long one
        # it took while the pool had a queue itself): no backlog for the pool (measured: a
        # chat's 78-token local prefill, queued for a step, broke an idle pool's want twice).
        queued = sum(w.queued_prompt_tokens for w in view.workers if w.state.accepting
                     and (w.role is Role.PREFILL or not s_p.workers))
        s_p = dataclasses.replace(s_p, queued_prompt_tokens=queued)
        want, why = decide_moving(now, s_p, s_d, moving, self.autoscale.prefill, self.autoscale.decode, self.cfg,
                                  self.state)
        self.trace.append((time.time(), s_p, s_d, want or self.state.want))
        if want is None:
            return None
        return self.switch(want[0], want[1], why)

    def switch(self, old: str, new: str, why: str, worker_id: str | None = None) -> str | None:
        """Move one worker (``worker_id``, or the least loaded ready one of role ``old``) to
        role ``new``; returns what was done (None: no such worker)."""
        w = self.pools.switch(old, new, self.holds, worker_id)
        if w is None:
            return None
        msg = f"{w.worker_id} {old} -> {new}: {why}"
        log.info("role switch %s", msg)
        self.switched.labels(new).inc()
        self.events.append(f"{time.strftime('%H:%M:%S')} {msg}")
        self.switches = (self.switches + [(time.time(), w.worker_id, old, new, why)])[-1000:]
        return msg

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            self.step(time.monotonic())
