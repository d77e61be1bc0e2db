"""Actor calls queued for the step loop's thread, which runs them between two steps.

A plain lock would let a busy loop take it back step after step and starve the calls; the
inbox runs them in arrival order, all of them, before the next step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from worker.protocol import Key


class Inbox:
    """``call`` (wait for the answer) and ``post`` (answered at once) from the actor's thread;
    ``run`` on the loop's."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Callable[[], Any], Future | Key]] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop thread between two steps; returns its result or raises."""
        fut: Future = Future()
        self._queue.append((fn, fut))
        return fut.result()

    def post(self, fn: Callable[[], Any], key: Key) -> None:
        """Queue ``fn()`` and return at once (so a burst of calls is taken in one step, not one
        per step); if it raises, ``run`` hands back ``key`` with the error."""
        self._queue.append((fn, key))

    def run(self) -> list[tuple[Key, Exception]]:
        """Run every queued call (on the loop thread); returns the posted ones that raised (bad
        input for the caller, e.g. InvalidRequestError), for the loop to report."""
        failed = []
        while self._queue:
            fn, waiter = self._queue.popleft()
            try:
                result = fn()
            except Exception as e:
                if isinstance(waiter, Future):
                    waiter.set_exception(e)
                else:
                    failed.append((waiter, e))
                continue
            if isinstance(waiter, Future):
                waiter.set_result(result)
        return failed
