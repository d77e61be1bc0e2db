"""Placing one job: wait for room in fair order, then reserve and submit (router.server's PLACING).

Each try takes a snapshot of the pools (``placement.PoolView``), asks the pure
``placement.plan`` where the job goes, and carries the answer out through the pools' calls
(router.pools: each Ray call, its deadline and the mapping of its errors live there)::

    while True:
        no worker left ─► UNAVAILABLE
        plan(view, demand):
          Wait   ─► queue (router.max_queue: else RESOURCE_EXHAUSTED), preempt lower-priority
                    requests if it is this job's turn (router.preempt), wait for a change
                    (router.queue_timeout_s: else RESOURCE_EXHAUSTED)
          Local  ─► submit to the decode (or colocated) worker; not holding the prefix it was
                    sent for ─► the pool prefills it (``missed``), try again
          Remote ─► reserve on the decode worker (full ─► try again), then the prefill worker
                    prefills and sends the KV there
        a worker lost, stalled, draining or switched roles meanwhile ─► free what it holds, try again

The fair order (router.admission) decides whose turn it is; a job that found room is
``trying`` and holds no one behind it during its calls.

A try costs O(workers + prompt blocks) (the prompt is hashed once per attempt): the live
requests' queues and held blocks are kept as they change (router.holdings: ``place`` and
``prefilled`` tell it), never walked per try, so retrying queued requests every
``RETRY_WAIT_S`` under overload stays linear. The prefix index learns a prompt's blocks only
once its placement succeeded, and what a worker turned out not to hold (router.prefix_index).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from engine.errors import InvalidRequestError
from router.admission import Admission, Entry
from router.config import ClusterConfig
from router.holdings import Holdings
from router.jobs import Job, JobState
from router.placement import Demand, Local, PoolView, PrefixView, Remote, Wait, WorkerLoad, plan
from router.prefix_index import PrefixIndex, block_hashes, expect_prefix, prefilled, prefix_view
from router.reject import Reject
from router.worker_state import Role, Unreachable, WorkerState

log = logging.getLogger("pdserve.router")

RETRY_WAIT_S = 0.1  # admission re-checks at least this often, besides every load change


class Tried(enum.Enum):
    PLACED = "placed"
    RETRY = "retry"  # a worker was lost, full, or left its role meanwhile: plan again
    MISSED = "missed"  # the decode worker lacked the prefix it was chosen for: the pool prefills it


@dataclass(frozen=True)
class Prompt:
    """What placement reads of one attempt's prompt (computed once per attempt)."""

    ids: list[int]
    params: Any  # engine.request.SamplingParams
    block_size: int  # of the prefilling pool (prefix-aware placement hashes blocks of this size)
    hashes: list[int]  # its full blocks' hashes ([]: prefix-blind)
    decode_view: bool  # disaggregated, and the decode workers' caches are indexed too


class Placer:
    """Places jobs on the pools (module docstring).

    Args:
        cfg: the cluster config.
        pools: router.pools.Pools, or a fake with the same methods (tests).
        admission: the per-token fair order.
        live: what the router's live jobs hold (router.holdings; the router drops a job from it
            when the job ends, and this placer counts it as it is placed and prefilled).
        metrics: router.metrics.RouterMetrics (its prefix and placement counters).
        prefix: the prefix index (None: prefix-blind).
        adaptive: workers switch roles (router.roles).
        preemptor: router.preempt.Preemptor, asked to make room when the job whose turn it is
            finds none (None: no preemption).
    """

    def __init__(self, cfg: ClusterConfig, pools: Any, admission: Admission, live: Holdings,
                 metrics: Any, prefix: PrefixIndex | None = None, adaptive: bool = False,
                 preemptor: Any = None) -> None:
        self.cfg, self.pools, self.admission, self.live, self.metrics = cfg, pools, admission, live, metrics
        self.prefix, self.adaptive, self.preemptor = prefix, adaptive, preemptor
        self.colocated = cfg.mode == "colocated"
        self.decode_roles = (Role.COLOCATED,) if self.colocated else (Role.DECODE,)
        self.queued = 0  # jobs waiting for a decode worker
        self._turn_changed = asyncio.Event()  # replaced when a waiting job leaves the order or tries

    async def place(self, job: Job) -> None:
        """Reserve on a decode worker and submit to a prefill worker (or one colocated worker).

        Raises:
            Reject: RESOURCE_EXHAUSTED (admission queue full, or no capacity for
                ``router.queue_timeout_s``), UNAVAILABLE (no worker left), INVALID_ARGUMENT
                (a worker found the input bad).
        """
        prompt = self._prompt(job)
        # (a new attempt: nothing of the last one is counted; router.holdings)
        job.uncached, job.prefix_hashes = len(prompt.ids), []
        self.live.update(job)
        demand = Demand(len(prompt.ids), prompt.params.max_tokens, job.prefer or ("", ""))
        entry = self.admission.enqueue(job.lease, demand.prompt_tokens + demand.max_tokens)
        queued, since = False, time.monotonic()
        try:
            while True:
                self._check_alive()
                view = self._view(prompt, entry)
                step = plan(view, demand)
                if isinstance(step, Wait):
                    queued = queued or self._enter_queue(job)
                    if view.turn and self.preemptor is not None:  # its turn, and no room: router.preempt
                        self.preemptor.make_room(job, demand, view.decode, view.reserve_fraction)
                    self._check_waited(since)
                    await self._wait_change()
                    continue
                self.admission.trying(entry)  # the next in order may try meanwhile
                self._turn_moved()
                try:
                    tried = await (self._local(job, step, prompt) if isinstance(step, Local)
                                   else self._remote(job, step, prompt))
                except InvalidRequestError as e:
                    raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                if tried is Tried.PLACED:
                    return
                if tried is Tried.MISSED:
                    demand = dataclasses.replace(demand, missed=True)
        finally:
            self.live.update(job)
            self.admission.leave(entry, placed=job.state is JobState.RUNNING)
            self._turn_moved()
            if queued:
                self.queued -= 1

    def _prompt(self, job: Job) -> Prompt:
        ids, params = job.inputs()
        bs = self._block_size
        hashes = block_hashes(ids, bs) if self.prefix is not None else []
        # Disaggregated: what the decode workers cache, too (their prefix is shared, not sent
        # again), when both pools name blocks alike (the same block size: the default)
        decode_view = not self.colocated and self.prefix is not None and self.cfg.decode.block_size == bs
        return Prompt(ids, params, bs, hashes, decode_view)

    @property
    def _block_size(self) -> int:
        """The prefilling pool's block size: prefix-aware placement hashes prompts' full blocks
        in it (an adaptive worker runs the decode pool's engine in both roles)."""
        return (self.cfg.decode if self.colocated or self.adaptive else self.cfg.prefill).block_size

    def _check_alive(self) -> None:
        # (adaptive: with no prefill worker, decode workers prefill their own prompts; with no
        # decode worker, one of the others will switch to decode)
        if self.adaptive:
            alive = self.pools.any_alive(Role.PREFILL, Role.DECODE)
        else:
            alive = self.pools.any_alive(*self.decode_roles) and (self.colocated or self.pools.any_alive(Role.PREFILL))
        if not alive:
            raise Reject(grpc.StatusCode.UNAVAILABLE, "no worker is left to serve the request")

    def _view(self, prompt: Prompt, entry: Entry) -> PoolView:
        """The pools now, as ``plan`` reads them (a decode worker receives a prompt's whole KV:
        only a colocated one shares it, so only its queues are prefix_view's)."""
        # Fair share and priority (router.admission): while another waiting job goes first,
        # this one waits as if no decode worker had room
        if not self.admission.turn(entry):
            return PoolView(self.colocated, [], turn=False)
        loads, prefix = self.pools.loads(*self.decode_roles), None
        if self.colocated:
            loads, prefix = self._prefix_view(loads, prompt)
        elif prompt.decode_view:  # (the reported queues stay: prefill_where reads them)
            prefix = self._prefix_view(loads, prompt)[1]
        prefill, prefill_prefix, pool_queued = [], None, None
        if not self.colocated:
            raw = self.pools.loads(Role.PREFILL)
            pool_queued = min((w.queued_prompt_tokens for w in raw if w.accepting), default=None)
            prefill, prefill_prefix = self._prefix_view(raw, prompt)
        return PoolView(self.colocated, loads, prefill, prefix, prefill_prefix, pool_queued,
                        no_prefill_pool=self.adaptive and not self.pools.staffed(Role.PREFILL),
                        reserve_fraction=self.cfg.decode.reserve_fraction,
                        local_prefill_tokens=self.cfg.router.local_prefill_tokens)

    def _prefix_view(self, loads: list[WorkerLoad], prompt: Prompt) -> tuple[list[WorkerLoad], PrefixView | None]:
        """(loads, view) for prefix-aware placement (``prefix_index.prefix_view``); prefix-blind:
        (loads as reported, None)."""
        if self.prefix is None:
            return loads, None
        self.prefix.prune(set(self.pools.workers))  # retired workers leave the table
        return prefix_view(self.prefix, self.live, loads, prompt.hashes, len(prompt.ids), prompt.block_size)

    def _expect_prefix(self, job: Job, w: WorkerLoad, prompt: Prompt) -> int:
        """The job's prompt goes to ``w`` to prefill; returns the tokens it likely finds cached
        (recorded only once the call succeeded: ``_record``)."""
        return 0 if self.prefix is None else expect_prefix(self.prefix, job, w, prompt.hashes, len(prompt.ids),
                                                           prompt.block_size)

    async def _local(self, job: Job, step: Local, prompt: Prompt) -> Tried:
        """The decode (or colocated) worker prefills the prompt itself."""
        dw = self.pools.worker(step.decode.worker_id)
        # (a local prefill where decode workers are not indexed counts as a miss)
        hit = self._expect_prefix(job, step.decode, prompt) if step.where == "colocated" or prompt.decode_view else 0
        self.pools.reserved(dw.worker_id, step.blocks, prompt_tokens=len(prompt.ids) - hit)
        # Local because of a prefix the index believes cached there: only if it is (``check``)
        taken = await self.pools.submit(dw, job.key, prompt.ids, prompt.params, job.time_left(), step.check)
        if isinstance(taken, Unreachable):
            return Tried.RETRY
        if taken is False:  # it does not hold the prefix the index lists there: the index learns
            if self.prefix is not None:
                self.prefix.discard(dw.worker_id, prompt.hashes)
            return Tried.MISSED
        if not self.pools.still_ready(dw, self.decode_roles):
            # Lost while it answered (no Lost reaches this job), or began to drain (retire,
            # switch roles): the request must not stay there.
            if dw.state is WorkerState.DRAINING:
                self.pools.abort(dw, job.key)
            return Tried.RETRY
        job.placed(dw, dw, step.where if self.colocated else f"{step.where}:{step.why}")
        if step.where == "colocated" or prompt.decode_view:  # it will hold the prompt's blocks
            self._record(dw.worker_id, prompt, step.decode.total_blocks)
        self._placed(job, step.where, step.why, hit)
        return Tried.PLACED

    async def _remote(self, job: Job, step: Remote, prompt: Prompt) -> Tried:
        """Reserve on the decode worker, then the prefill worker prefills and sends the KV there."""
        d = step.decode
        dw = self.pools.worker(d.worker_id)
        hit = self._expect_prefix(job, step.prefill, prompt)
        self.pools.reserved(dw.worker_id, step.blocks)
        got = await self.pools.reserve(dw, job.key, prompt.ids, prompt.params, job.time_left())
        if isinstance(got, Unreachable):
            return Tried.RETRY
        if got is None:
            self.pools.reserved(dw.worker_id, d.free_blocks, new_call=False)  # full until it reports
            return Tried.RETRY
        pw = self.pools.get(step.prefill.worker_id)
        if not (self.pools.still_ready(dw, self.decode_roles) and self.pools.still_ready(pw, (Role.PREFILL,))):
            # Either was lost (or drained, or switched roles) while decode answered: the loss
            # reached no job of ours yet, so nothing would re-run this one. Free the
            # reservation, again.
            self.pools.abort(dw, job.key)
            return Tried.RETRY
        job.placed(pw, dw, f"pool:{step.why}")
        self._record(pw.worker_id, prompt, step.prefill.total_blocks)
        self._placed(job, "pool", step.why, hit)
        log.debug("rid=%s event=placed prefill=%s decode=%s prompt_tokens=%d", job.request_id,
                  pw.worker_id, dw.worker_id, len(prompt.ids))
        self.metrics.decode_prefix_tokens.inc(got.token_start)
        if prompt.decode_view:  # it holds the prompt's blocks now; it had ``token_start`` of them
            bs = prompt.block_size
            believed = min((len(prompt.ids) - 1) // bs, self.prefix.hit_blocks(dw.worker_id, prompt.hashes)) * bs
            prefilled(self.prefix, dw.worker_id, prompt.hashes, believed, got.token_start, bs)
            self._record(dw.worker_id, prompt, d.total_blocks)
        self.pools.prefill(pw, job.key, prompt.ids, prompt.params, dw.address, got, job.time_left())
        return Tried.PLACED

    def _record(self, worker_id: str, prompt: Prompt, total_blocks: int) -> None:
        """The placement succeeded: ``worker_id`` holds the prompt's blocks (prefix-aware)."""
        if self.prefix is not None:
            self.prefix.record(worker_id, prompt.hashes, total_blocks)

    def _placed(self, job: Job, where: str, why: str, hit: int) -> None:
        self.live.update(job)
        self.metrics.prefix_hit_tokens.inc(hit)
        if where != "colocated":
            self.metrics.prefill_placements.labels(where, why).inc()

    def prefilled(self, job: Job, cached_tokens: int) -> None:
        """This attempt's first token came, from a prefill that found ``cached_tokens`` of the
        prompt in its worker's cache: its queue entry there ends, and the index is corrected
        where it expected more (router.prefix_index ``prefilled``)."""
        self.live.update(job)
        if self.prefix is not None and job.prefix_hashes and job.prefill_id:
            expected = len(job.prompt_ids) + job.base - job.uncached  # (the attempt's prompt: inputs())
            prefilled(self.prefix, job.prefill_id, job.prefix_hashes, expected, cached_tokens, self._block_size)

    # ---- waiting -------------------------------------------------------------------------------
    def _enter_queue(self, job: Job) -> bool:
        """The job starts waiting for a decode worker (router.max_queue bounds them; not a
        preempted or parked one: it was admitted and streams, and the queue bounds arrivals)."""
        if self.queued >= self.cfg.router.max_queue and not (job.preemptions or job.parks):
            raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"all decode workers are full and {self.queued} requests are already waiting; retry later")
        self.queued += 1
        return True

    def _check_waited(self, since: float) -> None:
        if time.monotonic() - since > self.cfg.router.queue_timeout_s:
            raise Reject(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"no KV capacity or sequence slot (decode.max_num_seqs) for "
                         f"{self.cfg.router.queue_timeout_s:g}s (router.queue_timeout_s); "
                         "retry later")

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
