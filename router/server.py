"""The gRPC front door (``grpc.aio``): validate, place, relay, stream. No model code here.

One request, from ``Generate`` to its last token (the job's states: router.jobs)::

    Generate ─validate (router.requests)─► Job: PLACING
      admission: the token's limits (router.admission: over max_concurrent or tokens_per_minute,
      RESOURCE_EXHAUSTED with retry-after); then waits in a bounded queue, in priority and fair
      share order across tokens, while no decode worker can reserve it (full queue, or
      waited router.queue_timeout_s: RESOURCE_EXHAUSTED) ─► decode.reserve(key, the client's
      time left; it answers the first prompt position whose KV it lacks: a prefix its cache holds
      is shared, not sent) ─► prefill.prefill(key, decode address, that reservation, time left): RUNNING
      prefill's first token (a Tokens record, finish "prefilled") ─► streamed at once
      meanwhile the KV and, as its trailer, that first token go prefill → decode directly
      (kvtransfer); decode starts from them and its per-step Tokens records stream in order
      ─► a final finish: the last response, with usage: DONE

Disaggregated mode places on a prefill and a decode worker; colocated mode on one worker that
does both. A lost worker (see router.pools) or a failed KV transfer re-runs the job from its
prompt plus the tokens already streamed (a new attempt; the client sees no token twice), up to
``MAX_ATTEMPTS``; then UNAVAILABLE. Client cancel and Abort free the job's blocks on both
sides (abort on each worker that holds it); the client's deadline also travels with the calls,
so a worker drops the request when it passes even if no abort arrives. Every call awaited from
a worker has the stall deadline (router.pools). Every ``router.sweep_s`` the sweep frees KV
blocks held for no live request (``Router.sweep``: the last line, expected never to fire).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any

import grpc
import msgspec

from engine.errors import InvalidRequestError
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.admin import is_admin, scoped_id
from router.admission import Admission, Refused
from router.auth import FrontDoor
from router.autoscale import PoolController, Recent
from router.roles import RoleController
from router.config import ClusterConfig
from router.drain import RETRY_AFTER_S
from router.jobs import Aborted, Job, JobState, Lost
from router.placement import PrefixView, admission_tokens, pick_decode, pick_prefill, prefill_where
from router.prefix_index import PrefixIndex, block_hashes, expect_prefix, prefix_view
from router.pools import Pools, Worker
from router.requests import Limits, prompt_ids, request_id, sampling_params
from worker.protocol import Failed, Record, memory_now

log = logging.getLogger("pdserve.router")

MAX_ATTEMPTS = 3
RETRY_WAIT_S = 0.1  # admission re-checks at least this often, besides every load change


class Reject(Exception):
    """End a Generate call with this gRPC status (and a retry hint, seconds: RESOURCE_EXHAUSTED
    has one by default; gRPC's ``retry-after`` trailing metadata, HTTP's ``Retry-After``)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s if retry_after_s is not None else \
            RETRY_AFTER_S if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None


class Router(pb_grpc.GenerationServicer):
    """The Generation service over the worker pools.

    Args:
        cfg: cluster config.
        model_path: the model folder (already resolved; every worker loads it).
    """

    def __init__(self, cfg: ClusterConfig, model_path: str, door: FrontDoor | None = None) -> None:
        from transformers import AutoTokenizer
        self.cfg = cfg
        self.door = door or FrontDoor()
        from concurrent.futures import ThreadPoolExecutor
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # a token's own text, as logprobs in the OpenAI API name it (bounded: the vocabulary)
        self.token_text = functools.lru_cache(maxsize=None)(lambda t: self.tokenizer.decode([t]))
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.pools = Pools(cfg, model_path, self._on_records, self._on_lost)
        self.jobs: dict[str, Job] = {}
        self.queued = 0  # jobs waiting for a decode worker
        self.admission = Admission(self.door.policy)  # per-token limits, fair order (router.admission)
        self._turn_changed = asyncio.Event()  # replaced when a waiting job leaves the order or tries
        self._stranded_before: dict[str, set[str]] = {}  # the last sweep's finds (worker → engine ids)
        self.limits: Limits | None = None
        self.colocated = cfg.mode == "colocated"
        # What each prefilling worker likely holds in its prefix cache (None: prefix-blind)
        self.prefix = PrefixIndex() if cfg.router.prefix_aware else None
        from router.metrics import RouterMetrics
        self.metrics = RouterMetrics(self)
        self.recent = Recent(cfg.autoscale.window_s)  # latencies the pool signals read
        self.autoscaler = PoolController(self, cfg.autoscale) if cfg.autoscale.enabled else None
        # Adaptive: disaggregated placement over workers whose roles switch (router.roles)
        self.roles_controller = RoleController(self, cfg.roles, cfg.autoscale) if cfg.mode == "adaptive" else None
        self.roles = ("colocated",) if self.colocated else ("prefill", "decode")
        from router.nodes import served_name
        self.served_model_name = cfg.router.served_model_name or served_name(cfg.model, model_path)
        self.http: Any = None  # the OpenAI API's server (router.openai_http), if serving
        self.http_port: int | None = None

    async def start(self, progress=lambda s: None) -> None:
        if self.cfg.metrics.port is not None:
            progress(f"metrics on http://{self.metrics.serve(self.cfg.metrics.host, self.cfg.metrics.port)}/metrics")
        await self.pools.start(progress)
        if self.autoscaler is not None:
            self._autoscale_task = asyncio.create_task(self.autoscaler.run(), name="autoscale")
        if self.roles_controller is not None:
            self._roles_task = asyncio.create_task(self.roles_controller.run(), name="roles")
        self._sweep_task = asyncio.create_task(self._sweep(), name="sweep")
        self.limits = Limits(context_length=min(w.info.context_length for w in self.pools.workers.values()),
                             vocab_size=self.pools.model_info.vocab_size,
                             default_max_tokens=self.cfg.router.default_max_tokens, input=self.cfg.limits)

    async def stop(self) -> None:
        if self.autoscaler is not None:
            self._autoscale_task.cancel()
        if self.roles_controller is not None:
            self._roles_task.cancel()
        self._sweep_task.cancel()
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
        try:
            async for response in self.generate(request, owner, context.time_remaining()):
                yield response
        except Reject as e:
            if e.retry_after_s is None:
                await context.abort(e.code, str(e))
            await context.abort(e.code, str(e), trailing_metadata=(("retry-after", retry_after(e.retry_after_s)),))
        except Exception as e:  # a bug: INTERNAL naming it (not gRPC's bare UNKNOWN), the trace in the log
            log.exception("rid=%s event=internal_error", request.request_id or "-")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the router ({type(e).__name__}: {e}); "
                                                          "see its log")

    async def generate(self, request: pb.GenerateRequest, owner: str, time_left: float | None,
                       prefer: tuple[str, str] | None = None):
        """One request's responses, whichever API it came by (gRPC's Generate, the OpenAI HTTP
        API in router.openai_http): the same validation, admission, placement and limits.
        Closing the generator early (the client went away) frees the request on every worker.
        ``prefer``: (prefill, decode) worker ids to place it on if they can take it (another
        choice of the same prompt runs there: its blocks are in their prefix caches).

        Raises:
            Reject: with the status for the client (INVALID_ARGUMENT, ALREADY_EXISTS,
                RESOURCE_EXHAUSTED, UNAVAILABLE).
        """
        try:
            rid = request_id(request, self.limits)
        except InvalidRequestError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        jid = scoped_id(owner, rid)  # ids are the caller's own (router.admin): no oracle across tokens
        if jid in self.jobs:
            raise Reject(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        try:
            # Tokenizing a long prompt takes a while: in its own thread, off the event loop that
            # streams every other request (one thread: the tokenizer is not shared across threads).
            ids = await asyncio.get_running_loop().run_in_executor(
                self._tokenizing, prompt_ids, request, self.tokenizer, self.limits)
            params = sampling_params(request.sampling, self.limits, len(ids))
        except InvalidRequestError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if jid in self.jobs:  # the same id again while this one was tokenized
            raise Reject(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        lease = self.admission.admit(owner, len(ids))  # the token's limits (router.policy)
        if isinstance(lease, Refused):
            raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, lease.message, lease.retry_after_s)
        job = Job(jid, ids, params, owner=owner, deadline=None if time_left is None else time.monotonic() + time_left,
                  prefer=prefer, lease=lease)
        self.jobs[jid] = job
        self.metrics.prompt_tokens.inc(len(ids))
        outcome, charged = "cancelled", 0
        try:
            async for response in self._run(job):
                self.admission.charge(lease, len(job.generated) - charged)  # (tokens per minute)
                charged = len(job.generated)
                if response.finish_reason:
                    outcome = {1: "stop", 2: "length", 3: "abort"}[response.finish_reason]
                response.request_id = rid  # (the client's id, not the scoped one)
                yield response
        except Reject as e:
            outcome = e.code.name.lower()
            raise
        finally:
            self.jobs.pop(jid, None)
            self.admission.release(lease)
            if not job.finished:  # cancelled by the client, aborted or failed: free both sides
                self._release(job)
            self._observe(job, outcome)

    def holds(self, worker: Worker) -> bool:
        """Whether some request of ours runs on ``worker`` (it may not retire yet)."""
        return any(worker is j.prefill or worker is j.decode for j in self.jobs.values())

    def _observe(self, job: Job, outcome: str) -> None:
        self.recent.add(time.monotonic(), job.ttft, job.tpot)
        m = self.metrics
        m.requests.labels(outcome).inc()
        m.generation_tokens.inc(len(job.generated))
        m.e2e.observe(time.monotonic() - job.arrival)
        if job.ttft is not None:
            m.ttft.observe(job.ttft)
        if job.tpot is not None:
            m.tpot.observe(job.tpot)
        for gap in job.gaps:
            m.itl.observe(gap)
        log.info("rid=%s event=finished outcome=%s prompt_tokens=%d tokens=%d ttft_s=%s tpot_s=%s prefill=%s "
                 "decode=%s attempts=%d", job.request_id, outcome, len(job.prompt_ids), len(job.generated),
                 f"{job.ttft:.3f}" if job.ttft is not None else "-", f"{job.tpot:.4f}" if job.tpot else "-",
                 job.prefill_id or "-", job.decode_id or "-", job.attempt + 1)

    async def _run(self, job: Job):
        """Drive the job: PLACING → RUNNING → DONE, or back to PLACING for a re-run."""
        while True:
            if len(job.generated) >= job.params.max_tokens:  # lost right after its last token
                yield job.final("length")
                return
            await self._place(job)
            async for response in self._stream(job):
                yield response
            if job.finished:
                return

    async def _stream(self, job: Job):
        """RUNNING: this attempt's responses, until the job is DONE or must re-run."""
        while True:
            attempt, worker, event = await job.events.get()
            if attempt != job.attempt:
                continue
            if isinstance(event, Aborted):
                self._release(job)
                yield job.final("abort")
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
                response = job.tokens(r)
                if response is not None:
                    yield response
                if job.stopped:  # a stop string across a re-run's boundary: the worker can't see it
                    self._release(job)
                    yield job.final("stop")
                    return
                if r.finish not in (None, "prefilled"):  # from either worker: the first token may end it
                    yield job.final(r.finish)
                    return

    def _rerun(self, job: Job, why: str) -> None:
        """Free the attempt's blocks and go back to PLACING (or fail after MAX_ATTEMPTS)."""
        self._release(job)
        job.rerun(self.tokenizer)
        if job.attempt >= MAX_ATTEMPTS:
            raise Reject(grpc.StatusCode.UNAVAILABLE, f"request failed {MAX_ATTEMPTS} times; last: {why}")
        log.warning("rid=%s event=rerun attempt=%d reason=%r", job.request_id, job.attempt, why)
        self.metrics.retries.inc()

    def _release(self, job: Job) -> None:
        """Abort the job's current attempt wherever it may hold blocks (idempotent there)."""
        for w in {id(w): w for w in (job.prefill, job.decode) if w is not None}.values():
            if w.state in ("ready", "draining"):
                w.actor.abort.remote(job.key)
        job.prefill = job.decode = None

    async def _place(self, job: Job) -> None:
        """Reserve on a decode worker and submit to a prefill worker (or one colocated worker).

        Raises:
            Reject: RESOURCE_EXHAUSTED (admission queue full, or no capacity for
                ``router.queue_timeout_s``), UNAVAILABLE (no worker left).
        """
        from ray.exceptions import RayActorError, RayTaskError
        ids, params = job.inputs()
        roles = ("colocated",) if self.colocated else ("decode",)
        frac = self.cfg.decode.reserve_fraction
        queued, since = False, time.monotonic()
        # The prompt's full blocks in the prefilling pool's block size (prefix-aware placement)
        # (an adaptive worker runs the decode pool's engine in both roles)
        bs = (self.cfg.decode if self.colocated or self.roles_controller else self.cfg.prefill).block_size
        hashes = block_hashes(ids, bs) if self.prefix is not None else []
        # Disaggregated: what the decode workers cache, too (their prefix is shared, not sent
        # again), when both pools name blocks alike (the same block size: the default)
        decode_view = not self.colocated and self.prefix is not None and self.cfg.decode.block_size == bs
        missed = False  # a decode worker did not hold the prefix the index said: the pool prefills it
        entry = self.admission.enqueue(job.lease, len(ids) + params.max_tokens)
        try:
            while True:
                # (adaptive: with no prefill worker, decode workers prefill their own prompts; with
                # no decode worker, one of the others will switch to decode)
                if self.roles_controller is not None:
                    alive = self.pools.any_alive("prefill", "decode")
                else:
                    alive = self.pools.any_alive(*roles) and (self.colocated or self.pools.any_alive("prefill"))
                if not alive:
                    raise Reject(grpc.StatusCode.UNAVAILABLE, "no worker is left to serve the request")
                prefer = job.prefer or ("", "")
                # (a decode worker receives a prompt's whole KV: only a colocated one shares it)
                loads, view = self.pools.loads(*roles), None
                if self.colocated:
                    loads, view = self._prefix_view(loads, hashes, len(ids), bs)
                elif decode_view:  # (the reported queues stay: prefill_where reads them)
                    view = self._prefix_view(loads, hashes, len(ids), bs)[1]
                # Fair share and priority (router.admission): while another waiting job goes
                # first, this one waits as if no decode worker had room
                d = pick_decode(loads, len(ids), params.max_tokens, frac, prefer[1] if self.colocated else None,
                                view) if self.admission.turn(entry) else None
                # Disaggregated: the decode worker prefills a short prompt itself (placement.prefill_where)
                # (from the prompt's part not cached there)
                cached_d = min(view.cached.get(d.worker_id, 0), len(ids) - 1) if decode_view and d else 0
                where, why = ("colocated", "") if self.colocated or d is None else ("local", "no_pool") \
                    if self._no_prefill_pool() else ("pool", "cache_miss") if missed \
                    else prefill_where(len(ids) - cached_d, d, self.cfg.router.local_prefill_tokens,
                                       self._pool_queued())
                here = where != "pool"  # the decode (or colocated) worker prefills
                p = None if here or d is None else self._pick_prefill(len(ids), prefer[0], hashes, bs)
                if d is None or (p is None and not here):
                    if not queued:
                        if self.queued >= self.cfg.router.max_queue:
                            raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"all decode workers are full and {self.queued} requests are "
                                         "already waiting; retry later")
                        queued, self.queued = True, self.queued + 1
                    if time.monotonic() - since > self.cfg.router.queue_timeout_s:
                        raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"no KV capacity for {self.cfg.router.queue_timeout_s:g}s "
                                     "(router.queue_timeout_s); retry later")
                    await self._wait_change()
                    continue
                self.admission.trying(entry)  # the next in order may try meanwhile
                self._turn_moved()
                dw = self.pools.workers[d.worker_id]
                need = d.blocks_for(admission_tokens(d, len(ids), params.max_tokens, frac, view))
                # Known before the call's round trip, so placements meanwhile see the prefix there
                # (a local prefill where decode workers are not indexed counts as a miss)
                if where == "local":
                    hit = self._expect_prefix(job, d, hashes, len(ids), bs) if decode_view else 0
                else:
                    hit = self._expect_prefix(job, d if self.colocated else p, hashes, len(ids), bs)
                self.pools.reserved(dw.worker_id, need, prompt_tokens=len(ids) - hit if here else 0)
                try:
                    if here:
                        # Local because of a prefix the index believes cached there: only if it is
                        # (the worker checks; else the pool prefills it)
                        check = self.cfg.router.local_prefill_tokens if why == "short" and cached_d else None
                        taken = await self.pools.call(dw, dw.actor.submit.remote(job.key, ids, params, job.time_left(),
                                                                                 check))
                        if taken is False:
                            missed = True
                            continue
                        if dw.state != "ready" or dw.role not in roles:
                            # Lost while it answered (no Lost reaches this job), or began to drain
                            # (retire, switch roles): the request must not stay there.
                            if dw.state == "draining":
                                dw.actor.abort.remote(job.key)
                            continue
                        job.placed(dw, dw, where if self.colocated else f"{where}:{why}")
                        self._placed(where, why, hit)
                        return
                    # what to send there (the transfer's secret, the first position it lacks), or None: not now
                    got = await self.pools.call(dw, dw.actor.reserve.remote(job.key, ids, params, job.time_left()))
                    if got is None:
                        self.pools.reserved(dw.worker_id, d.free_blocks, new_call=False)  # full until it reports
                        continue
                except asyncio.CancelledError:
                    # The client gave up while the worker takes the call: it would hold the
                    # blocks (for the lease, or a whole generation) with nobody left to free
                    # them. The abort queues behind the call on the worker (calls run in order).
                    if dw.state in ("ready", "draining"):
                        dw.actor.abort.remote(job.key)
                    raise
                except RayActorError as e:
                    self.pools.lost(dw, f"reserve failed: {e}")
                    continue
                except RayTaskError as e:  # (before TimeoutError: Ray makes it one if the cause was)
                    if isinstance(e.cause, InvalidRequestError):
                        raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e.cause)) from None
                    raise
                except TimeoutError:  # stalled (pools.call): it is being replaced; try the others
                    continue
                pw = self.pools.workers.get(p.worker_id)
                if dw.state != "ready" or pw is None or pw.state != "ready" or pw.role != "prefill" \
                        or dw.role not in roles:
                    # Either was lost (or drained, or switched roles) while decode answered: the
                    # loss reached no job of ours yet, so nothing would re-run this one. Free the
                    # reservation, again.
                    if dw.state in ("ready", "draining"):
                        dw.actor.abort.remote(job.key)
                    continue
                job.placed(pw, dw, f"{where}:{why}")
                self._placed(where, why, hit)
                log.debug("rid=%s event=placed prefill=%s decode=%s prompt_tokens=%d", job.request_id,
                          pw.worker_id, dw.worker_id, len(ids))
                self.metrics.decode_prefix_tokens.inc(got.token_start)
                if decode_view:  # it holds the prompt's blocks now
                    self.prefix.record(dw.worker_id, hashes, d.total_blocks)
                pw.actor.prefill.remote(job.key, ids, params, dw.address, got, job.time_left())
                return
        finally:
            self.admission.leave(entry, placed=job.state is JobState.RUNNING)
            self._turn_moved()
            if queued:
                self.queued -= 1

    def _turn_moved(self) -> None:
        ev, self._turn_changed = self._turn_changed, asyncio.Event()
        ev.set()

    async def _wait_change(self) -> None:
        """Until capacity may have grown (router.pools), the admission order moved, or RETRY_WAIT_S."""
        waits = {asyncio.ensure_future(self.pools.wait_change(RETRY_WAIT_S)),
                 asyncio.ensure_future(self._turn_changed.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _pool_queued(self) -> int | None:
        """Prompt tokens the least busy ready prefill worker still has to compute (None: no
        such worker)."""
        return min((w.load().queued_prompt_tokens for w in self.pools.workers.values()
                    if w.role == "prefill" and w.state == "ready"), default=None)

    def _no_prefill_pool(self) -> bool:
        """Adaptive, and no worker is a prefill worker now (router.roles, ``min_prefill: 0``):
        the decode worker prefills the prompt itself."""
        return self.roles_controller is not None and not any(
            w.role == "prefill" and w.state in ("ready", "dead", "starting") for w in self.pools.workers.values())

    def _placed(self, where: str, why: str, hit: int) -> None:
        self.metrics.prefix_hit_tokens.inc(hit)
        if where != "colocated":
            self.metrics.prefill_placements.labels(where, why).inc()

    def _pick_prefill(self, prompt_tokens: int, prefer: str | None = None, hashes: list[int] = (),
                      block_size: int = 16):
        loads, view = self._prefix_view(self.pools.loads("prefill"), hashes, prompt_tokens, block_size)
        # No prefill worker has room now: the least loaded queues it in its own engine.
        return pick_prefill(loads, prompt_tokens, prefer, view) or min(
            (w for w in loads if w.accepting), key=lambda w: w.queued_prompt_tokens, default=None)

    def _prefix_view(self, loads: list, hashes: list[int], prompt_tokens: int,
                     block_size: int) -> tuple[list, PrefixView | None]:
        """(loads, view) for prefix-aware placement (``prefix_index.prefix_view``); prefix-blind:
        (loads as reported, None)."""
        if self.prefix is None:
            return loads, None
        self.prefix.prune(set(self.pools.workers))  # retired workers leave the table
        return prefix_view(self.prefix, self.jobs.values(), loads, hashes, prompt_tokens, block_size)

    def _expect_prefix(self, job: Job, w, hashes: list[int], prompt_tokens: int, block_size: int) -> int:
        """The job's prompt goes to ``w`` to prefill; returns the tokens it likely finds cached."""
        return 0 if self.prefix is None else expect_prefix(self.prefix, job, w, hashes, prompt_tokens, block_size)

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
        info = self.pools.model_info
        # Quantization and speculation are decode-side: a decode (or colocated) worker's say.
        dec = next((w.info for w in self.pools.workers.values() if w.role != "prefill" and w.info), info)
        return pb.ModelInfo(model=self.served_model_name, context_length=self.limits.context_length,
                            vocab_size=info.vocab_size, dtype=info.dtype, quantization=dec.quantization,
                            speculative=dec.speculative, block_size=info.block_size, kernels=dec.kernels,
                            memory=[m for w in self.pools.workers.values() if (m := worker_memory(w)) is not None])

    async def stranded(self) -> dict[str, dict[str, int]] | None:
        """Per ready worker (by id), the requests that hold KV blocks there (engine id → blocks) but
        are no live attempt of the router's: a leak, that nothing would free but the lease,
        or nothing at all. None if a worker did not answer within 10 s."""
        ready = [w for w in self.pools.workers.values() if w.state in ("ready", "draining")]
        try:
            held = await asyncio.wait_for(asyncio.gather(*(w.actor.held.remote() for w in ready)), timeout=10)
        except Exception:  # a worker died or stalled meanwhile: no verdict this time
            return None
        live = {j.key.engine_id for j in self.jobs.values()}  # read after the answers: a job that
        # started meanwhile is live; one that ended meanwhile may count once (see the proto)
        return {w.worker_id: {eid: b for eid, b in h.items() if eid not in live} for w, h in zip(ready, held)}

    async def stranded_blocks(self) -> dict[str, int] | None:
        """Per ready worker, the KV blocks :meth:`stranded` finds (None: no verdict)."""
        found = await self.stranded()
        return None if found is None else {wid: sum(h.values()) for wid, h in found.items()}

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.router.sweep_s)
            try:
                await self.sweep()
            except Exception:  # a bug must not end the sweeping for good
                log.exception("sweep failed")

    async def sweep(self) -> int:
        """Free KV blocks that no live request owns (every ``router.sweep_s``); returns the
        blocks freed. A request found stranded by two sweeps in a row is dropped: once could
        be a request that ended while the workers answered (its own abort is on the way);
        twice cannot. Nothing here is expected to fire: every path that reserves has its own
        path that frees; each sweep that frees is logged and counted
        (pdserve_router_swept_blocks), so that a missed path shows."""
        found = await self.stranded()
        if found is None:
            return 0
        total = 0
        for wid, held in found.items():
            ids = sorted(set(held) & self._stranded_before.get(wid, set()))
            w = self.pools.workers.get(wid)
            if not ids or w is None:
                continue
            try:
                freed = await self.pools.call(w, w.actor.release.remote(ids))
            except Exception as e:  # lost meanwhile: its blocks went with it
                log.warning("sweep of %s failed: %r", w.worker_id, e)
                continue
            log.warning("sweep freed %d KV blocks of %d requests no live request owns on %s: %s",
                        freed, len(ids), w.worker_id, ", ".join(ids[:8]))
            self.metrics.swept_blocks.inc(freed)
            total += freed
        self._stranded_before = {wid: set(h) for wid, h in found.items()}
        return total

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        await self._admin(context)  # worker addresses, and check_blocks calls every worker
        stranded = await self.stranded_blocks() if request.check_blocks else None
        workers = []
        for w in self.pools.workers.values():
            ws = pb.WorkerStatus(worker_id=w.worker_id, role=w.role, state=w.state, restarts=w.restarts,
                                 stranded_blocks=(stranded or {}).get(w.worker_id, 0), memory=worker_memory(w))
            if (s := w.status) is not None:
                spec = s.speculative or {}
                ws.MergeFrom(pb.WorkerStatus(
                    running=s.running, waiting=s.waiting, kv_blocks_used=s.kv_blocks_used,
                    kv_blocks_total=s.kv_blocks_total, tokens_per_s=s.tokens_per_s,
                    metrics_address=s.metrics_address or "",
                    speculative_acceptance=spec.get("acceptance_rate") or 0.0,
                    speculative_tokens_per_verify=spec.get("mean_tokens_per_verify") or 0.0))
            workers.append(ws)
        return pb.ClusterStatus(mode=self.cfg.mode, workers=workers, metrics_address=self.metrics.address or "",
                                queued_requests=self.queued, active_requests=len(self.jobs),
                                blocks_checked=stranded is not None,
                                autoscale_events=list(self.autoscaler.events) if self.autoscaler else
                                list(self.roles_controller.events) if self.roles_controller else [])


async def start_server(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve ``router`` plus grpc.health.v1 and reflection; returns (server, bound port)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection
    lim, door = router.cfg.limits, router.door
    from router.grpc_guard import server_kwargs  # limits, keepalive, connection age, Watch cap, drain
    server = grpc.aio.server(**server_kwargs(router.cfg, door))
    pb_grpc.add_GenerationServicer_to_server(router, server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    if door.reflection:
        reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, door.tls.server_credentials()) if door.tls else \
        server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", service):
        await _maybe_await(health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    return server, bound


def worker_memory(w: Worker) -> pb.WorkerMemory | None:
    """``w``'s memory (its account at load, its latest RSS and PSS), or None before it has one."""
    m = memory_now(w.info, w.status) if w.state not in ("dead", "gone") else None  # (an old process's)
    return None if m is None else pb.WorkerMemory(worker_id=w.worker_id, role=w.role,
                                                  **msgspec.structs.asdict(m))


def retry_after(seconds: float) -> str:
    """A retry hint as HTTP's Retry-After and gRPC's retry-after metadata say it: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


async def _maybe_await(x: Any) -> None:
    if asyncio.iscoroutine(x):
        await x

