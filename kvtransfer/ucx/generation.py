"""A UCX transport's workers: the one it uses, and those it replaced, kept until they are quiet.

Why a transport replaces its UCX worker: what UCX maps of a peer that connected back to us
stays mapped until our worker is destroyed, even once the peer's process has exited or its
endpoint is closed (``peers.py``, "Stale peers"). A long-lived worker whose peers are
replaced (restarts, autoscaling, faults) would keep every dead peer's shared memory. So once
enough peers are stale, ``transport.py`` makes a new :class:`Generation` (a new UCX context and
worker: a new worker address, the same uid), tells every known peer its new address (an
empty message on a new connection, whose header carries the address and the generation), and
keeps the old generation receiving until ``RETIRE_AFTER_S`` has passed and nothing is in
flight on it (at most ``RETIRE_FORCE_S``), then destroys it, which unmaps what it held.

    current ──stale >= recycle_at, nothing in flight──► retiring (receives, sends nothing new)
                                                           │ RETIRE_AFTER_S and quiet,
                                                           ▼ or RETIRE_FORCE_S
                                                        destroyed (its endpoints closed first)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ucxx._lib.libucxx as ucx_api

logger = logging.getLogger("kvtransfer.ucx")

# A peer that holds our old address (a copy from the control plane, a message already on its
# way) keeps reaching us this long: longer than a worker's status period and a router's
# re-wiring of a new address, far shorter than a lease.
RETIRE_AFTER_S = 30.0
RETIRE_FORCE_S = 120.0  # then it goes even with messages in flight on it (their transfers fail)


@dataclass(eq=False)
class Generation:
    """One UCX context + worker of a transport, numbered from 0."""

    number: int
    ctx: object
    worker: object
    address: bytes  # its UCX worker address
    retired_at: float | None = None  # monotonic time it stopped being the current one
    endpoints: list = field(default_factory=list)  # ours on it, closed with it once retired

    @classmethod
    def make(cls, number: int, config: dict | None) -> Generation:
        ctx = ucx_api.UCXContext(config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        worker = ucx_api.UCXWorker(ctx)
        worker.init_blocking_progress_mode()  # creates the epoll fd the idle wait uses
        return cls(number, ctx, worker, worker.address.tobytes())

    def due(self, now: float, busy: bool) -> bool:
        """Whether a retired generation should be destroyed now."""
        age = now - self.retired_at
        return age >= RETIRE_FORCE_S or (age >= RETIRE_AFTER_S and not busy)

    def destroy(self, close_endpoint) -> None:
        """Cancel what is in flight on it, close its endpoints, drop the worker and context
        (the caller drops its own requests of this generation first or after: they are
        cancelled). Best effort: the objects go either way."""
        w = self.worker
        try:
            w.cancel_inflight_requests()
            for ep in self.endpoints:
                close_endpoint(ep)
            for _ in range(10):
                w.progress()
        except Exception:
            logger.exception("ucx worker generation %d shutdown", self.number)
        self.endpoints.clear()
        self.worker = self.ctx = None


def close_endpoint(ep: object) -> None:
    """Close one of our UCX endpoints (sends in flight on it finish or stay until our worker goes)."""
    try:
        ep.close()
    except Exception:  # closing an endpoint whose peer is gone: nothing to do
        logger.debug("ucx endpoint close", exc_info=True)


def request_ok(req, what: str) -> bool:
    """Whether a completed UCX request succeeded (a failure is logged; the caller reports the peer dropped)."""
    try:
        req.check_error()
        return True
    except Exception as e:  # any UCX error: the peer's connection is what failed
        logger.warning("ucx %s failed: %s", what, e)
        return False
