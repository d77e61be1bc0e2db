"""Streams their client does not read stop costing the cluster: their requests are parked.

A client that stops reading a stream (the HTTP/2 window or its socket buffers are full, so the
server's writes wait: router.unread) would keep its requests decoding to their ``max_tokens``
until ``front_door.unread_stream_timeout_s`` (60 s) ends them: the tokens pile up in the
router, and every step of the decode batch they share costs the clients who do read beside
them. So after ``front_door.park_unread_s`` (2 s) of a message waiting, the stream's requests
are *parked*: aborted on their workers (KV blocks, decode seat and steps freed at once, as a
preemption frees them: router.preempt), and placed again only once the client takes the
waiting message, from the prompt plus every token already streamed: a new attempt
(router.jobs ``rerun``); the client sees one stream, nothing repeated or lost::

    RUNNING ──parked (aborted on its workers)──► PLACING, waits for its client to read ──► RUNNING

What stays: the request's place in its token's ``max_concurrent`` (it is still the client's
request) and, for ``unread_stream_timeout_s``, the stream itself. What it costs: a parked
request's prompt and streamed tokens are prefilled again when its client reads (its prefix
may still be cached). A client that reads, however slowly, is not parked: the clock runs only
while a message waits behind full buffers; one that reads in fits and starts, a message now and
then behind full buffers, would be parked and placed again for each: after ``MAX_PARKS`` a
request is parked no more (it decodes on, its tokens waiting in the router, until its stream is
read or ended). Parks count neither as failures (router.server ``MAX_ATTEMPTS``) nor as
preemptions (``router.max_preemptions``), and a parked request's latencies (the client's own
pauses) stay out of the latency histograms and the controllers' signals.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from router.jobs import Job, JobState, Parked
from worker.protocol import Key

log = logging.getLogger("pdserve.router")

MAX_PARKS = 4  # parks of one request at most (module doc)


def park(job: Job, abort: Callable[[Any, Key], None]) -> bool:
    """Stop ``job`` costing the cluster until its client reads (module doc): it is placed again
    only once ``job.reading`` is set. Returns whether an attempt was aborted (a job placed
    nowhere, being placed or already parked has none; one parked ``MAX_PARKS`` times is left)."""
    if job.parks >= MAX_PARKS:
        return False
    job.reading.clear()
    if job.state is not JobState.RUNNING or (job.prefill is None and job.decode is None):
        return False
    job.parks += 1
    job.marks.clear()  # (its pace restarts when it runs again: router.cluster_view)
    log.info("rid=%s event=parked times=%d decode=%s tokens=%d", job.request_id, job.parks,
             job.decode_id, len(job.generated))
    job.release(abort)
    job.state = JobState.PLACING  # (placed nowhere: router.holdings counts nothing of it)
    job.put(None, Parked())
    return True


async def place_when_read(job: Job, place: Callable[[Job], Awaitable[None]]) -> None:
    """``place(job)`` once its client reads (``job.reading``; at once unless parked); parked again
    if its stream was parked meanwhile. Not placed if aborted while it waited."""
    await job.reading.wait()
    if job.aborted:
        return
    await place(job)
    if job.hold is not None and job.hold.parked:
        job.hold.park_one(job)


class Hold:
    """The requests behind one client stream (an OpenAI request's ``n`` choices: several),
    parked and let go together; router.unread's relay calls ``park`` and ``unpark``.

    Args:
        abort: router.pools ``abort(worker, key)``: frees an attempt on a worker (idempotent).
        parked: the router's ``pdserve_requests_parked`` counter (``inc()``).
        live: router.holdings.Holdings: a parked request holds nothing there any more.
    """

    def __init__(self, abort: Callable[[Any, Key], None], parked: Any = None, live: Any = None) -> None:
        self.abort, self.counter, self.live = abort, parked, live
        self.jobs: list[Job] = []
        self.parked = False

    def add(self, job: Job) -> None:
        """``job`` answers on this stream (router.server ``_serve``): parked too if the stream is."""
        self.jobs.append(job)
        job.hold = self
        if self.parked:
            self.park_one(job)

    def remove(self, job: Job) -> None:
        self.jobs = [j for j in self.jobs if j is not job]
        job.hold = None

    def park_one(self, job: Job) -> None:
        if park(job, self.abort):
            if self.counter is not None:
                self.counter.inc()
            if self.live is not None:
                self.live.update(job)

    def park(self) -> None:
        """A message has waited ``park_unread_s`` for the client to take it."""
        self.parked = True
        for job in self.jobs:
            self.park_one(job)

    def unpark(self) -> None:
        """The client took it: the parked requests may be placed again."""
        self.parked = False
        for job in self.jobs:
            job.reading.set()
