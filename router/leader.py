"""Which router of an HA cluster leads: a lease with a deadline, held by one router at a time.

Two or more ``pdserve serve`` processes of one cluster (the same ``ha.cluster_name``, one Ray)
compete for one lease; the holder leads (it adopts or starts the workers and serves), the
others are standbys (router.standby: their ports refuse) that poll it. The lease is a detached,
named Ray actor, ``pdserve/<cluster>/leader`` (``Lease`` below, as an actor): it outlives every
router, every router of the cluster reaches it already (Ray, no other service to run), and
Ray runs its methods one at a time, so a take and a renewal are atomic. Its deadlines are on its
own monotonic clock: no two machines' clocks are compared. Ray's GCS KV alone would not do: it
has no compare-and-swap on a value, only create-if-absent (router.ha, the epochs).

The lease, as the actor sees it::

    FREE ──acquire(A)──► HELD by A until now + lease_s (term + 1)
      ▲                    │ renew(A) before the deadline: held until now + lease_s
      │                    │ acquire(B) while held: refused (B learns A holds it, and for how long)
      └── release(A), or the deadline passes (A died or stalled) ◄┘ then acquire(B) takes it

A router, as it sees itself (``Elector``)::

    STANDBY ──acquire granted──► LEADING until sent + lease_s * SAFE (renewed every lease_s / 3)
       ▲                              │ a renewal refused, or ``until`` passed (SIGSTOP, a lost GCS)
       └──────────────────────────────┘ stop serving at once, end no worker (router.app)

``until`` counts from when the request was *sent*, which is before the actor counted its
deadline: the router believes it leads for less time than the actor grants, so a standby can
take the lease only after the old leader has stopped believing it leads (clocks' rates alike,
``SAFE`` the margin). A leader that wakes from SIGSTOP finds ``until`` passed before it serves
another call (the drain gate asks ``leading()`` on every call: router.drain).

Bounds: a dead leader's lease lapses at most ``lease_s`` after its last renewal; a standby asks
at least every ``lease_s / RENEWALS`` (sooner when the holder's lease is about to end), then
starts its term (a new epoch, adoption, its servers: router.app). Renewals run in a thread of
their own: a router's event loop busy for a while keeps its lease, a stopped process loses it.

Safety does not rest on the lease: each router that leads takes a new epoch (router.ha
``next_epoch``) and the workers refuse the calls of an older one (worker.fence). The lease
only keeps two routers from serving at once (each would fence the other off in turn). If the
lease actor itself is lost (its node died) Ray restarts it empty; it then grants nothing for
one ``lease_s`` (``quiet_s``), so a leader that still believes it leads stops before another
takes over; were that bound broken, the epochs still fence the older router off its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router import ha

log = logging.getLogger("pdserve.router")

SAFE = 0.8  # of lease_s a leader counts on after sending a renewal (the rest: its margin)
RENEWALS = 3  # a leader renews this many times per lease_s (two may be lost before it lapses)


@dataclass(frozen=True)
class Grant:
    """The lease actor's answer to ``acquire``.

    Attributes:
        held: the caller holds the lease now (newly or still).
        holder: who holds it (None: nobody).
        term: how many times it changed hands (each take: + 1; 0 before the first).
        left_s: how long the holder's lease has left (0: free, or the caller's own).
    """

    held: bool
    holder: str | None
    term: int
    left_s: float


class Lease:
    """The lease's state and rules, the Ray actor's body (``lease_actor``); pure: tests drive it
    with an injected clock.

    Args:
        quiet_s: grants nothing for this long after it is made (a restarted actor: the module
            docstring); 0 for a new cluster's.
        clock: monotonic seconds.
    """

    def __init__(self, quiet_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.holder: str | None = None
        self.deadline = clock() + quiet_s  # the holder's lease ends here (before it: nobody may take it)
        self.term = 0
        self.seen: dict[str, float] = {}  # who asked, when last: the standbys waiting

    def acquire(self, who: str, lease_s: float) -> Grant:
        """Take the lease for ``lease_s`` if it is free (or ``who``'s own: renewed)."""
        now = self.clock()
        self.seen[who] = now
        if self.holder == who and now < self.deadline:
            self.deadline = now + lease_s
            return Grant(True, who, self.term, 0.0)
        if now < self.deadline:  # another's lease runs (or the quiet time after a restart)
            return Grant(False, self.holder, self.term, self.deadline - now)
        self.holder, self.deadline, self.term = who, now + lease_s, self.term + 1
        return Grant(True, who, self.term, 0.0)

    def renew(self, who: str, lease_s: float) -> bool:
        """Extend ``who``'s lease by ``lease_s`` from now; False if it is not ``who``'s or lapsed
        (then ``who`` leads no more, even if nobody took it yet: it must take it again)."""
        now = self.clock()
        if self.holder != who or now >= self.deadline:
            return False
        self.deadline = now + lease_s
        return True

    def release(self, who: str, lease_s: float) -> bool:
        """``who`` gives the lease up (a clean stop): free at once. Returns whether another
        router asked for it within ``lease_s`` (a standby that will take the workers over)."""
        now = self.clock()
        if self.holder == who:
            self.holder, self.deadline = None, now
        self.seen.pop(who, None)
        return any(now - t <= lease_s for t in self.seen.values())

    def holder_now(self) -> str | None:
        """Who holds the lease now (None: nobody, or it lapsed)."""
        return self.holder if self.clock() < self.deadline else None


def lease_name(cluster: str) -> str:
    """The lease actor's name within ``ha.NAMESPACE``."""
    return ha.actor_name(cluster, ha.LEADER)


def lease_actor(cluster: str, lease_s: float) -> Call:
    """The cluster's lease actor (the running one, or a new one: detached, it outlives this
    router; restarted by Ray if its process dies, quiet for ``lease_s`` then), as a ``Call``
    (each bounded by ``lease_s``: a lost GCS raises). Blocking."""
    import ray  # (heavy: Ray, loaded when the cluster starts)

    class _Actor(Lease):
        def __init__(self, quiet_s: float) -> None:
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
            super().__init__(quiet_s if restarted else 0.0)

    actor = ray.remote(_Actor).options(
        name=lease_name(cluster), namespace=ha.NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_concurrency=1).remote(lease_s)

    def call(method: str, who: str, lease_s: float) -> Any:
        return ray.get(getattr(actor, method).remote(who, lease_s), timeout=lease_s)
    return call


Call = Callable[[str, str, float], Any]  # (method, who, lease_s) -> the lease's answer; blocking


class Elector:
    """One router's side of the lease (the module docstring's STANDBY/LEADING).

    The renewals run in a thread of their own (``hold``), not on the router's event loop: a
    loop busy for a while (a term's start on a loaded machine) must not lose the lease; a
    stopped process (SIGSTOP) or an unreachable lease does.

    Args:
        call: the lease's methods (``lease_actor``; tests: a ``Lease`` in this process).
        who: this router's name for the lease (unique per process).
        lease_s: ``ha.lease_s``.
        clock: monotonic seconds.
    """

    def __init__(self, call: Call, who: str, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.call, self.who, self.lease_s, self.clock = call, who, lease_s, clock
        self.until = 0.0  # this router leads while clock() < until (written by the renewing thread)
        self.term = 0

    def leading(self) -> bool:
        """Whether this router may serve now (its lease, as it counts it, has not passed)."""
        return self.clock() < self.until

    def _granted(self, sent: float) -> None:
        # (counted from ``sent``: a late answer extends it less, never past the actor's deadline)
        self.until = sent + self.lease_s * SAFE

    async def acquire(self) -> int:
        """Wait until this router holds the lease (polling it); returns the term."""
        said = None
        while True:
            sent = self.clock()
            try:
                g = await asyncio.to_thread(self.call, "acquire", self.who, self.lease_s)
            except Exception as e:  # (the lease unreachable: keep trying; a standby serves nothing anyway)
                log.warning("leader lease: cannot reach it (%s: %s); retrying", type(e).__name__, e)
                await asyncio.sleep(self.lease_s / RENEWALS)
                continue
            if g.held:
                self._granted(sent)
                self.term = g.term
                return g.term
            if g.holder != said:
                log.info("standby: %s leads (lease term %d); taking over when its lease lapses", g.holder, g.term)
                said = g.holder
            await asyncio.sleep(poll_s(g.left_s, self.lease_s))

    async def hold(self) -> str:
        """Renew the lease (in a thread) while it lasts; returns why it was lost. Cancelling
        it ends the renewals."""
        loop, ended = asyncio.get_running_loop(), threading.Event()
        lost: asyncio.Future[str] = loop.create_future()

        def keep() -> None:
            why = self._keep(ended)
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(lambda: lost.done() or lost.set_result(why))
        threading.Thread(target=keep, name="lease", daemon=True).start()
        try:
            return await lost
        finally:
            ended.set()

    def _keep(self, ended: threading.Event) -> str:
        """The renewing thread: every ``lease_s / RENEWALS`` until the lease is lost or ``ended``."""
        while not ended.wait(max(0.0, min(self.lease_s / RENEWALS, self.until - self.clock()))):
            if not self.leading():
                return "its lease passed before it could renew it (it stalled, or the lease was unreachable)"
            sent = self.clock()
            try:
                ok = self.call("renew", self.who, self.lease_s)
            except Exception as e:  # (try again while the lease lasts)
                log.warning("leader lease: renewal failed (%s: %s)", type(e).__name__, e)
                continue
            if not ok:
                self.until = 0.0  # (serve nothing from now on)
                return "the lease refused its renewal (it lapsed: another router may lead)"
            self._granted(sent)
        return "ended"

    async def release(self) -> bool:
        """Give the lease up (a clean stop, or a standby that stops); returns whether another
        router waits to take over (False also when the lease cannot be reached)."""
        self.until = 0.0
        try:
            return bool(await asyncio.to_thread(self.call, "release", self.who, self.lease_s))
        except Exception as e:
            log.warning("leader lease: cannot release it (%s: %s): it lapses in %.1f s", type(e).__name__, e,
                        self.lease_s)
            return False


def poll_s(left_s: float, lease_s: float) -> float:
    """How long a standby waits before asking again: until the holder's lease would lapse, at
    most ``lease_s / RENEWALS`` (it may be released sooner), at least a tenth of that."""
    step = lease_s / RENEWALS
    return min(step, max(step / 10, left_s))
