"""Awaiting with a deadline, without losing a cancel.

Python 3.11's ``asyncio.wait_for`` swallows a cancel that arrives in the same loop turn as
its awaitable's result: it returns the result and the task runs on as if never cancelled
(CPython gh-86296, fixed in 3.12 by building wait_for on ``asyncio.timeout``). For a request
that is a client who gave up while its decode reservation was being answered: the job went
on placing, transferring and re-running for nobody, holding its blocks until the stream's
unread timeout. ``within`` is ``asyncio.timeout`` around the await, which keeps the cancel;
tests/test_layout.py refuses ``asyncio.wait_for`` in our code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw``, raising TimeoutError after ``timeout_s`` seconds (None: no deadline); a
    cancel of the caller is raised even when ``aw`` finished in the same turn."""
    async with asyncio.timeout(timeout_s):
        return await aw
