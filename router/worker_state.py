"""One worker as the router sees it: its role, its lifecycle state, and what it was promised.

The lifecycle (``Worker.state``: STARTING, READY, DRAINING, DEAD, GONE) is drawn in router.pools'
docstring, which moves workers along it (router.liveness for losses); here are the predicates
the rest of the router asks instead of comparing names.

Both enums are ``str`` valued: their values are the names `pdserve status`, the metrics'
labels and the proto's ``WorkerStatus`` have always shown, so no outside contract changes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from router.placement import WorkerLoad
from worker.protocol import Key, ModelInfo, WorkerStatus

MAX_EARLY = 4096  # reports kept while this router adopts a worker (``Worker.early``)


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    GONE = "gone"

    @property
    def accepting(self) -> bool:
        """New requests may be placed here."""
        return self is WorkerState.READY

    @property
    def may_hold_blocks(self) -> bool:
        """Its current process may hold requests' KV blocks (an abort or a call can reach it)."""
        return self in (WorkerState.READY, WorkerState.DRAINING)

    @property
    def in_pool(self) -> bool:
        """Counted in its role's pool: serving, or coming (back) up; not leaving, not gone."""
        return self in (WorkerState.READY, WorkerState.DEAD, WorkerState.STARTING)

    @property
    def alive(self) -> bool:
        """Serving, or may serve again (a request may wait for it)."""
        return self is not WorkerState.GONE

    @property
    def has_process(self) -> bool:
        """Its latest status is of a process that still runs (not a lost one's)."""
        return self not in (WorkerState.DEAD, WorkerState.GONE)


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def pool(self) -> str:
        """The pool it counts in ("prefill" or "decode": a colocated worker decodes), the
        resource its actors ask Ray for."""
        return "prefill" if self is Role.PREFILL else "decode"


class Unreachable:
    """An admitting call did not reach a serving worker (lost, stalled): try the others
    (router.pools' calls answer it)."""

    def __repr__(self) -> str:
        return "UNREACHABLE"


UNREACHABLE = Unreachable()


@dataclass
class Worker:
    """One actor as the router sees it. ``state`` and ``role`` are always enums (a plain
    string assigned is converted)."""

    worker_id: str
    role: Role  # an adaptive worker's changes (router.roles)
    actor: Any
    state: WorkerState = WorkerState.STARTING
    adaptive: bool = False  # an AdaptiveActor: answers both roles' calls
    next_role: Role | None = None  # draining to switch to this role (router.roles), not to retire
    incarnation: str | None = None
    address: str | None = None  # decode and colocated: the KV receiver's address
    status: WorkerStatus | None = None  # its latest report's; None until one arrives
    last_seen: float = field(default_factory=time.monotonic)
    # Blocks the router promised this worker that its reports do not show yet: (the call's
    # number, blocks, prompt tokens it will prefill). A report drops those its status has
    # admitted (``WorkerStatus.admitted``): a report sent before the worker took a call must
    # not erase that call's reservation.
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    calls: int = 0  # admitting calls (reserve, submit) made to its current incarnation
    restarts: int = 0
    info: ModelInfo | None = None  # model_info() of its current incarnation
    seq: int = 0  # the latest report's Report.seq from its current incarnation (older: a replay)
    ray_restarts: int | None = None  # Ray's restart count of the actor before its bring-up (None: unknown)
    checked_at: float = float("-inf")  # when a report of another incarnation last made the router ask Ray
    # (incarnation, its report key): worker.protocol.report_key, derived once per incarnation
    rkey: tuple[str, bytes] | None = field(default=None, repr=False)
    pieces: dict[Key, list] = field(default_factory=dict, repr=False)  # worker.protocol.join_pieces
    # While this router adopts it for the first time (router.ha ``adopt``): the reports it sends
    # before the answer tells its incarnation, kept to be taken after (router.resume); else None
    early: list[bytes] | None = field(default=None, repr=False)
    # The engine ids this router's first adoption of it kept to resume (router.ha ``adopt``):
    # an adoption tried again within the same bring-up keeps them too (router.liveness clears it)
    kept: frozenset[str] = frozenset()

    def keep_early(self, msg: bytes) -> bool:
        """Keep a report of an incarnation not known yet if this router is adopting the worker
        (``early``; at most ``MAX_EARLY``: ms of reports); whether it was taken."""
        if self.early is None:
            return False
        if len(self.early) < MAX_EARLY:
            self.early.append(msg)
        return True

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state":
            value = WorkerState(value)
        elif name in ("role", "next_role") and value is not None:
            value = Role(value)
        object.__setattr__(self, name, value)

    def ready_as(self, roles: tuple[str, ...]) -> bool:
        """Accepting requests, in one of ``roles`` (a check after a call's round trip: it may
        have been lost, or begun to drain or switch roles, meanwhile)."""
        return self.state.accepting and self.role in roles

    @property
    def reserved_blocks(self) -> int:
        return sum(b for _, b, _ in self.pending)

    def reported(self, status: WorkerStatus | None) -> None:
        """A new status (None: none yet, a new incarnation); reservations it shows are dropped."""
        self.status = status
        if status is not None and status.kv_address and self.address is not None:
            self.address = status.kv_address  # the newest (a replaced UCX worker's); older ones still reach it a while
        if status is None:
            self.pending, self.calls = [], 0
            self.pieces.clear()  # (records of a process whose requests moved elsewhere)
        else:
            self.calls = max(self.calls, status.admitted)
            self.pending = [(n, b, t) for n, b, t in self.pending if n > status.admitted]

    def load(self) -> WorkerLoad:
        s = self.status
        if s is None:
            return WorkerLoad(self.worker_id, self.role.value, 0, 0, 16, 0, 0, accepting=False)
        free = s.kv_blocks_free - self.reserved_blocks
        queued = s.queued_prompt_tokens + sum(t for _, _, t in self.pending)
        seqs = s.max_num_seqs - s.running - s.waiting - len(self.pending) if s.max_num_seqs > 0 else None
        return WorkerLoad(self.worker_id, self.role.value, max(0, free), s.kv_blocks_total, s.block_size,
                          queued, s.remaining_decode_tokens, accepting=self.state.accepting,
                          in_flight=len(self.pending), free_seqs=seqs)
