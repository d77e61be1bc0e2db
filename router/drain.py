"""Stopping without dropping a request: the gate every front-door call passes, HTTP and gRPC.

::

    SERVING ──drain(grace_s)──► DRAINING ──(no call left, grace_s passed, or hurry())──► drained

While DRAINING, health says NOT_SERVING (gRPC ``Check``/``Watch``, HTTP ``/health`` 503), a new
call is refused with a hint to retry elsewhere (HTTP 503 with ``Retry-After``, gRPC UNAVAILABLE
with ``retry-after`` trailing metadata: router.http_guard, router.grpc_guard), and the calls
already running go on. ``drain`` returns once the last of them ends, or when ``grace_s`` has
passed (``front_door.shutdown_grace_s``, SIGTERM in router.app), or at ``hurry()`` (a second
signal); the servers' stop then aborts whatever still runs. There is no way back to SERVING:
a drained router is stopping.

A router of an HA cluster serves only while it leads (router.leader): ``holds`` is asked on
every call, and a router whose lease has passed is DRAINING at once (before its own stop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from router.aio import within

RETRY_AFTER_S = 1  # the retry hint on a refusal: another replica, or this one once it has room


class Gate:
    """Counts the calls in progress and refuses new ones once draining. One event loop's."""

    def __init__(self) -> None:
        self._draining = False
        self.holds: Callable[[], bool] = lambda: True  # this router leads (router.leader); else draining
        self.active = 0  # calls let in and not yet ended
        self._changed: asyncio.Event | None = None  # set at drain, at each last call's end, at hurry
        self._hurried = False

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    @property
    def draining(self) -> bool:
        return self._draining or not self.holds()

    def enter(self) -> bool:
        """Let a call in (True), or not: draining (False). Each True needs one ``leave``."""
        if self.draining:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self._changed is not None:
            self._changed.set()

    @contextlib.contextmanager
    def call(self) -> Iterator[bool]:
        """``with gate.call() as admitted:`` the call counts while inside, if admitted."""
        admitted = self.enter()
        try:
            yield admitted
        finally:
            if admitted:
                self.leave()

    async def until_draining(self) -> None:
        while not self.draining:
            await self._event().wait()
            if not self.draining:
                self._event().clear()

    def hurry(self) -> None:
        """Stop waiting for running calls (a second SIGTERM): ``drain`` returns now."""
        self._hurried = True
        self._event().set()

    async def drain(self, grace_s: float) -> int:
        """Turn NOT_SERVING, refuse new calls, and wait up to ``grace_s`` for the running ones.

        Returns:
            How many calls still run (0: all finished within the grace period).
        """
        self._draining, self._hurried = True, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self._event().set()  # wakes until_draining
        while self.active and not self._hurried:
            self._event().clear()
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._event().wait(), left)
        return self.active
