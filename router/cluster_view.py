"""``ClusterView``: a frozen snapshot of the cluster that the router hands its controllers
(router.autoscale, router.roles) and its metrics, instead of itself. They read it and decide;
what they decide is carried out by the pools (``Pools.grow``, ``drain``, ``switch``).

It holds what they read and no more: each worker's role, state, latest status and the blocks
and prompt tokens promised to it; the requests waiting for a decode worker and those running;
the recent latency samples, the requests still awaiting their first token and the running
streams' paces.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from router.worker_state import Role, Worker, WorkerState
from worker.protocol import ModelInfo, WorkerStatus

LIVE_MIN_TOKENS = 16  # a running stream's pace counts in the signals from this many tokens


@dataclass(frozen=True)
class WorkerView:
    """One worker, as of the snapshot."""

    worker_id: str
    role: Role
    state: WorkerState
    status: WorkerStatus | None = None
    info: ModelInfo | None = None
    adaptive: bool = False
    reserved_blocks: int = 0  # promised by calls its reports do not show yet
    queued_prompt_tokens: int = 0  # its reported queue plus the prompts of those calls
    next_role: Role | None = None  # draining to join this role (router.roles), not to retire

    def __post_init__(self) -> None:  # (the enums, also when made of plain names: tests)
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "state", WorkerState(self.state))
        if self.next_role is not None:
            object.__setattr__(self, "next_role", Role(self.next_role))

    @classmethod
    def of(cls, w: Worker) -> WorkerView:
        return cls(w.worker_id, w.role, w.state, w.status, w.info, w.adaptive, w.reserved_blocks,
                   w.load().queued_prompt_tokens, w.next_role)


@dataclass(frozen=True)
class ClusterView:
    """The cluster as of one moment (module docstring)."""

    workers: tuple[WorkerView, ...] = ()
    queued: int = 0  # requests waiting for a decode worker
    active: int = 0  # requests the router streams
    recent: tuple = ()  # router.autoscale.Latency samples (TTFT at first tokens, TPOT at finishes)
    paces: tuple[float, ...] = ()  # running streams' pace now (those of LIVE_MIN_TOKENS tokens or more)
    awaiting: tuple[tuple[float, int], ...] = ()  # (seconds waited, prompt tokens) of requests prefilling, no first token
    bad_reports: int = 0  # messages dropped on the report socket (router.pools)

    def ready(self, *roles: str) -> list[WorkerView]:
        """The workers of these roles that take requests now."""
        return [w for w in self.workers if w.role in roles and w.state.accepting]

    def any(self, state: WorkerState, *roles: str) -> bool:
        """Some worker (of these roles; none given: of any) is in ``state``."""
        return any(w.state is state and (not roles or w.role in roles) for w in self.workers)


def cluster_view(workers: Iterable[Worker], jobs: Iterable, recent: Iterable = (), queued: int = 0,
                 bad_reports: int = 0, now: float | None = None) -> ClusterView:
    """The snapshot of these workers and live jobs (router.jobs.Job), with the recent latencies
    (``now``: monotonic time, for how long the jobs without a first token have waited)."""
    jobs, now = list(jobs), time.monotonic() if now is None else now
    paces = tuple(j.pace for j in jobs if len(j.generated) >= LIVE_MIN_TOKENS and j.pace is not None)
    # (placed and prefilling, since its placement: a wait for a decode worker is no prefill's
    # doing, router.autoscale Latency)
    awaiting = tuple((now - (j.placed_time if j.placed_time is not None else j.arrival), len(j.prompt_ids))
                     for j in jobs if j.prefilling and j.first_token_time is None)
    return ClusterView(tuple(WorkerView.of(w) for w in list(workers)), queued, len(jobs), tuple(recent), paces,
                       awaiting=awaiting, bad_reports=bad_reports)
