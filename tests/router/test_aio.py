"""router.aio.within: a deadline that never loses the caller's cancel (router/aio.py)."""

from __future__ import annotations

import asyncio

import pytest

from router.aio import within


async def _cancelled_as_it_wakes(wait) -> str:
    """A task waits on an event through ``wait``; the event is set and the task cancelled in
    the same loop turn (a client giving up just as its reservation is answered)."""
    ev = asyncio.Event()

    async def waiter() -> str:
        await wait(ev.wait(), 10)
        return "ran on"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # (it waits now)
    ev.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_that_meets_the_result_is_kept():
    assert asyncio.run(_cancelled_as_it_wakes(within)) == "cancelled"


def test_the_case_is_the_one_wait_for_loses_here():
    # The check above means something only where wait_for loses the cancel (3.11, which we pin)
    import sys
    expected = "ran on" if sys.version_info < (3, 12) else "cancelled"
    assert asyncio.run(_cancelled_as_it_wakes(asyncio.wait_for)) == expected


def test_it_times_out_and_returns_results():
    async def go():
        assert await within(asyncio.sleep(0, "x"), 1) == "x"
        assert await within(asyncio.sleep(0, "y"), None) == "y"
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), 0.01)
    asyncio.run(go())
