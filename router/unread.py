"""Streams whose client stops reading: ended within ``front_door.unread_stream_timeout_s``.

A client that opens streams and never reads them would hold each request's KV blocks, its
decode seat and its token's ``max_concurrent`` place for as long as flow control holds the
server's writes (gRPC: the HTTP/2 window; SSE: the socket buffers, then asyncio's high-water
mark): the write of the next message waits for the client to read. ``relay`` stands between a
response's source (router.server ``generate``) and the server's writer (its consumer)::

    source ──producer task──► at most one message ahead ──► consumer (the server's write loop)

The producer keeps one message ready; when the next is ready too and the consumer does not
take the waiting one within the timeout (it is still stuck writing the one before), the
producer closes the source at once (the requests are aborted on every worker, their blocks
freed, the admission lease released: router.server), calls ``on_stall`` (SSE: the connection
is aborted, router.openai_http) and the consumer gets :class:`Unread` when it next asks (gRPC:
RESOURCE_EXHAUSTED, sent after the messages already queued: grpc sends a status only behind
them, so the call itself ends when the client reads or its connection ends: docs/security.md).

A slow model never counts: the clock runs only while a ready message waits to be taken, not
while the source works on the next one. A client that reads, however slowly, takes a message
now and then and is never cut off for the stream's length alone.

Before the end, at ``park_s`` (``front_door.park_unread_s``) of the same wait, the stream's
requests are parked (router.parking ``Hold``): aborted on their workers, and placed again once
the client takes the waiting message.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

log = logging.getLogger("pdserve.router")

AHEAD = 1  # messages the producer keeps ready beyond the one being written


class Unread(Exception):
    """The client took no next message for ``timeout_s``; the request was ended."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the stream was not read for {timeout_s:g} s (front_door.unread_stream_timeout_s): "
                         "its request was ended and its resources freed")
        self.timeout_s = timeout_s


class _Kind(enum.Enum):
    ITEM = "item"
    END = "end"
    ERROR = "error"  # the source raised (router.reject.Reject, ...): the consumer raises it
    STALLED = "stalled"


class Parkable(Protocol):
    """What a relay parks while its consumer waits (router.parking ``Hold``)."""

    def park(self) -> None: ...

    def unpark(self) -> None: ...


async def _joined(q: asyncio.Queue, timeout_s: float) -> bool:
    """Whether the consumer took every message ready (``task_done`` at its get) within
    ``timeout_s``. Not wait_for: on 3.11 it swallows a cancel that meets the join's end, and the
    producer would outlive its consumer."""
    try:
        async with asyncio.timeout(timeout_s):
            await q.join()
    except TimeoutError:
        return False
    return True


async def _taken(q: asyncio.Queue, timeout_s: float, hold: Parkable | None, park_s: float) -> bool:
    """``_joined`` within ``timeout_s``, ``hold`` parked from ``park_s`` until then (unparked
    only if the consumer took them: at a stall the source is closed instead)."""
    if hold is None or not 0 < park_s < timeout_s:
        return await _joined(q, timeout_s)
    if await _joined(q, park_s):
        return True
    hold.park()
    if not await _joined(q, timeout_s - park_s):
        return False
    hold.unpark()
    return True


async def _produce(source: AsyncGenerator, q: asyncio.Queue, timeout_s: float,
                   on_stall: Callable[[], None] | None, hold: Parkable | None, park_s: float) -> None:
    try:
        async for item in source:
            if q.qsize() >= AHEAD:
                if not await _taken(q, timeout_s, hold, park_s):
                    await source.aclose()  # frees the requests now, not when the client reads
                    log.info("event=unread_stream timeout_s=%g: request ended", timeout_s)
                    q.put_nowait((_Kind.STALLED, None))
                    if on_stall is not None:
                        on_stall()
                    return
            q.put_nowait((_Kind.ITEM, item))
        q.put_nowait((_Kind.END, None))
    except BaseException as e:
        # A cancel is the consumer's own (below: nobody reads this then), or one raised inside
        # the source: then the consumer, waiting for the next message, must get it too
        q.put_nowait((_Kind.ERROR, e))
        if not isinstance(e, Exception):
            raise
    finally:  # cancelled while a message waited: the source sits at its yield, still holding
        await source.aclose()


async def relay(source: AsyncGenerator, timeout_s: float, on_stall: Callable[[], None] | None = None,
                hold: Parkable | None = None, park_s: float = 0.0) -> AsyncIterator[Any]:
    """``source``'s messages, ended if the consumer stops taking them, ``hold`` parked from
    ``park_s`` of that wait (0: never) until it takes them (module doc).

    Closing (or cancelling) the relay closes ``source``, as closing ``source`` itself would.

    Raises:
        Unread: the consumer took no next message for ``timeout_s`` (``source`` is closed).
        Whatever ``source`` raised.
    """
    q: asyncio.Queue = asyncio.Queue()  # (unbounded: the producer keeps the bound itself)
    task = asyncio.create_task(_produce(source, q, timeout_s, on_stall, hold, park_s), name="relay")
    try:
        while True:
            kind, value = await q.get()
            q.task_done()  # taken: the producer may put the next
            if kind is _Kind.ITEM:
                yield value
            elif kind is _Kind.END:
                return
            elif kind is _Kind.ERROR:
                raise value
            else:
                raise Unread(timeout_s)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
