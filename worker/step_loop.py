"""A worker core stepped by a background thread, with one lock for every outside call.

Both worker kinds' Ray actors build on it (``worker.actor``): the loop keeps stepping (engine
and network) while actor methods (reserve, submit, abort, status...) run between steps.
Outputs leave as typed records (``worker.protocol``) in per-step batches, pushed over zmq to
the router named at start (else kept for :meth:`StepLoop.poll`), never one call per token.

The loop knows each live request by its :class:`~worker.protocol.Key` (``keys``: engine id →
key, from the call that brought it here until it leaves), so records carry the attempt as a
field and nothing parses ids. A request that came with the client's deadline (``timeout_s`` of
the admitting call) is dropped here when it passes, even if the router's abort never arrives
(``deadlines``: engine id → monotonic time, pruned as requests leave).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError
from engine.llm_engine import RequestOutput
from engine.memory import account, process_memory
from engine.models.loader import weights_digest
from engine.quant import quantization_name
from engine.request import RequestStatus
from kvtransfer.base import TransferStats
# (RouterLink, WorkerOptions: the router↔worker contract, in the protocol; still importable from here)
from worker.protocol import (MAX_REPORT_BYTES, REPORT_TARGET_BYTES, Failed, Key, Memory, ModelInfo, Record, Report,
                             RouterLink, Tokens, WorkerOptions, WorkerStatus, encode_report, split_records)

log = logging.getLogger("pdserve.worker")

TOKEN_RATE_WINDOW_S = 5.0
HEARTBEAT_S = 0.05  # an idle worker's load report interval
EXPIRY_CHECK_S = 0.05  # how often client deadlines are checked (a deadline is met this late at most)
# How often freed heap memory goes back to the OS (``release_heap``). glibc keeps what a long
# prefill's activations freed (100-200 MB here) in its arenas and reuses it unevenly, so a
# serving worker's RSS creeps for hours without it (the soak, issue 16); a trim costs ~ms.
TRIM_S = 30.0
# How often a status re-reads the process's RSS and PSS (/proc/self/smaps_rollup: ~0.1-1 ms,
# too much for every 50 ms heartbeat, nothing every few seconds).
MEMORY_REFRESH_S = 5.0


def release_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc ``malloc_trim``); False where the C
    library has none (musl, macOS): nothing to do there."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def load_memory(engine: Any) -> Memory | None:
    """The engine's memory account (engine.memory.account, by category) and this process's
    figures, now: called once the model is up, so its peak RSS is the loading peak. None if the
    account fails (it walks the engine's objects: a new layout must not stop a worker)."""
    try:
        gb = account(engine).gb()
    except Exception:
        log.exception("memory account failed; serving without it")
        return None
    proc = process_memory()
    return Memory(weights_gb=gb["weights"], packed_copies_gb=gb["packed_copies"], kv_cache_gb=gb["kv_cache"],
                  other_gb=gb["other"], rss_gb=proc["rss_gb"], pss_gb=proc["pss_gb"], peak_rss_gb=proc["peak_rss_gb"])


class StepLoop:
    """Drives ``worker.step()`` in a thread. ``worker`` needs ``engine``, ``step``, ``close``.

    Subclasses turn ``step()``'s result into records (``_records``) and may say when there is
    work beyond the engine's own (``_busy``). Actor methods that touch the worker go through
    :meth:`_call`: the loop runs them between two steps, in arrival order, so a busy loop never
    starves them (a plain lock would let the loop take it back step after step).
    """

    role = "worker"

    def _start(self, worker: Any, options: WorkerOptions) -> None:
        """Start stepping ``worker``; with ``options.router`` push reports there, with
        ``options.metrics`` serve ``/metrics``."""
        self.worker = worker
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
        self.inbox: collections.deque[tuple[Any, Future | Key]] = collections.deque()  # (fn, waiter or key)
        self.outbox: list[Record] = []
        self.keys: dict[str, Key] = {}  # engine id -> key, while the request is here
        self.deadlines: dict[str, float] = {}  # engine id -> when the client stops waiting
        self._next_expiry = 0.0
        self.admitted = 0  # calls that brought a request here (WorkerStatus.admitted)
        self._seq = 0  # reports sent (Report.seq)
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
        self.running = True
        self.loop = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self.loop.start()

    # ---- records -----------------------------------------------------------------------------
    def _admit(self, key: Key, timeout_s: float | None = None) -> str:
        """A request arrives here under ``key`` (counted: the router holds its reservation until
        a status shows it), to be dropped ``timeout_s`` from now (the client's deadline; None:
        none); returns its engine id."""
        self.admitted += 1
        self.keys[key.engine_id] = key
        if timeout_s is not None:
            self.deadlines[key.engine_id] = time.monotonic() + timeout_s
        return key.engine_id

    def _drop(self, engine_id: str) -> None:
        """Stop a request here and free its blocks (the role's abort; idempotent). Runs on the
        loop thread."""
        raise NotImplementedError

    def abort(self, key: Key) -> None:
        """The router's abort of one attempt (queued behind the calls before it)."""
        self._post(lambda: self._drop(key.engine_id), key)

    def release(self, engine_ids: list[str]) -> int:
        """Drop these requests (the router's sweep: they hold blocks but no live request owns
        them); returns the blocks that freed."""
        def release() -> int:
            before = self.worker.engine.block_manager.num_used_blocks
            for eid in engine_ids:
                self._drop(eid)
            return before - self.worker.engine.block_manager.num_used_blocks
        return self._call(release)

    def _expire(self, now: float) -> None:
        """Drop requests whose client deadline passed (checked every ``EXPIRY_CHECK_S``)."""
        if now < self._next_expiry or not self.deadlines:
            return
        self._next_expiry = now + EXPIRY_CHECK_S
        for eid, at in list(self.deadlines.items()):
            key = self.keys.get(eid)
            if key is None:  # it left
                del self.deadlines[eid]
            elif now >= at:
                del self.deadlines[eid]
                log.info("rid=%s attempt=%d event=deadline worker=%s", key.request_id, key.attempt, self.worker_id)
                # No record: the router, which passed the deadline on, gave up on it first.
                self._drop(eid)

    def _tokens(self, o: RequestOutput, leaves: bool) -> Tokens | None:
        """The record of one step's output; ``leaves``: the request is done here. None for a
        request this loop does not know (a bug, logged: it must not end the worker)."""
        key = self.keys.pop(o.request_id, None) if leaves else self.keys.get(o.request_id)
        if key is None:
            log.error("output for unknown request %r dropped", o.request_id)
            return None
        return Tokens(key, len(o.token_ids) - len(o.new_token_ids), list(o.new_token_ids), o.new_text,
                      o.finish_reason if o.finished else None, o.num_prompt_tokens, o.num_cached_tokens,
                      o.new_logprobs, o.prompt_logprobs)

    def _failed(self, engine_id: str, error: str, invalid: bool = False) -> Failed | None:
        """The record of a request dropped here (None if it already left)."""
        key = self.keys.pop(engine_id, None)
        return None if key is None else Failed(key, error, invalid)

    def _records(self, step_result: Any) -> list[Record | None]:
        return [self._tokens(o, o.finished) for o in step_result]

    def _busy(self) -> bool:
        return self.worker.engine.scheduler.has_work()

    # ---- calls from the actor ----------------------------------------------------------------
    def _call(self, fn: Any) -> Any:
        """Run ``fn()`` on the loop thread between two steps; returns its result or raises."""
        fut: Future = Future()
        self.inbox.append((fn, fut))
        return fut.result()

    def _post(self, fn: Any, key: Key) -> None:
        """Queue ``fn()`` for the loop and return at once (so a burst of calls is taken in one
        step, not one per step); if it raises, the router gets a ``Failed`` record for ``key``."""
        self.inbox.append((fn, key))

    def _run_inbox(self) -> None:
        while self.inbox:
            fn, waiter = self.inbox.popleft()
            try:
                result = fn()
            except Exception as e:  # bad input for the caller (e.g. InvalidRequestError)
                if isinstance(waiter, Future):
                    waiter.set_exception(e)
                else:
                    self.keys.pop(waiter.engine_id, None)
                    self.outbox.append(Failed(waiter, str(e), isinstance(e, InvalidRequestError)))
                continue
            if isinstance(waiter, Future):
                waiter.set_result(result)

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        sink = self._connect() if self.options.router is not None else None
        try:
            self._loop(sink)
        except BaseException:  # a bug: die loudly so Ray restarts the actor and the router re-runs
            log.exception("step loop failed; exiting the worker process")
            os._exit(1)
        finally:
            if sink is not None:
                sink.close(linger=1000)

    def _loop(self, sink: Any) -> None:
        last_beat = 0.0
        next_trim = time.monotonic() + TRIM_S
        while self.running:
            with self.lock:
                if self.inbox:
                    self._run_inbox()
                    if sink is not None:  # new work: show it before a step that may take seconds
                        self._send(sink, time.monotonic())
                        last_beat = time.monotonic()
                self._expire(time.monotonic())
                busy = self._busy()
                self.outbox.extend(r for r in self._records(self.worker.step()) if r is not None)
                now = time.monotonic()
                # Outputs go at once; an idle worker still reports its load (a heartbeat).
                if sink is not None and (self.outbox or now - last_beat >= HEARTBEAT_S):
                    self._send(sink, now)
                    last_beat = now
            if time.monotonic() >= next_trim:  # between steps, outside the lock: calls go on
                release_heap()
                next_trim = time.monotonic() + TRIM_S
            if not busy and not self.inbox:
                time.sleep(0.0005)  # idle: keep polling the network, give the core back

    def _send(self, sink: Any, now: float) -> None:
        """Push the outbox and the current status (with the lock held)."""
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
        self.keys.pop(r.key.engine_id, None)
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
        return self._call(take)

    def status(self) -> WorkerStatus:
        return self._call(self._status)

    def inject(self, kind: str) -> None:
        """Chaos testing: a fault in this worker's next KV message (kvtransfer's
        ``KVSender.inject``). Refused unless the cluster enabled ``kv_transfer.fault_injection``."""
        if not self.options.faults:
            raise PermissionError("fault injection is off (kv_transfer.fault_injection)")
        sender = getattr(self.worker, "sender", None)
        if sender is None:
            raise ValueError(f"a {self.role} worker sends no KV: inject faults on a prefill worker")
        self._call(lambda: sender.inject(kind))

    def held(self) -> dict[str, int]:
        """KV blocks held per request here, by engine id (the router's leak check)."""
        return self._call(lambda: {rid: len(r.block_ids) for rid, r in self.worker.engine.scheduler.requests.items()
                                   if r.block_ids})

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
            admitted=self.admitted, metrics_address=self.metrics_address,
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
