"""Requests that outlive their router: rebuilt from an adopted worker, kept for their client.

A router that adopts a worker (router.ha) decoding requests of the router before gets each as
a ``worker.fence.Handover``: the attempt's prompt, its output tokens so far, its sampling
params (seed, stops, max_tokens), its key. It rebuilds each as a job RUNNING on that worker
(``rebuild``): the worker goes on decoding it, its records queue in the job's events as any
job's do, and the job waits for its client::

    WAITING ──Resume(id, tokens received)──► attached: the tokens the client lacks (``catch_up``),
        │                                    then the live ones (router.server ``resume``)
        │── Generate or an OpenAI request with the same id (Idempotency-Key) and prompt ──►
        │                                    attached from token 0: the same answer, replayed then live
        └── ha.resume_s without either ──► aborted on its worker (its blocks freed), forgotten

A request that ended on its worker lately (``Handover.finish``: its last record may have gone to
the dead router, worker.fence ``Ended``) is rebuilt the same way: its client gets the rest of
its tokens and the end at once, nothing runs. A request whose only state was in the dead router
(queued, mid-prefill, its KV in transit) or
that asked for logprobs (the worker keeps none to replay) is not handed over: the new router
releases it at adoption, and the client's Resume finds nothing (NOT_FOUND) and sends its
request again (router.client ``stream``).

Only the token that sent a request finds it: the id it runs under is the router's scoped id
(router.admin.scoped_id: the client's id with the token's tag), so another token's lookup of
the same id finds nothing, as for an id never seen. The records a worker sends between its
adoption and the router's learning its incarnation are kept and taken after the rebuild
(router.ha ``adopt``), so no token is missing between the handover and the first record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.detokenizer import TextStream
from pdserve.v1 import pdserve_pb2 as pb
from router.jobs import Job, JobState
from worker.fence import Adopted, Handover

log = logging.getLogger("pdserve.router")


def rebuild(h: Handover, worker: Any) -> Job:
    """The job of a handed-over request, RUNNING on ``worker`` as its attempt ``h.key.attempt``.
    After a re-run the attempt's prompt ends with ``params.resumed`` tokens the client already
    had: they go back to being output, so the job's prompt, ``max_tokens`` and output are
    the request's own (a later re-run, router.jobs ``inputs``, counts from them)."""
    k = h.params.resumed
    cut = len(h.prompt_ids) - k
    params = dataclasses.replace(h.params, max_tokens=h.params.max_tokens + k, resumed=0)
    return Job(h.key.request_id, h.prompt_ids[:cut], params, attempt=h.key.attempt, first_attempt=h.key.attempt,
               base=k, generated=h.prompt_ids[cut:] + h.output_ids, state=JobState.RUNNING, decode=worker,
               decode_id=worker.worker_id, placement="resumed", ended=h.finish)


def catch_up(job: Job, tokenizer: Any, received: int, rid: str) -> pb.GenerateResponse | None:
    """The response a client that has ``received`` of the job's tokens lacks (``rid``: its id of
    the job): the tokens after them and their text (None: nothing yet). The text a stream sent
    with those tokens is what the engine's TextStream makes of them (held-back tails included);
    from now on the job makes its text the same way (router.jobs ``stream``), so no character
    is sent twice."""
    job.stream = TextStream(tokenizer, job.params.stop)
    job.stream.step(job.generated[:received])
    job.stream.mark_sent()
    job.stopped = job.stream.step(job.generated)  # (a stop string across an earlier re-run's boundary)
    ids, text = job.generated[received:], job.stream.delta(job.stopped)
    job.text = job.stream.text[:job.stream.emitted]
    job.first_token_time = job.last_token_time = time.monotonic()
    return pb.GenerateResponse(request_id=rid, token_ids=ids, text=text) if ids or text else None


class Resumable:
    """The rebuilt jobs that wait for their clients (module docstring).

    Args:
        jobs: the router's jobs by id (a rebuilt job joins them: its records reach it).
        resume_s: ``ha.resume_s``; 0: nothing is kept.
        release: frees a job's attempt on its workers (router.server ``_release``).
    """

    def __init__(self, jobs: dict[str, Job], resume_s: float, release: Callable[[Job], None]) -> None:
        self.jobs, self.resume_s, self.release = jobs, resume_s, release
        self._waiting: dict[str, asyncio.TimerHandle] = {}
        # rebuilt after they ended on their worker: outside ``jobs`` (no record comes, no block
        # to free, and most were delivered whole: they count as no live request) until claimed
        self._ended: dict[str, Job] = {}
        self.rebuilt = self.ended = self.attached = self.expired = 0  # counts (tests, logs)

    def handover(self, worker: Any, adopted: Adopted) -> set[str]:
        """Rebuild what ``adopted`` hands over (a request this router already runs under the same
        id is not); returns the engine ids kept, which the caller must not release."""
        if self.resume_s <= 0:
            return set()
        loop, kept = asyncio.get_running_loop(), set()
        for h in adopted.handover:
            jid = h.key.request_id
            if jid in self.jobs or jid in self._ended:  # (live ones come first: an ended twin is older)
                continue
            try:
                (self._ended if h.finish else self.jobs)[jid] = rebuild(h, worker)
            except Exception:  # (a bug: that request is aborted, the worker and the rest go on)
                log.exception("rid=%s event=resume_failed: could not rebuild it; aborted", jid)
                continue
            self._waiting[jid] = loop.call_later(self.resume_s, self._expire, jid)
            if h.finish:
                self.ended += 1
            else:
                kept.add(h.key.engine_id)
            self.rebuilt += 1
        if kept:
            log.warning("worker %s handed over %d decoding requests of the router before: kept %.0fs for their "
                        "clients to resume", worker.worker_id, len(kept), self.resume_s)
        return kept

    def find(self, jid: str) -> Job | None:
        """The rebuilt job ``jid`` (a scoped id) if it waits for its client, else None."""
        return (self.jobs.get(jid) or self._ended.get(jid)) if jid in self._waiting else None

    def claim(self, jid: str, owner: str, lease: Any) -> Job:
        """A client attaches to the waiting job ``jid`` (``find`` first): it is no longer aborted
        after resume_s. ``owner``: the caller's token name (its scoped id named the same token);
        ``lease``: its admission (router.admission)."""
        self._waiting.pop(jid).cancel()
        job = self.jobs[jid] = self._ended.pop(jid, None) or self.jobs[jid]
        job.owner, job.lease = owner, lease
        self.attached += 1
        return job

    def _expire(self, jid: str) -> None:
        """No client came for ``jid`` within resume_s: abort it on its worker (freed at once)."""
        self._waiting.pop(jid, None)
        self._ended.pop(jid, None)  # (nothing to free: it ended on its worker)
        job = self.jobs.pop(jid, None)
        if job is not None:
            self.release(job)
            self.expired += 1
            log.warning("rid=%s event=resume_expired tokens=%d: no client resumed it in %.0fs (ha.resume_s); "
                        "aborted", jid, len(job.generated), self.resume_s)

    def stop(self) -> None:
        """The router stops: no timer is left behind (the jobs are aborted with the others)."""
        for handle in self._waiting.values():
            handle.cancel()
        self._waiting.clear()
        self._ended.clear()
