"""Pool autoscaling: each pool grows and shrinks by its own signals, without flapping.

- prefill (compute): queued prompt tokens per worker against ``target_queued_tokens``, and
  the recent TTFT p90 against ``target_ttft_ms`` (per request class: a long prompt's TTFT is
  held to ``target_ttft_long_ms``, ``PrefillTargets.ttft_target_ms``);
- decode (memory): KV block utilization against ``kv_high``/``kv_low``, requests waiting for
  admission, and the recent TPOT p90 against ``target_tpot_ms``.

Hysteresis: "up" and "down" have separate thresholds with a dead band between them, a
condition must hold for ``up_delay_s`` / ``down_delay_s`` without a break before it acts, one
worker changes per decision, and after a change the pool waits its delay again. Sizes stay
within ``[min_replicas, max_replicas]``. ``decide`` is pure over a ``Signals`` snapshot, so
the policy is unit-tested on synthetic traces; the router's pools carry the decisions out
(growing: a new actor, whose resources make Ray's autoscaler add a node of the right type;
shrinking: drain a worker, which takes no new requests and exits when it holds none).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from router.cluster_view import LIVE_MIN_TOKENS, ClusterView
from router.worker_state import Role, WorkerState

__all__ = ["LIVE_MIN_TOKENS", "Latency", "PoolController", "Recent", "Signals", "decide", "latency_p90s",
           "pool_signals", "pressure"]

log = logging.getLogger("pdserve.autoscale")


@dataclass(frozen=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 4
    up_delay_s: float = 5.0
    down_delay_s: float = 30.0


@dataclass(frozen=True)
class PrefillTargets(PoolLimits):
    target_ttft_ms: float = 2000.0  # prompts up to long_prompt_tokens (chats)
    target_queued_tokens: int = 4096  # per worker: more is a TTFT backlog
    # Request classes by prompt length (what the router knows of every request): a document's
    # TTFT is mostly its own prefill, so one target for all would call a pool slow that only
    # serves documents at their pace, and take decode workers away for them (issue 44, bug 2).
    long_prompt_tokens: int = 1024
    target_ttft_long_ms: float = 10000.0  # prompts longer than long_prompt_tokens (documents)

    def ttft_target_ms(self, prompt_tokens: int) -> float:
        """The TTFT target of a request with this many prompt tokens (its class's)."""
        return self.target_ttft_long_ms if prompt_tokens > self.long_prompt_tokens else self.target_ttft_ms


@dataclass(frozen=True)
class DecodeTargets(PoolLimits):
    target_tpot_ms: float = 100.0
    kv_high: float = 0.85
    kv_low: float = 0.3


@dataclass(frozen=True)
class Signals:
    """One snapshot of a pool's load, taken by the router."""

    workers: int  # ready workers in the pool (draining ones excluded)
    queued_prompt_tokens: int = 0  # prefill
    # TTFT p90 over the recent first tokens, each scaled to ``target_ttft_ms`` by its class's
    # target (a document at its own target counts as a chat at the chats'): ``latency_p90s``.
    # None: no first token in the window
    ttft_p90_s: float | None = None
    awaiting_first_token: int = 0  # requests placed, prefilling, with no first token yet
    kv_utilization: float = 0.0  # decode: used / total blocks over the pool
    waiting_admission: int = 0  # decode: requests in the router's admission queue
    tpot_p90_s: float | None = None


@dataclass
class PoolState:
    """What the controller remembers of one pool between decisions."""

    up_since: float | None = None
    down_since: float | None = None
    last_change: float = -math.inf
    history: list[str] = field(default_factory=list)


def pressure(role: str, s: Signals, t: PrefillTargets | DecodeTargets) -> tuple[bool, bool, str]:
    """(wants more, wants fewer, reason) from one snapshot; never both."""
    if role == "prefill":
        per = s.queued_prompt_tokens / max(1, s.workers)
        slow = s.ttft_p90_s is not None and s.ttft_p90_s * 1e3 > t.target_ttft_ms
        if per > t.target_queued_tokens or slow:
            return True, False, (f"queued prompt tokens {per:.0f}/worker > {t.target_queued_tokens}" if not slow
                                 else f"TTFT p90 {s.ttft_p90_s * 1e3:.0f} ms > {t.target_ttft_ms:.0f} ms")
        # No TTFT data is idle only while no request waits for its first token: a prompt still
        # being prefilled (a long one, or many behind it) has no TTFT yet (issue 44, bug 1)
        fast = s.awaiting_first_token == 0 if s.ttft_p90_s is None else s.ttft_p90_s * 1e3 < 0.5 * t.target_ttft_ms
        idle = s.queued_prompt_tokens == 0 and fast
        return False, idle, "no prompt backlog and TTFT well under target" if idle else ""
    slow = s.tpot_p90_s is not None and s.tpot_p90_s * 1e3 > t.target_tpot_ms
    if s.kv_utilization > t.kv_high or s.waiting_admission > 0 or slow:
        why = (f"KV utilization {s.kv_utilization:.0%} > {t.kv_high:.0%}" if s.kv_utilization > t.kv_high
               else f"{s.waiting_admission} requests waiting for admission" if s.waiting_admission
               else f"TPOT p90 {s.tpot_p90_s * 1e3:.0f} ms > {t.target_tpot_ms:.0f} ms")
        return True, False, why
    idle = s.kv_utilization < t.kv_low and (s.tpot_p90_s is None or s.tpot_p90_s * 1e3 < 0.7 * t.target_tpot_ms)
    return False, idle, f"KV utilization {s.kv_utilization:.0%} < {t.kv_low:.0%}" if idle else ""


def decide(role: str, now: float, s: Signals, t: PrefillTargets | DecodeTargets, state: PoolState) -> tuple[int, str]:
    """+1 (add a worker), -1 (drain one) or 0, with the reason; updates ``state``."""
    up, down, why = pressure(role, s, t)
    state.up_since = (state.up_since if state.up_since is not None else now) if up else None
    state.down_since = (state.down_since if state.down_since is not None else now) if down else None
    if s.workers < t.min_replicas:
        return _change(state, now, +1, f"below min_replicas {t.min_replicas}")
    if s.workers > t.max_replicas:
        return _change(state, now, -1, f"above max_replicas {t.max_replicas}")
    if up and s.workers < t.max_replicas and now - state.up_since >= t.up_delay_s \
            and now - state.last_change >= t.up_delay_s:
        return _change(state, now, +1, why)
    if down and s.workers > t.min_replicas and now - state.down_since >= t.down_delay_s \
            and now - state.last_change >= t.down_delay_s:
        return _change(state, now, -1, why)
    return 0, ""


class Latency(NamedTuple):
    """One latency sample: a request's TTFT at its first token, or its TPOT when it finished.

    The TTFT is counted from the request's placement (``Job.queue_free_ttft``), not its
    arrival: a wait in the router's admission queue is the decode pool's shortage (its
    ``waiting_admission`` signal), and counted in the TTFT it read as the prefill pool's,
    which then wanted the very worker the decode pool lacked (simulated phase load, 8 workers:
    workers moved back and forth every few seconds while requests queued for admission)."""

    at: float  # monotonic time it was taken
    ttft: float | None
    tpot: float | None
    prompt_tokens: int = 0  # its class (``PrefillTargets.ttft_target_ms``)


class Recent:
    """The ``Latency`` samples taken within ``window_s`` (the pool signals' window), at most
    ``cap`` of them: each request's TTFT when its first token comes (a long answer's would
    otherwise reach the signal minutes late) and its TPOT when it finishes. Older ones are
    dropped as new ones come: under a steady load the router's memory stays flat once a
    window is full."""

    def __init__(self, window_s: float, cap: int = 4096) -> None:
        self.window_s = window_s
        self._q: collections.deque[Latency] = collections.deque(maxlen=cap)

    def add(self, now: float, ttft: float | None, tpot: float | None, prompt_tokens: int = 0) -> None:
        self._q.append(Latency(now, ttft, tpot, prompt_tokens))
        while self._q[0][0] < now - self.window_s:
            self._q.popleft()

    def __iter__(self) -> Iterator[Latency]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


def _change(state: PoolState, now: float, delta: int, why: str) -> tuple[int, str]:
    state.last_change, state.up_since, state.down_since = now, None, None
    state.history = (state.history + [f"{'+1' if delta > 0 else '-1'}: {why}"])[-20:]
    return delta, why


def _p90(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))] if xs else None


def latency_p90s(samples: Iterable[Latency], awaiting: Iterable[tuple[float, int]], paces: Iterable[float],
                 now: float, window_s: float, t: PrefillTargets) -> tuple[float | None, float | None]:
    """(TTFT p90, TPOT p90) the pools are judged by (the router's and the simulator's one place).

    TTFT: the samples of the last ``window_s``, each scaled to ``t.target_ttft_ms`` by its
    class's target, and the requests still ``awaiting`` their first token ((waited s, prompt
    tokens) each) that are past their class's target already: their TTFT is at least that,
    and a miss whatever comes next (those under it are left out: not knowing their end, they
    would pull the p90 down). TPOT: the samples and the running streams' ``paces``.
    """
    base = t.target_ttft_ms
    recent = [x for x in samples if x.at >= now - window_s]
    ttfts = [x.ttft * base / t.ttft_target_ms(x.prompt_tokens) for x in recent if x.ttft is not None]
    ttfts += [w * base / t.ttft_target_ms(n) for w, n in awaiting if w * 1e3 > t.ttft_target_ms(n)]
    # Streams still running count too, by their pace now (Job.pace, over their last batches):
    # a long answer runs for minutes (1,000 tokens at 100 ms), and finished requests alone
    # tell of a slow batch only that late (measured on the phase load with 1,000-token
    # answers: the switch to a second decode worker came about 100 s into the decode-heavy
    # half). Not their TPOT so far either: it averages in the answer's faster start (with it,
    # the decode pool's TPOT p90 crossed 0.7x the target only ~60 s into that half, and the
    # switch came at ~85 s: docs/bench/adaptive_phase_trace.json). From LIVE_MIN_TOKENS
    # on, the first gap (which may hold the KV transfer's end) weighs at most 1/15.
    tpots = [x.tpot for x in recent if x.tpot is not None] + list(paces)
    return _p90(ttfts), _p90(tpots)


def pool_signals(view: ClusterView, pool: str, now: float, window_s: float,
                 targets: PrefillTargets | None = None) -> Signals:
    """A snapshot of one pool ("prefill" or "decode": colocated workers count as decode) of
    the cluster's ready workers, with TTFT and TPOT p90 (``latency_p90s``: the recent
    samples, the requests awaiting a first token and the streams still running, against
    ``targets``' classes)."""
    ws = view.ready(Role.PREFILL) if pool == "prefill" else view.ready(Role.DECODE, Role.COLOCATED)
    ttft, tpot = latency_p90s(view.recent, view.awaiting, view.paces, now, window_s, targets or PrefillTargets())
    reported = [w.status for w in ws if w.status is not None]
    used = sum(s.kv_blocks_used for s in reported) + sum(w.reserved_blocks for w in ws)
    total = sum(s.kv_blocks_total for s in reported)
    return Signals(workers=len(ws), queued_prompt_tokens=sum(s.queued_prompt_tokens for s in reported),
                   ttft_p90_s=ttft, awaiting_first_token=len(view.awaiting),
                   kv_utilization=used / total if total else 0.0, waiting_admission=view.queued, tpot_p90_s=tpot)


class PoolController:
    """Runs the policy every ``interval_s`` over snapshots of the cluster; the pools carry it out.

    Args:
        cfg: ``ClusterConfig.autoscale``.
        pools: what grows and drains pools (router.pools.Pools: ``grow``, ``drain``).
        view: the cluster now (router.cluster_view).
        holds: whether a request of the router's runs on a worker (it may not retire yet).
        colocated: one pool of colocated workers (else a prefill and a decode pool).
    """

    def __init__(self, cfg: Any, pools: Any, view: Callable[[], ClusterView], holds: Callable[[Any], bool],
                 colocated: bool = False) -> None:
        self.cfg, self.pools, self.view, self.holds, self.colocated = cfg, pools, view, holds, colocated
        self.states = {"prefill": PoolState(), "decode": PoolState()}
        self.events: collections.deque[str] = collections.deque(maxlen=50)  # shown by `pdserve status`

    def signals(self, pool: str, now: float) -> Signals:
        return pool_signals(self.view(), pool, now, self.cfg.window_s, self.cfg.prefill)

    def step(self, now: float) -> list[str]:
        """One round of decisions; returns what was done."""
        done, view = [], self.view()
        for pool in (("decode",) if self.colocated else ("prefill", "decode")):
            role = "colocated" if self.colocated else pool
            if view.any(WorkerState.STARTING, role):
                continue  # one change at a time: wait for the new worker to come up
            s = pool_signals(view, pool, now, self.cfg.window_s, self.cfg.prefill)
            delta, why = decide(pool, now, s, getattr(self.cfg, pool), self.states[pool])
            if delta > 0:
                w = self.pools.grow(role)
                msg = f"{pool} +1 ({w.worker_id}): {why}"
            elif delta < 0:
                w = self.pools.drain(role, self.holds)
                if w is None:
                    continue
                msg = f"{pool} -1 (draining {w.worker_id}): {why}"
            else:
                continue
            log.info("autoscale %s", msg)
            self.events.append(f"{time.strftime('%H:%M:%S')} {msg}")
            done.append(msg)
        return done

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            self.step(time.monotonic())
