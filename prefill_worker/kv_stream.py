"""The transfer thread: gathers and sends each computed layer's KV while the next layers compute.

Why: on a CPU, gathering a layer's KV out of the paged cache, checksumming it and the
transport's copying are work of the same order as the transfer itself. Done between two layers
on the forward's thread (the default, inline), it delays every later layer by as much; done by
this thread on a core the forward does not use (``cpus``, with the UCX progress thread's
``progress_cpus``), it runs beside layers i+1.. and only the last layer is left after the
forward. torch releases the GIL inside its kernels, so the two threads run in parallel.
On the forward's own cores it only preempts the forward: give it a core or leave it off.

When it runs (the invariant that makes it safe without locks): jobs are queued only from the
``layer_done`` hook of one engine step, and :meth:`LayerStreamer.flush` waits for all of them
before that step returns. So the sender is used by this thread only while the step thread is
inside the forward (which never uses the sender); blocks are never freed or reused while a job
reads them (frees happen between steps); and a layer's cache is final once its hook ran
(later layers write other tensors).

Lifecycle of one job: ``put`` (queued, FIFO) → gathered and sent on the thread → done. An
exception fails that request only: its later jobs are skipped and ``flush`` reports it (the
step thread then fails its transfer, as the inline path does).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from engine.openmp import one_thread
from kvtransfer.format import gather_layer
from kvtransfer.sender import KVSender

log = logging.getLogger("pdserve.worker")


@dataclass(frozen=True)
class LayerJob:
    """Send tokens [start, end) of one request's layer ``layer`` (its blocks as of this step)."""

    engine_id: str
    layer: int
    block_ids: tuple[int, ...]
    start: int
    end: int


def send_job(sender: KVSender, kv_caches: Sequence, block_size: int, job: LayerJob) -> None:
    """Gather one layer's token range out of the paged cache and send it (inline or on the thread)."""
    k, v = gather_layer(kv_caches[job.layer], job.block_ids, block_size, job.start, job.end)
    sender.send_layer(job.engine_id, job.layer, k, v, token_start=job.start)


class LayerStreamer:
    """One daemon thread sending queued layers through ``sender`` (module doc), on ``cpus``
    (default: the creating thread's cores)."""

    def __init__(self, sender: KVSender, kv_caches: Sequence, block_size: int,
                 cpus: set[int] | None = None) -> None:
        self.sender, self.kv_caches, self.block_size, self.cpus = sender, kv_caches, block_size, cpus
        self._jobs: queue.Queue[LayerJob | None] = queue.Queue()
        self._errors: dict[str, Exception] = {}  # request id -> why its send failed, since the last flush
        self._thread = threading.Thread(target=self._run, name="kv-stream", daemon=True)
        self._thread.start()

    def put(self, job: LayerJob) -> None:
        """Queue one layer (from the step's ``layer_done`` hook; returns at once)."""
        self._jobs.put(job)

    def flush(self) -> dict[str, Exception]:
        """Wait until every queued layer is sent; returns {request id: error} of the requests
        whose send failed since the last flush (the caller fails them).

        Raises:
            RuntimeError: the thread is gone with layers still queued (never a silent hang).
        """
        done = self._jobs.all_tasks_done  # (queue.Queue's own condition: join() with a liveness check)
        with done:
            while self._jobs.unfinished_tasks:
                if not self._thread.is_alive():
                    raise RuntimeError("the KV transfer thread is gone with layers still queued")
                done.wait(0.5)
        errors, self._errors = self._errors, {}
        return errors

    def close(self) -> None:
        """Stop the thread once the queued jobs are done. Safe to call twice."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        one_thread()  # a copy needs no team: a second OpenMP pool would slow the forward's (engine/openmp.py)
        if self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)  # 0: this thread only (Linux)
            except OSError as e:  # cores this process may not use: send unpinned, say so
                log.warning("event=transfer_thread_unpinned cpus=%s error=%r", sorted(self.cpus), e)
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if job.engine_id not in self._errors:  # an earlier layer failed: skip the rest
                    self._send(job)
            finally:
                self._jobs.task_done()

    def _send(self, job: LayerJob) -> None:
        try:
            send_job(self.sender, self.kv_caches, self.block_size, job)
            self.sender.progress()  # take acks, renew leases, as the inline path does per layer
        except Exception as e:  # one request's bad transfer: never the thread (it serves all)
            self._errors[job.engine_id] = e
