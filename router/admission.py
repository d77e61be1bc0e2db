"""Who goes next: per-token limits at arrival, then fair share within a priority while requests wait.

Two decisions, over the token policy (router.policy) and an injectable clock; no I/O, no
asyncio: the router (router.server) asks, and does what the answer says.

At arrival, ``admit(name, prompt_tokens)`` → a :class:`Lease`, or :class:`Refused` with a
retry hint (the router answers 429 / RESOURCE_EXHAUSTED):

- ``max_concurrent``: the token's leases still held (a lease is held from admission to the
  request's end, re-runs included) must be fewer. Retry hint: ``CONCURRENCY_RETRY_S``.
- ``tokens_per_minute``: a token bucket of that size, refilled at that rate per minute. Admitted
  while it is above zero; the prompt is charged at once, generated tokens as they stream
  (``charge``), so it may go below zero; the hint is how long it takes to climb back above.

While waiting for KV capacity (``enqueue`` → :class:`Entry` → ``turn``/``trying`` → ``leave``)::

    enqueue ──► WAITING ──turn() True: first in the order── trying() ──► TRYING (a reserve call in flight)
                  ▲                                                        │ not placed: turn() again
                  └────────────────────────────────────────────────────────┘
    leave(placed=True): dispatched (the class's virtual time moves on); leave(placed=False): gone

The order: strict across priority classes (``high`` before ``normal`` before ``low``); within
a class, start-time fair queueing by weight (Goyal et al., SFQ): a token's entry gets the start
tag ``S = max(V, F_token)`` and moves the token's finish tag to ``F_token = S + cost / weight``,
where V is the start tag of the class's last dispatched entry and ``cost`` the request's tokens
(prompt + max_tokens: what it may hold of the KV cache). Entries go in order of S, then arrival.
So while two tokens both wait, each is placed in proportion to its weight (in tokens), and a
token that waited for nothing banks no credit (S starts at V). Only the first WAITING entry may
try: a request that does not fit holds the rest of its class and those below (that is what
keeps a big high-priority request from starving behind small ones); TRYING ones do not hold it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.policy import Policy, TokenPolicy

CONCURRENCY_RETRY_S = 1.0  # the hint on a concurrency refusal: one of its requests may end by then
SECONDS_PER_MINUTE = 60.0


@dataclass(frozen=True)
class Refused:
    """Not admitted: over ``limit`` (``max_concurrent`` or ``tokens_per_minute``)."""

    limit: str
    message: str
    retry_after_s: float


@dataclass(eq=False)
class Lease:
    """One admitted request of ``name``, under the policy it was admitted with."""

    name: str
    policy: TokenPolicy
    held: bool = True


@dataclass(eq=False)
class Entry:
    """A request waiting for a placement (one per attempt)."""

    lease: Lease
    rank: int
    start: float
    finish: float
    seq: int
    trying: bool = False

    def order(self) -> tuple[int, float, int]:
        return self.rank, self.start, self.seq


@dataclass
class Bucket:
    """Tokens per minute as a bucket of ``size`` refilled at ``size`` per minute."""

    size: int
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.size, self.level + (now - self.stamp) * self.size / SECONDS_PER_MINUTE)
        self.stamp = now

    def wait_s(self) -> float:
        """Seconds until the level is above zero again (0: it is)."""
        return 0.0 if self.level > 0 else (1e-9 - self.level) * SECONDS_PER_MINUTE / self.size


@dataclass
class TokenStats:
    """Counters per token name (the metrics: router.metrics)."""

    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by limit
    tokens: int = 0
    in_flight: int = 0
    waiting: int = 0
    preempted: int = 0  # running requests preempted for a higher class (router.preempt)


class Admission:
    """The module doc's decisions. One event loop's (not thread-safe; ``stats`` is read from the
    metrics thread as a copy).

    Args:
        policy: every token's limits (router.policy).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, policy: Policy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy or Policy()
        self.clock = clock
        self._buckets: dict[str, Bucket] = {}
        self._stats: dict[str, TokenStats] = {}
        self._virtual: dict[int, float] = {}  # per class: start tag of its last dispatched entry
        self._finish: dict[tuple[int, str], float] = {}  # per (class, token): its latest finish tag
        self._waiting: set[Entry] = set()
        self._head: Entry | None = None
        self._stale = False  # _head must be recomputed
        self._seq = itertools.count()

    # ---- limits at arrival -------------------------------------------------------------------
    def reload(self, policy: Policy) -> None:
        """New limits for new requests (SIGHUP); running ones keep theirs. A bucket keeps its
        level (clamped to a smaller size), so a reload neither refills nor drains it."""
        self.policy = policy
        for name, b in list(self._buckets.items()):
            tpm = policy.of(name).tokens_per_minute
            if tpm is None:
                del self._buckets[name]
            else:
                b.refill(self.clock())
                b.size, b.level = tpm, min(b.level, tpm)

    def _bucket(self, name: str, p: TokenPolicy) -> Bucket | None:
        if p.tokens_per_minute is None:
            return None
        b = self._buckets.get(name)
        if b is None:
            b = self._buckets[name] = Bucket(p.tokens_per_minute, float(p.tokens_per_minute), self.clock())
        b.refill(self.clock())
        return b

    def stats_of(self, name: str) -> TokenStats:
        s = self._stats.get(name)
        if s is None:
            s = self._stats[name] = TokenStats()
        return s

    def admit(self, name: str, prompt_tokens: int) -> Lease | Refused:
        """Admit a request of ``name`` with a prompt of ``prompt_tokens`` (charged now), or not."""
        p, s = self.policy.of(name), self.stats_of(name)
        refused = None
        if p.max_concurrent is not None and s.in_flight >= p.max_concurrent:
            refused = Refused("max_concurrent", f"this token has {s.in_flight} requests in progress, its limit "
                                                f"(max_concurrent); retry when one ends", CONCURRENCY_RETRY_S)
        elif (b := self._bucket(name, p)) is not None and b.level <= 0:
            refused = Refused("tokens_per_minute", f"this token used its {p.tokens_per_minute} tokens per minute "
                                                   f"(prompt + generated); retry in {math.ceil(b.wait_s())} s",
                              b.wait_s())
        if refused is not None:
            s.refused[refused.limit] = s.refused.get(refused.limit, 0) + 1
            return refused
        s.admitted += 1
        s.in_flight += 1
        lease = Lease(name, p)
        self.charge(lease, prompt_tokens)
        return lease

    def charge(self, lease: Lease, tokens: int) -> None:
        """``tokens`` more used by the lease's request (its prompt, then what it generates)."""
        if tokens <= 0:
            return
        self.stats_of(lease.name).tokens += tokens
        if (b := self._bucket(lease.name, self.policy.of(lease.name))) is not None:
            b.level -= tokens

    def preempted(self, lease: Lease) -> None:
        """The lease's request was preempted (router.preempt): it waits again, in its class."""
        self.stats_of(lease.name).preempted += 1

    def release(self, lease: Lease) -> None:
        """The request ended (idempotent)."""
        if lease.held:
            lease.held = False
            self.stats_of(lease.name).in_flight -= 1

    # ---- fair order while waiting ------------------------------------------------------------
    def enqueue(self, lease: Lease, cost: int) -> Entry:
        """The lease's request waits for a placement; ``cost``: the tokens it may hold (> 0)."""
        p = lease.policy
        rank, v = p.rank, self._virtual.get(p.rank, 0.0)
        start = max(v, self._finish.get((rank, lease.name), v))
        finish = start + max(cost, 1) / p.weight
        self._finish[(rank, lease.name)] = finish
        e = Entry(lease, rank, start, finish, next(self._seq))
        self._waiting.add(e)
        self.stats_of(lease.name).waiting += 1
        self._stale = True
        return e

    def turn(self, e: Entry) -> bool:
        """Whether ``e`` may try to be placed now (it is WAITING again: a try that did not
        place it is over)."""
        if e.trying:
            e.trying, self._stale = False, True
        if self._stale:
            self._head = min((x for x in self._waiting if not x.trying), key=Entry.order, default=None)
            self._stale = False
        return self._head is e

    def trying(self, e: Entry) -> None:
        """``e`` found room and is being placed: it holds no one behind it meanwhile."""
        if not e.trying:
            e.trying, self._stale = True, True

    def leave(self, e: Entry, placed: bool) -> None:
        """``e`` stops waiting: placed (its class's virtual time moves to its start), or gone
        (refused, cancelled: its token's finish tag is rolled back if it was the latest).
        Idempotent."""
        if e not in self._waiting:
            return
        self._waiting.discard(e)
        self.stats_of(e.lease.name).waiting -= 1
        self._stale = True
        if placed:
            self._virtual[e.rank] = max(self._virtual.get(e.rank, 0.0), e.start)
        elif self._finish.get((e.rank, e.lease.name)) == e.finish:
            self._finish[(e.rank, e.lease.name)] = e.start
        if not self._waiting:  # idle: tags restart from the virtual times (no float growth)
            self._finish.clear()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, TokenStats]:
        """A copy of the per-name counters (safe to read from another thread)."""
        return {name: TokenStats(s.admitted, dict(s.refused), s.tokens, s.in_flight, s.waiting, s.preempted)
                for name, s in list(self._stats.items())}
