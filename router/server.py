"""The gRPC front door (``grpc.aio``): validate, place, relay, stream. No model code here.

One request, from ``Generate`` to its last token (the job's states: router.jobs)::

    Generate ─validate (router.requests)─► Job: PLACING
      admission: the token's limits (router.admission: over max_concurrent or tokens_per_minute,
      RESOURCE_EXHAUSTED with retry-after); then placement (router.place over the pure
      router.placement.plan) waits in a bounded queue, in priority and fair share order across
      tokens, while no decode worker can reserve it (full queue, or waited
      router.queue_timeout_s: RESOURCE_EXHAUSTED) ─► decode.reserve(key, the client's
      time left; it answers the first prompt position whose KV it lacks: a prefix its cache holds
      is shared, not sent) ─► prefill.prefill(key, decode address, that reservation, time left): RUNNING
      prefill's first token (a Tokens record, finish "prefilled") ─► streamed at once
      meanwhile the KV and, as its trailer, that first token go prefill → decode directly
      (kvtransfer); decode starts from them and its per-step Tokens records stream in order
      ─► a final finish: the last response, with usage: DONE

Disaggregated mode places on a prefill and a decode worker; colocated mode on one worker that
does both. A lost worker (see router.pools) or a failed KV transfer re-runs the job from its
prompt plus the tokens already streamed (a new attempt; the client sees no token twice), up to
``MAX_ATTEMPTS``; then UNAVAILABLE. A job preempted for a higher priority class (router.preempt:
aborted on its workers) re-runs the same way, not counted as a failure; so does one parked while
its client does not read (router.parking), once it reads. A stream its client stops reading
ends after ``front_door.unread_stream_timeout_s`` (router.unread). Client cancel
and Abort free the job's blocks on both sides (abort on each worker that holds it); the
client's deadline also travels with the calls, so a worker drops the request when it passes
even if no abort arrives. Every call awaited from a worker has the stall deadline
(router.pools, which makes every call to a worker). Every ``router.sweep_s`` the sweep frees
KV blocks held for no live request (router.sweep: the last line, expected never to fire). The
status RPCs' answers: router.status. The controllers (router.autoscale, router.roles) and the
metrics read ``Router.view()``, a frozen snapshot (router.cluster_view). ``Resume``: the rest of
a request the router before ran (ha.enabled), kept decoding for its client (router.resume).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from engine.errors import InvalidRequestError
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.admin import is_admin, scoped_id
from router.admission import Admission, Refused
from router.auth import FrontDoor
from router.autoscale import PoolController, Recent
from router.cluster_view import ClusterView, cluster_view
from router.config import ClusterConfig
from router.grpc_server import answer, start_server  # (start_server: also imported from here)
from router.holdings import Holdings
from router.jobs import Aborted, Job, JobState, Lost, Parked, Preempted
from router.metrics import RouterMetrics
from router.nodes import served_name
from router.parking import Hold, place_when_read
from router.place import Placer
from router.pools import Pools
from router.preempt import Preemptor
from router.prefix_index import PrefixIndex
from router.reject import Reject
from router.resume import Resumable, catch_up
from router.requests import (Limits, has_constraint, prompt_ids, request_id, sampling_params, tool_call_token,
                             with_tool_choice)
from router.roles import RoleController
from router.status import cluster_status, model_info
from router.sweep import Sweeper
from router.worker_state import Role, Worker
from worker.protocol import Failed, Record

log = logging.getLogger("pdserve.router")

MAX_ATTEMPTS = 3


class Router(pb_grpc.GenerationServicer):
    """The Generation service over the worker pools.

    Args:
        cfg: cluster config.
        model_path: the model folder (already resolved; every worker loads it).
    """

    resumable = Resumable({}, 0.0, lambda job: None)  # (one that keeps nothing: __init__ makes the real one)

    def __init__(self, cfg: ClusterConfig, model_path: str, door: FrontDoor | None = None) -> None:
        from transformers import AutoTokenizer  # (heavy: loaded only by a serving router)
        self.cfg = cfg
        self.door = door or FrontDoor()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # a token's own text, as logprobs in the OpenAI API name it (bounded: the vocabulary)
        self.token_text = functools.lru_cache(maxsize=None)(lambda t: self.tokenizer.decode([t]))
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._tool_token = tool_call_token(self.tokenizer)  # (read once, before the tokenizing thread owns it)
        self.pools = Pools(cfg, model_path, self._on_records, self._on_lost)
        self.jobs: dict[str, Job] = {}
        # (what an adopted worker decodes for the router before, waiting for its client)
        self.resumable = Resumable(self.jobs, cfg.ha.resume_s, self._release)
        self.pools.handover = self.resumable.handover
        self.admission = Admission(self.door.policy)  # per-token limits, fair order (router.admission)
        self.limits: Limits | None = None
        self.colocated = cfg.mode == "colocated"
        self.metrics = RouterMetrics(self.view, self.admission.stats)
        preemptor = Preemptor(self.pools, self.admission, cfg.router.max_preemptions, lambda: self.jobs.values())
        # What each prefilling worker likely holds in its prefix cache (None: prefix-blind)
        self.placer = Placer(cfg, self.pools, self.admission, Holdings(), self.metrics,
                             PrefixIndex() if cfg.router.prefix_aware else None, adaptive=cfg.mode == "adaptive",
                             preemptor=preemptor)
        self.sweeper = Sweeper(self.pools, lambda: {j.key.engine_id for j in self.jobs.values()},
                               self.metrics.swept_blocks)
        self.recent = Recent(cfg.autoscale.window_s)  # latencies the pool signals read
        self.autoscaler = PoolController(cfg.autoscale, self.pools, self.view, self.holds, self.colocated) \
            if cfg.autoscale.enabled else None
        # Adaptive: disaggregated placement over workers whose roles switch (router.roles)
        self.roles_controller = RoleController(cfg.roles, cfg.autoscale, self.pools, self.view, self.holds,
                                               self.metrics.role_switches) if cfg.mode == "adaptive" else None
        self.roles = (Role.COLOCATED,) if self.colocated else (Role.PREFILL, Role.DECODE)
        self.served_model_name = cfg.router.served_model_name or served_name(cfg.model, model_path)
        self.http: Any = None  # the OpenAI API's server (router.openai_http), if serving
        self.http_port: int | None = None

    # Placement reads the config and the prefix index as they are now (tests replace either)
    @property
    def cfg(self) -> ClusterConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: ClusterConfig) -> None:
        self._cfg = cfg
        if (placer := self.__dict__.get("placer")) is not None:
            placer.cfg = cfg

    @property
    def prefix(self) -> PrefixIndex | None:
        return self.placer.prefix

    @prefix.setter
    def prefix(self, index: PrefixIndex | None) -> None:
        self.placer.prefix = index

    @property
    def queued(self) -> int:
        """Jobs waiting for a decode worker (router.place)."""
        return self.placer.queued

    async def start(self, progress=lambda s: None) -> None:
        if self.cfg.metrics.port is not None:
            progress(f"metrics on http://{self.metrics.serve(self.cfg.metrics.host, self.cfg.metrics.port)}/metrics")
        await self.pools.start(progress)
        if self.autoscaler is not None:
            self._autoscale_task = asyncio.create_task(self.autoscaler.run(), name="autoscale")
        if self.roles_controller is not None:
            self._roles_task = asyncio.create_task(self.roles_controller.run(), name="roles")
        self._sweep_task = asyncio.create_task(self.sweeper.run(self.cfg.router.sweep_s), name="sweep")
        self.limits = Limits(context_length=min(w.info.context_length for w in self.pools.workers.values()),
                             vocab_size=self.pools.model_info.vocab_size,
                             default_max_tokens=self.cfg.router.default_max_tokens, input=self.cfg.limits)

    async def stop(self) -> None:
        if self.autoscaler is not None:
            self._autoscale_task.cancel()
        if self.roles_controller is not None:
            self._roles_task.cancel()
        self._sweep_task.cancel()
        self.resumable.stop()
        for job in list(self.jobs.values()):
            job.put(None, Aborted())
        await self.pools.stop()
        self.metrics.stop()
        self._tokenizing.shutdown(wait=False)

    # ---- worker events -----------------------------------------------------------------------
    def _on_records(self, worker: Worker, records: list[Record]) -> None:
        for r in records:
            job = self.jobs.get(r.key.request_id)
            if job is not None and job.attempt == r.key.attempt:  # else late, of an earlier attempt
                job.put(worker, r)

    def _on_lost(self, worker: Worker) -> None:
        if self.prefix is not None:  # a restart empties its cache; a lost one is gone
            self.prefix.forget(worker.worker_id)
        for job in self.jobs.values():
            if worker is job.prefill or worker is job.decode:
                job.put(worker, Lost())

    # ---- Generate ----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        owner = await self._caller(context)
        hold = self.stream_hold()
        responses = self.generate(request, owner, context.time_remaining(), hold=hold)
        async for response in answer(context, request.request_id, responses, self.cfg.front_door, hold):
            yield response

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext):
        owner = await self._caller(context)
        hold = self.stream_hold()
        async for response in answer(context, request.request_id, self.resume(request, owner, hold),
                                     self.cfg.front_door, hold):
            yield response

    def stream_hold(self) -> Hold:  # parks one stream's requests while its client does not read (router.parking)
        return Hold(self.pools.abort, self.metrics.parked, self.placer.live)

    def generate(self, request: pb.GenerateRequest, owner: str, time_left: float | None,
                 prefer: tuple[str, str] | None = None, hold: Hold | None = None):
        """One request's responses (an async generator), whichever API it came by (gRPC, or the
        OpenAI API: router.openai_http): the same validation, admission, placement and limits.
        Closing it early (the client went away) frees the request on every worker. ``prefer``:
        (prefill, decode) worker ids to place it on if they can (another choice of the same
        prompt runs there: its prefix is cached there). ``hold``: its stream's (router.parking).
        A retry of a request the router before ran gets its answer (router.resume).

        Raises:
            Reject: with the status for the client (INVALID_ARGUMENT, ALREADY_EXISTS,
                RESOURCE_EXHAUSTED, UNAVAILABLE).
        """
        return self._serve(lambda: self._open(request, owner, time_left, prefer), hold or self.stream_hold())

    async def _open(self, request: pb.GenerateRequest, owner: str, time_left: float | None,
                    prefer: tuple[str, str] | None) -> tuple[Job, str, int | None]:
        """``generate``'s request as a live job: (job, the client's id, tokens the client has of it)."""
        try:
            rid = request_id(request, self.limits)
        except InvalidRequestError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        jid = scoped_id(owner, rid)  # ids are the caller's own (router.admin): no oracle across tokens
        if jid in self.jobs and self.resumable.find(jid) is None:
            raise Reject(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        try:
            # Tokenizing a long prompt takes a while: in its own thread, off the event loop that
            # streams every other request (one thread: the tokenizer is not shared across threads).
            ids = await asyncio.get_running_loop().run_in_executor(
                self._tokenizing, prompt_ids, request, self.tokenizer, self.limits)
            # Compiling a constraint (a schema, a grammar, forced tool calls) can take a while: in a
            # thread of its own, so it stalls neither the streams on this loop nor tokenizing.
            def build():
                return with_tool_choice(request, sampling_params(request.sampling, self.limits, len(ids)),
                                        self._tool_token)
            params = await asyncio.to_thread(build) if has_constraint(request) else build()
        except InvalidRequestError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        # The same id again while this one was tokenized, unless a retry of a request resumable here
        rebuilt = self.resumable.find(jid)
        if (jid in self.jobs and rebuilt is None) or \
                (rebuilt is not None and (rebuilt.prompt_ids, rebuilt.params.max_tokens) != (ids, params.max_tokens)):
            raise Reject(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        lease = self.admission.admit(owner, len(ids))  # the token's limits (router.policy)
        if isinstance(lease, Refused):
            raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, lease.message, lease.retry_after_s)
        if rebuilt is not None:  # its whole answer, from the first token (router.resume)
            job = self.resumable.claim(jid, owner, lease)
        else:
            job = Job(jid, ids, params, owner=owner, lease=lease, prefer=prefer,
                      deadline=None if time_left is None else time.monotonic() + time_left)
            self.jobs[jid] = job
            self.metrics.prompt_tokens.inc(len(ids))
        return job, rid, None if rebuilt is None else 0

    def resume(self, request: pb.ResumeRequest, owner: str, hold: Hold | None = None):
        """The rest of a request the router before ran, which this one decodes still (router.resume):
        what the client lacks after ``received_tokens``, then the live tokens. Raises Reject:
        NOT_FOUND (none waits here, or it is another token's), OUT_OF_RANGE, RESOURCE_EXHAUSTED."""
        return self._serve(lambda: self._reopen(request, owner), hold or self.stream_hold())

    async def _reopen(self, request: pb.ResumeRequest, owner: str) -> tuple[Job, str, int]:
        try:  # (the id's limits, as Generate's: it is echoed and logged)
            rid = request_id(request, self.limits)
        except InvalidRequestError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        job = self.resumable.find(scoped_id(owner, rid))
        if job is None:  # (another token's is as absent as one never seen: no oracle across tokens)
            raise Reject(grpc.StatusCode.NOT_FOUND, f"no request {rid!r} waits to be resumed here: send it again")
        if request.received_tokens > len(job.generated):
            raise Reject(grpc.StatusCode.OUT_OF_RANGE, f"request {rid!r} has {len(job.generated)} tokens so far, "
                                                       f"not the {request.received_tokens} received")
        lease = self.admission.admit(owner, len(job.prompt_ids))
        if isinstance(lease, Refused):
            raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, lease.message, lease.retry_after_s)
        self.resumable.claim(job.request_id, owner, lease)
        return job, rid, request.received_tokens

    async def _serve(self, opening: Callable[[], Awaitable[tuple[Job, str, int | None]]], hold: Hold):
        """Run the job ``opening`` makes live (in ``self.jobs``) to its end and account for it.
        It returns the job, the client's id and, for a rebuilt job a client attaches to
        (router.resume), how many of its tokens the client has (else None)."""
        job, rid, received = await opening()
        outcome, charged = "cancelled", len(job.generated)
        hold.add(job)
        try:
            if received is not None and (first := catch_up(job, self.tokenizer, received, rid)) is not None:
                yield first
            async for response in self._run(job):
                self.admission.charge(job.lease, len(job.generated) - charged)  # (tokens per minute)
                charged = len(job.generated)
                if response.finish_reason:
                    outcome = {1: "stop", 2: "length", 3: "abort"}[response.finish_reason]
                response.request_id = rid  # (the client's id, not the scoped one)
                yield response
        except Reject as e:
            outcome = e.code.name.lower()
            raise
        finally:
            hold.remove(job)
            self.jobs.pop(job.request_id, None)
            self.placer.live.drop(job)  # (what it held counts no more: router.holdings)
            self.admission.release(job.lease)
            if not job.finished:  # cancelled by the client, aborted or failed: free both sides
                self._release(job)
            self._observe(job, outcome)

    def view(self) -> ClusterView:
        """The cluster now, for the controllers and the metrics (router.cluster_view)."""
        return cluster_view(self.pools.workers.values(), self.jobs.values(), self.recent, self.queued,
                            self.pools.bad_reports)

    async def detokenize(self, ids: list[int]) -> str:
        """Token ids as text, on the tokenizer's own thread (not the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, self.tokenizer.decode, ids)

    def holds(self, worker: Worker) -> bool:
        """Whether some request of ours runs on ``worker`` (it may not retire yet)."""
        return any(worker is j.prefill or worker is j.decode for j in self.jobs.values())

    def _first_token(self, job: Job, record: Any) -> None:
        """This attempt's first token is out. Its TTFT goes to the pool signals now, not when the
        answer ends, once per request (a re-run's is none); placement learns what it found cached."""
        if job.base == 0 and not job.parks:  # (a parked one's wait was its client's: router.parking)
            self.recent.add(time.monotonic(), job.queue_free_ttft, None, len(job.prompt_ids))
        self.placer.prefilled(job, record.cached_tokens)

    def _observe(self, job: Job, outcome: str) -> None:
        self.recent.add(time.monotonic(), None, None if job.parks else job.tpot)  # (TTFT: at its first token)
        self.metrics.observe(job, outcome)

    async def _run(self, job: Job):
        """Drive the job: PLACING → RUNNING → DONE, or back to PLACING for a re-run."""
        while True:
            if job.ended or len(job.generated) >= job.params.max_tokens:  # ended on its worker before its
                yield job.final(job.ended or "length")  # handover (router.resume), or lost after its last token
                return
            if job.aborted or job.stopped:  # aborted as its attempt ended (behind a preemption): not placed again
                self._release(job)  # (stopped: a rebuilt job's stop string, router.resume ``catch_up``)
                yield job.final("stop" if job.stopped else "abort")
                return
            if job.state is not JobState.RUNNING:  # (a rebuilt job runs already: router.resume)
                await place_when_read(job, self.placer.place)  # (router.parking)
            async for response in self._stream(job):
                yield response
            if job.finished:
                return

    async def _stream(self, job: Job):
        """RUNNING: this attempt's responses, until the job is DONE or must re-run."""
        while True:
            attempt, worker, event = await job.events.get()
            # Abort and shutdown end the job whichever attempt they were queued in (one queued
            # before a preemption's re-run would otherwise be skipped as stale and lost)
            if attempt != job.attempt and not isinstance(event, Aborted):
                continue
            if isinstance(event, Aborted):
                self._release(job)
                yield job.final("abort")
                return
            if isinstance(event, (Preempted, Parked)):  # (its blocks were freed then: router.preempt, parking)
                self._rerun(job, "preempted or parked", failure=False)
                return
            if isinstance(event, (Lost, Failed)) and not job.depends_on(worker):
                # Queued while the worker still mattered (or a prefill's late transfer error after
                # decode took over): re-running a healthy stream would only cost it time.
                log.info("rid=%s event=ignored reason=%r worker=%s", job.request_id,
                         "lost" if isinstance(event, Lost) else event.error, worker.worker_id)
                continue
            if isinstance(event, Failed) and event.invalid:  # bad input: retrying cannot help
                self._release(job)
                raise Reject(grpc.StatusCode.INVALID_ARGUMENT, event.error)
            if isinstance(event, (Lost, Failed)):
                self._rerun(job, "a worker was lost" if isinstance(event, Lost) else event.error)
                return
            job.heard_from(worker)
            for r in job.in_order(event):
                prefilling = job.prefilling
                response = job.tokens(r)
                if prefilling and not job.prefilling:
                    self._first_token(job, r)
                if response is not None:
                    yield response
                if job.stopped:  # a stop string across a re-run's boundary: the worker can't see it
                    self._release(job)
                    yield job.final("stop")
                    return
                if r.finish not in (None, "prefilled"):  # from either worker: the first token may end it
                    yield job.final(r.finish)
                    return

    def _rerun(self, job: Job, why: str, failure: bool = True) -> None:
        """Free the attempt's blocks, back to PLACING; only failures count toward MAX_ATTEMPTS (job.failures)."""
        self._release(job)
        job.rerun(self.tokenizer)
        if not failure:
            return
        if job.failures >= MAX_ATTEMPTS:
            raise Reject(grpc.StatusCode.UNAVAILABLE, f"request failed {MAX_ATTEMPTS} times; last: {why}")
        log.warning("rid=%s event=rerun attempt=%d reason=%r", job.request_id, job.attempt, why)
        self.metrics.retries.inc()

    def _release(self, job: Job) -> None:
        """Abort the job's current attempt wherever it may hold blocks (idempotent there)."""
        job.release(self.pools.abort)

    # ---- the other RPCs ----------------------------------------------------------------------
    async def _caller(self, context) -> str:
        """The calling token's name ("" with auth off). The interceptor already turned away
        calls without a valid token; this is the second lock on the door of a request."""
        owner = self.door.auth.caller(context.invocation_metadata())
        if owner is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid token")
        return owner

    def job(self, owner: str, request_id: str) -> Job | None:
        """``owner``'s running request ``request_id`` (the client's id), or None."""
        return self.jobs.get(scoped_id(owner, request_id))

    async def _admin(self, context) -> None:
        """Only an admin token goes on (router.admin): PERMISSION_DENIED for any other."""
        if not is_admin(self.door.auth, await self._caller(context)):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this call needs an admin token")

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        owner = await self._caller(context)
        job = self.job(owner, request.request_id)
        if job is None or job.owner != owner:  # another's: as if absent
            return pb.AbortResponse(found=False)
        job.put(None, Aborted())
        return pb.AbortResponse(found=True)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return model_info(self.pools, self.served_model_name, self.limits.context_length)

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        await self._admin(context)  # worker addresses, and check_blocks calls every worker
        stranded = await self.sweeper.stranded_blocks() if request.check_blocks else None
        events = self.autoscaler.events if self.autoscaler else \
            self.roles_controller.events if self.roles_controller else []
        return cluster_status(self.cfg.mode, self.pools.workers.values(), stranded, self.metrics.address or "",
                              self.queued, len(self.jobs), events)
