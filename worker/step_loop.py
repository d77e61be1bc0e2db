"""A worker core stepped by a background thread, with one lock for every outside call.

Every worker kind's Ray actor holds one (``worker.actor``): the loop keeps stepping (engine and
network) while actor calls (reserve, submit, abort, status...) run between steps, through an
:class:`~worker.inbox.Inbox`. Outputs leave as typed records (``worker.protocol``) in per-step
batches, pushed over zmq to the router named at start (else kept for :meth:`StepLoop.poll`),
never one call per token.

Its parts, each handed in by the actor that wires them::

    StepLoop(worker core, role hooks, requests, inbox, options)
        worker core   engine + KV sender/receiver (prefill_worker, decode_worker, adaptive_worker)
        role hooks    step result -> records, busy, drop: the role's (``RoleHooks``)
        requests      engine id -> key and deadline of each live request (``worker.requests``)
        inbox         actor calls waiting for the next gap between steps (``worker.inbox``)

The role's calls (``reserve``, ``prefill``...) admit requests into the same ``Requests`` and
queue their work in the same ``Inbox``; a request whose client deadline passed is dropped here
even if the router's abort never arrives.

A worker of an HA cluster (``options.epoch`` set) has a :class:`~worker.fence.Fence`: a new
router ``adopt``s it (its reports go to that router's socket from then on), and a worker no
router called for ``options.grace_s`` drops every request and stops reporting until one does.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from engine.errors import InvalidRequestError
from engine.memory import process_memory
from engine.models.loader import weights_digest
from engine.openmp import release_pool
from engine.quant import quantization_name
from engine.request import RequestStatus
from kvtransfer.base import TransferStats
from worker.fence import Adopted, Ended, Fence, handovers
from worker.heap import load_memory, release_heap  # (also imported from here)
from worker.inbox import Inbox
# (RouterLink, WorkerOptions: the router↔worker contract, in the protocol; still importable from here)
from worker.protocol import (MAX_REPORT_BYTES, REPORT_TARGET_BYTES, Failed, Key, ModelInfo, Record, Report,
                             RouterLink, Tokens, WorkerOptions, WorkerStatus, encode_report, split_records)
from worker.requests import Requests

log = logging.getLogger("pdserve.worker")

TOKEN_RATE_WINDOW_S = 5.0
HEARTBEAT_S = 0.05  # an idle worker's load report interval
# ... and within a step, between its layers, at most this often: a step of minutes (a long
# prompt's chunk of a 1.5B model on one loaded core) still reports, so router.stall_s judges a
# silent worker, not a slow step
MID_STEP_BEAT_S = 1.0
EXPIRY_CHECK_S = 0.05  # how often client deadlines are checked (a deadline is met this late at most)
# How often freed heap memory goes back to the OS (``release_heap``). glibc keeps what a long
# prefill's activations freed (100-200 MB here) in its arenas and reuses it unevenly, so a
# serving worker's RSS creeps for hours without it (the soak, issue 16); a trim costs ~ms.
TRIM_S = 30.0
# How often a status re-reads the process's RSS and PSS (/proc/self/smaps_rollup: ~0.1-1 ms,
# too much for every 50 ms heartbeat, nothing every few seconds).
MEMORY_REFRESH_S = 5.0


class RoleHooks(Protocol):
    """What the step loop asks of the role a worker plays (the calls objects of
    ``decode_worker.actor``, ``prefill_worker.actor``, ``adaptive_worker.actor``)."""

    name: str  # "prefill", "decode", "colocated" or "adaptive": WorkerStatus.role, the /metrics label

    def records(self, step_result: Any) -> list[Record | None]:
        """``worker.step()``'s result as records (a None is skipped)."""

    def busy(self) -> bool:
        """Whether there is work beyond the engine's queues (a transfer in flight)."""

    def drop(self, engine_id: str) -> None:
        """Stop a request here and free its blocks (the role's abort; idempotent); runs on the
        loop thread."""


class StepLoop:
    """Drives ``worker.step()`` in a thread (started here). ``worker`` needs ``engine``,
    ``step``, ``close``; ``hooks`` turn its results into records; ``requests`` and ``inbox``
    are shared with the role's calls (module doc)."""

    def __init__(self, worker: Any, hooks: RoleHooks, requests: Requests, inbox: Inbox,
                 options: WorkerOptions) -> None:
        """Start stepping ``worker``; with ``options.router`` push reports there, with
        ``options.metrics`` serve ``/metrics``."""
        self.worker, self.hooks, self.requests, self.inbox = worker, hooks, requests, inbox
        self.role = hooks.name
        self.options = options
        self._weights = weights_digest(Path(worker.engine.model_path))
        self.memory = load_memory(worker.engine)
        self._process_memory: tuple[float, float] | None = None  # (rss_gb, pss_gb) as of _memory_at
        self._memory_at = float("-inf")
        root = logging.getLogger("pdserve")
        if not root.handlers:  # a worker process: its stderr goes to the Ray worker log file
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
        self.lock = threading.Lock()  # held by the loop for a whole step
        self.outbox: list[Record] = []
        self._next_expiry = 0.0
        self._seq = 0  # reports sent (Report.seq)
        self._sink: Any = None  # the report socket, once the loop has connected it
        self._last_beat = 0.0  # when the last report went
        self.incarnation = uuid.uuid4().hex[:12]  # new after every restart of the actor
        self.worker_id = options.router.worker_id if options.router else self.incarnation
        self._snapshot: WorkerStatus | None = None  # the last report's status (metrics read it lock-free)
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()
        self._generated = 0  # tokens sent to the router since start
        self.metrics_address = None
        self._metrics_server = None
        if options.metrics is not None:
            # (optional: prometheus_client, only for a worker that serves /metrics)
            from worker.metrics import WorkerCollector, serve_metrics
            host, port = options.metrics
            collector = WorkerCollector({"worker": self.worker_id, "role": self.role}, self._metrics_status,
                                        self.model_info)
            self._metrics_server, port = serve_metrics(collector, host, port)
            self.metrics_address = f"{host}:{port}"
        # (HA: the router this worker follows, and the grace period; None: its router owns it)
        self.fence = None if options.epoch is None else Fence(options.epoch, options.grace_s)
        self.ended = None if self.fence is None else Ended()  # (what a new router may still resume)
        self.running = True
        # This thread built the engine; the loop's runs it from here: this one's OpenMP threads
        # would only make every step's waits short spins and sleeps (engine/openmp.py)
        release_pool()
        self.loop = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self.loop.start()

    # ---- calls every role answers ------------------------------------------------------------
    def abort(self, key: Key) -> None:
        """The router's abort of one attempt (queued behind the calls before it)."""
        self.inbox.post(lambda: self.hooks.drop(key.engine_id), key)

    def release(self, engine_ids: list[str]) -> int:
        """Drop these requests (the router's sweep: they hold blocks but no live request owns
        them); returns the blocks that freed."""
        def release() -> int:
            before = self.worker.engine.block_manager.num_used_blocks
            for eid in engine_ids:
                self.hooks.drop(eid)
            return before - self.worker.engine.block_manager.num_used_blocks
        return self.inbox.call(release)

    def _expire(self, now: float) -> None:
        """Drop requests whose client deadline passed (checked every ``EXPIRY_CHECK_S``)."""
        if now < self._next_expiry or not self.requests.has_deadlines:
            return
        self._next_expiry = now + EXPIRY_CHECK_S
        for key in self.requests.due(now):
            log.info("rid=%s attempt=%d event=deadline worker=%s", key.request_id, key.attempt, self.worker_id)
            # No record: the router, which passed the deadline on, gave up on it first.
            self.hooks.drop(key.engine_id)

    def _run_inbox(self) -> None:
        for key, e in self.inbox.run():  # posted calls that raised: bad input for the caller
            self.requests.forget(key.engine_id)
            self.outbox.append(Failed(key, str(e), isinstance(e, InvalidRequestError)))

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        self._sink = self._connect() if self.options.router is not None else None
        try:
            self._loop()
        except BaseException:  # a bug: die loudly so Ray restarts the actor and the router re-runs
            log.exception("step loop failed; exiting the worker process")
            os._exit(1)
        finally:
            if self._sink is not None:
                self._sink.close(linger=1000)

    def _loop(self) -> None:
        next_trim = time.monotonic() + TRIM_S
        while self.running:
            with self.lock:
                # (``self._sink``, not a local: an adoption in the inbox swaps it, an orphaning drops it)
                if self.inbox:
                    self._run_inbox()
                    if self._sink is not None:  # new work: show it before a step that may take seconds
                        self._send(self._sink, time.monotonic())
                self._expire(time.monotonic())
                if self.fence is not None and self.fence.expired():
                    self._orphan()
                busy = self.worker.engine.scheduler.has_work() or self.hooks.busy()
                began = time.monotonic()
                self._step()
                now = time.monotonic()
                if self.fence is not None and now - began > MID_STEP_BEAT_S:  # (calls waited: worker.fence)
                    self.fence.credit(now - began)
                sink = self._sink
                # Outputs go at once; an idle worker still reports its load (a heartbeat).
                if sink is not None and (self.outbox or now - self._last_beat >= HEARTBEAT_S):
                    self._send(sink, now)
            if time.monotonic() >= next_trim:  # between steps, outside the lock: calls go on
                release_heap()
                next_trim = time.monotonic() + TRIM_S
            if not busy and not self.inbox:
                time.sleep(0.0005)  # idle: keep polling the network, give the core back

    # ---- HA: adoption and the grace period (worker.fence) ---------------------------------------
    def adopt(self, epoch: int, link: RouterLink, grace_s: float | None = None) -> Adopted:
        """A router of ``epoch`` takes this worker over: from the next report on, reports go
        to ``link``, and its grace period is ``grace_s`` (None: as it was). Returns what it
        holds (the requests of the router before, which the new one does not know), with
        what the new one needs to resume those that decode (``Adopted.handover``). Raises
        FencedError for an older epoch, ValueError for another worker id or a worker without
        a fence."""
        if self.fence is None:
            raise ValueError("this worker has no fence (ha.enabled was off when it was made)")
        if link.worker_id != self.worker_id:
            raise ValueError(f"worker {self.worker_id} cannot be adopted as {link.worker_id}")

        def adopt() -> Adopted:
            self.fence.adopt(epoch, grace_s)
            self.outbox = []  # (records of the router before: the new one knows none of its requests)
            if self._sink is not None:
                self._sink.close(linger=0)
            self.options = dataclasses.replace(self.options, router=link)
            self._sink = self._connect()
            eng = self.worker.engine
            held = {eid: len(r.block_ids) for eid, r in eng.scheduler.requests.items()}
            held.update({eid: 0 for eid in self.requests.live() if eid not in held})
            receiver = getattr(self.worker, "receiver", None)
            log.info("adopted by the router of epoch %d at %s; it holds %d requests", epoch, link.address, len(held))
            return Adopted(self.worker_id, self.incarnation, self.role, epoch, held, eng.block_manager.num_used_blocks,
                           receiver.address if receiver is not None else None,
                           handovers(eng.scheduler.requests, self.requests.keys()) + self.ended.recent())
        return self.inbox.call(adopt)

    def _orphan(self) -> None:
        """No router called for the grace period (on the loop thread, the lock held): abort
        every request, free every block, stop reporting (until an adoption)."""
        eng = self.worker.engine
        ids = set(eng.scheduler.requests) | set(self.requests.live())
        before = eng.block_manager.num_used_blocks
        for eid in ids:
            self.hooks.drop(eid)
        self.outbox = []
        if self._sink is not None:
            self._sink.close(linger=0)
            self._sink = None
        self.fence.orphaned = True
        log.warning("no router called for %.1fs (ha.grace_s): aborted %d requests, freed %d of %d KV blocks; "
                    "waiting to be adopted", self.fence.grace_s, len(ids),
                    before - eng.block_manager.num_used_blocks, before)

    def _step(self) -> None:
        """One step of the core; its records join the outbox once it is over (a report sent
        between its layers replaces the outbox list: ``self.outbox.extend(<the step>)`` would
        bind the list before the step ran and add the records to the one already sent)."""
        before = dict(self.worker.engine.scheduler.requests) if self.ended is not None else None
        records = [r for r in self.hooks.records(self.worker.step(self._beat)) if r is not None]
        self.outbox.extend(records)
        if before is not None:  # (ha: what ended may be handed over, worker.fence ``Ended``)
            self.ended.keep(records, before)

    def _beat(self) -> None:
        """Between two layers of a step (on the loop's thread, the lock held): a report if the
        last went ``MID_STEP_BEAT_S`` ago."""
        now = time.monotonic()
        if self._sink is not None and now - self._last_beat >= MID_STEP_BEAT_S:
            self._send(self._sink, now)

    def _send(self, sink: Any, now: float) -> None:
        """Push the outbox and the current status (with the lock held)."""
        self._last_beat = now
        batch, self.outbox = self.outbox, []
        self._count_tokens(batch, now)
        self._log(batch)
        self._snapshot = self._status()
        for wire in self._reports(split_records(batch)):
            sink.send(wire)

    def _reports(self, records: list[Record]) -> list[bytes]:
        """``records`` and the status as encoded reports: one, or (past ``REPORT_TARGET_BYTES``)
        halves in order, each with its own ``seq``. A lone record past ``MAX_REPORT_BYTES``,
        which the router's socket would refuse, goes as a ``Failed`` instead."""
        self._seq += 1
        wire = encode_report(Report(self.worker_id, self.incarnation, records, self._snapshot, self._seq),
                             self.options.key)
        if len(wire) <= REPORT_TARGET_BYTES or (len(records) == 1 and len(wire) <= MAX_REPORT_BYTES):
            return [wire]
        if len(records) > 1:
            half = len(records) // 2
            return self._reports(records[:half]) + self._reports(records[half:])
        r = records[0]
        log.error("rid=%s attempt=%d event=error worker=%s error=output of %d bytes exceeds a report",
                  r.key.request_id, r.key.attempt, self.worker_id, len(wire))
        self.requests.forget(r.key.engine_id)
        return self._reports([Failed(r.key, f"this step's output ({len(wire)} bytes) exceeds a report's "
                                            f"{MAX_REPORT_BYTES} bytes", invalid=True)])

    def _connect(self) -> Any:
        import zmq  # (optional: only a worker with a router link reports, over zmq)
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # tokens are never dropped; the router drains them
        sock.connect(self.options.router.address)
        return sock

    def _log(self, batch: list[Record]) -> None:
        """One key=value line per request that ends here; ``rid`` is the router's request id,
        so one grep follows a request across router and workers."""
        for r in batch:
            if isinstance(r, Failed):
                log.info("rid=%s attempt=%d event=error worker=%s error=%r", r.key.request_id, r.key.attempt,
                         self.worker_id, r.error)
            elif r.finish:
                log.info("rid=%s attempt=%d event=%s worker=%s prompt_tokens=%d cached_tokens=%d",
                         r.key.request_id, r.key.attempt, r.finish, self.worker_id, r.prompt_tokens,
                         r.cached_tokens)

    def _count_tokens(self, batch: list[Record], now: float) -> None:
        n = sum(len(r.tokens) for r in batch if isinstance(r, Tokens))
        self._generated += n
        self._token_times.append((now, n))
        while self._token_times and self._token_times[0][0] < now - TOKEN_RATE_WINDOW_S:
            self._token_times.popleft()

    # ---- views -------------------------------------------------------------------------------
    def poll(self) -> list[Record]:
        """Records since the last call (only while no router is attached)."""
        def take() -> list[Record]:
            out, self.outbox = self.outbox, []
            return out
        return self.inbox.call(take)

    def status(self) -> WorkerStatus:
        return self.inbox.call(self._status)

    def inject(self, kind: str) -> None:
        """Chaos testing: a fault in this worker's next KV message (kvtransfer's
        ``KVSender.inject``). Refused unless the cluster enabled ``kv_transfer.fault_injection``."""
        if not self.options.faults:
            raise PermissionError("fault injection is off (kv_transfer.fault_injection)")
        sender = getattr(self.worker, "sender", None)
        if sender is None:
            raise ValueError(f"a {self.role} worker sends no KV: inject faults on a prefill worker")
        self.inbox.call(lambda: sender.inject(kind))

    def held(self) -> dict[str, int]:
        """KV blocks held per request here, by engine id (the router's leak check)."""
        def held() -> dict[str, int]:  # (the engine's request id is the engine id)
            return {eid: len(r.block_ids) for eid, r in self.worker.engine.scheduler.requests.items() if r.block_ids}
        return self.inbox.call(held)

    def _metrics_status(self) -> WorkerStatus | None:
        return self._snapshot if self.options.router is not None else self.status()

    def _status(self) -> WorkerStatus:
        eng = self.worker.engine
        bm, sch = eng.block_manager, eng.scheduler
        reqs = list(sch.requests.values())
        now = time.monotonic()
        tokens = sum(n for t, n in self._token_times if t >= now - TOKEN_RATE_WINDOW_S)
        # KV transfers it took part in: sent, received, or (an adaptive worker) both
        receiver = getattr(self.worker, "receiver", None)
        sides = [x.stats for x in (getattr(self.worker, "sender", None), receiver) if x]
        return WorkerStatus(
            role=self.role, incarnation=self.incarnation, pid=os.getpid(),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks, block_size=bm.block_size,
            running=len(sch.running), waiting=len(sch.waiting) + len(sch.receiving),
            max_num_seqs=eng.config.scheduler.max_num_seqs,
            queued_prompt_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in reqs
                                     if not r.is_finished and r.status != RequestStatus.WAITING_FOR_KV),
            remaining_decode_tokens=sum(max(0, r.sampling_params.max_tokens - r.num_output_tokens)
                                        for r in reqs if not r.prefill_only and not r.is_finished),
            tokens_per_s=tokens / TOKEN_RATE_WINDOW_S, generated_tokens=self._generated,
            prefix_query_tokens=bm.prefix_queries, prefix_hit_tokens=bm.prefix_hits,
            admitted=self.requests.admitted, metrics_address=self.metrics_address,
            kv_address=receiver.address if receiver is not None else None,
            kv_transfer=sum(sides, TransferStats()) if sides else None,
            speculative=eng.spec.stats() if getattr(eng, "spec", None) is not None else None,
            **self._process_now(now))

    def _process_now(self, now: float) -> dict[str, float]:
        """rss_gb, pss_gb for a status: read again every ``MEMORY_REFRESH_S``, else the last reading."""
        if now - self._memory_at >= MEMORY_REFRESH_S:
            m = process_memory()
            self._process_memory, self._memory_at = (m["rss_gb"], m["pss_gb"]), now
        rss, pss = self._process_memory
        return {"rss_gb": rss, "pss_gb": pss}

    def model_info(self) -> ModelInfo:
        eng = self.worker.engine
        return ModelInfo(model=str(eng.model_path), fingerprint=eng.model_config.fingerprint(),
                         incarnation=self.incarnation, context_length=eng.max_model_len,
                         vocab_size=eng.model_config.vocab_size, dtype=eng.config.dtype,
                         block_size=eng.block_manager.block_size,
                         speculative=eng.spec.label if getattr(eng, "spec", None) is not None else "none",
                         quantization=quantization_name(eng.config.quantization, eng.model_path,
                                                                       eng.config.dequantize),
                         kernels=eng.kernels, weights=self._weights, memory=self.memory)

    def shutdown(self) -> None:
        self.running = False
        self.loop.join(timeout=5)
        self._run_inbox()  # nothing waits forever on a stopped loop
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.worker.close()
