"""A worker core stepped by a background thread, with one lock for every outside call.

Both worker kinds' Ray actors build on it: the loop keeps stepping (engine and network)
while actor methods (reserve, submit, abort, status...) run between steps under the same lock.
Outputs leave as plain records (:func:`output_record`) in per-step batches, pushed over zmq
to the router named at start (else kept for :meth:`StepLoop.poll`), never one call per token.

Wire message on the zmq PUSH socket, after every step with outputs and at least every
``HEARTBEAT_S``: ``msgpack([worker_id, incarnation, [record, ...], status])``. The status rides
along, so the router's view of each worker's load is never older than one step, without polls.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.llm_engine import RequestOutput
from engine.quant import quantization_name
from engine.request import RequestStatus

log = logging.getLogger("pdserve.worker")

TOKEN_RATE_WINDOW_S = 5.0
HEARTBEAT_S = 0.05  # an idle worker's load report interval


def output_record(o: RequestOutput) -> dict:
    """The least state the router needs from one step's output of one request.

    ``finish`` is None while the request goes on, else ``stop``/``length``/``abort``, or
    ``prefilled`` (prefill side: the first token is out, decode goes on elsewhere).
    """
    return {"id": o.request_id, "tokens": list(o.new_token_ids), "text": o.new_text,
            "finish": o.finish_reason if o.finished else None,
            "prompt_tokens": o.num_prompt_tokens, "cached_tokens": o.num_cached_tokens}


def error_record(request_id: str, message: str, invalid: bool = False) -> dict:
    """A request this worker dropped for a reason other than its own finish (its KV transfer
    failed; or, ``invalid``, the request is bad input for this worker); its blocks are freed."""
    return {"id": request_id, "tokens": [], "text": "", "finish": "error", "error": message,
            "invalid": invalid, "prompt_tokens": 0, "cached_tokens": 0}


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker actor runs, besides its engine config."""

    transport: str = "ucx"  # KV transport by name (kvtransfer.base.get_transport)
    lease_s: float = 30.0  # KV transfer lease; the same on both sides
    threads: int = 1  # torch threads: several workers share a node's cores
    router: tuple[str, str] | None = None  # (router's zmq PULL address, this worker's id); None: poll()
    metrics: tuple[str, int] | None = None  # serve /metrics on (host, port; 0 = a free port)
    colocated: bool = False  # decode workers only: also prefill (mode: colocated)


class StepLoop:
    """Drives ``worker.step()`` in a thread. ``worker`` needs ``engine``, ``step``, ``close``.

    Subclasses turn ``step()``'s result into a list of records (``_records``) and may say when
    there is work beyond the engine's own (``_busy``). Actor methods that touch the worker go
    through :meth:`_call`: the loop runs them between two steps, in arrival order, so a busy
    loop never starves them (a plain lock would let the loop take it back step after step).
    """

    role = "worker"

    def _start(self, worker: Any, options: WorkerOptions) -> None:
        """Start stepping ``worker``; with ``options.router`` push outputs there, with
        ``options.metrics`` serve ``/metrics``."""
        self.worker = worker
        self.options = options
        root = logging.getLogger("pdserve")
        if not root.handlers:  # a worker process: its stderr goes to the Ray worker log file
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
        self.lock = threading.Lock()  # held by the loop for a whole step
        self.inbox: collections.deque[tuple[Any, Future | str]] = collections.deque()  # (fn, waiter or id)
        self.outbox: list[dict] = []
        self._snapshot: dict = {}  # the status of the last heartbeat (metrics read it lock-free)
        self.incarnation = uuid.uuid4().hex[:12]  # new after every restart of the actor
        self.router = options.router
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()
        self._generated = 0  # tokens sent to the router since start
        self.metrics_address = None
        self._metrics_server = None
        if options.metrics is not None:
            from engine.metrics import WorkerCollector, serve_metrics
            host, port = options.metrics
            labels = {"worker": options.router[1] if options.router else self.incarnation, "role": self.role}
            self._metrics_server, port = serve_metrics(WorkerCollector(labels, self._metrics_status), host, port)
            self.metrics_address = f"{host}:{port}"
        self.running = True
        self.loop = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self.loop.start()

    def _records(self, step_result: Any) -> list[dict]:
        return [output_record(o) for o in step_result]

    def _busy(self) -> bool:
        return self.worker.engine.scheduler.has_work()

    def _call(self, fn: Any) -> Any:
        """Run ``fn()`` on the loop thread between two steps; returns its result or raises."""
        fut: Future = Future()
        self.inbox.append((fn, fut))
        return fut.result()

    def _post(self, fn: Any, request_id: str) -> None:
        """Queue ``fn()`` for the loop and return at once (so a burst of calls is taken in one
        step, not one per step); if it raises, the router gets an ``error`` record for
        ``request_id``."""
        self.inbox.append((fn, request_id))

    def _run_inbox(self) -> None:
        from engine.errors import InvalidRequestError
        while self.inbox:
            fn, waiter = self.inbox.popleft()
            try:
                result = fn()
            except Exception as e:  # bad input for the caller (e.g. InvalidRequestError)
                if isinstance(waiter, Future):
                    waiter.set_exception(e)
                else:
                    self.outbox.append(error_record(waiter, str(e), invalid=isinstance(e, InvalidRequestError)))
                continue
            if isinstance(waiter, Future):
                waiter.set_result(result)

    def _metrics_status(self) -> dict:
        return self._snapshot if self.router is not None else self.status()

    def _run(self) -> None:
        sink = self._connect() if self.router is not None else None
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
        while self.running:
            with self.lock:
                if self.inbox:
                    self._run_inbox()
                    if sink is not None:  # new work: show it before a step that may take seconds
                        self._send(sink, time.monotonic())
                        last_beat = time.monotonic()
                busy = self._busy()
                self.outbox.extend(self._records(self.worker.step()))
                now = time.monotonic()
                # Outputs go at once; an idle worker still reports its load (a heartbeat).
                if sink is not None and (self.outbox or now - last_beat >= HEARTBEAT_S):
                    self._send(sink, now)
                    last_beat = now
            if not busy and not self.inbox:
                time.sleep(0.0005)  # idle: keep polling the network, give the core back

    def _send(self, sink: Any, now: float) -> None:
        """Push the outbox and the current status (with the lock held)."""
        import msgpack
        batch, self.outbox = self.outbox, []
        self._count_tokens(batch, now)
        self._log(batch)
        self._snapshot = self._status()
        sink.send(msgpack.packb([self.router[1], self.incarnation, batch, self._snapshot]))

    def _connect(self) -> Any:
        import zmq
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # tokens are never dropped; the router drains them
        sock.connect(self.router[0])
        return sock

    def _log(self, batch: list[dict]) -> None:
        """One key=value line per request that ends here; ids are ``<request id>#<attempt>``,
        the router's request id, so one grep follows a request across router and workers."""
        for r in batch:
            if r["finish"]:
                log.info("rid=%s event=%s worker=%s prompt_tokens=%d cached_tokens=%d%s", r["id"], r["finish"],
                         self.router[1] if self.router else self.incarnation, r["prompt_tokens"],
                         r["cached_tokens"], f" error={r['error']!r}" if "error" in r else "")

    def _count_tokens(self, batch: list[dict], now: float) -> None:
        n = sum(len(r["tokens"]) for r in batch)
        self._generated += n
        self._token_times.append((now, n))
        while self._token_times and self._token_times[0][0] < now - TOKEN_RATE_WINDOW_S:
            self._token_times.popleft()

    def poll(self) -> list[dict]:
        """Records since the last call (only while no router is attached)."""
        def take() -> list[dict]:
            out, self.outbox = self.outbox, []
            return out
        return self._call(take)

    def status(self) -> dict:
        """Load and identity, for placement and ``GetClusterStatus``.

        ``queued_prompt_tokens``: prompt tokens not yet computed (its TTFT backlog);
        ``remaining_decode_tokens``: tokens its requests may still generate.
        """
        return self._call(self._status)

    def _status(self) -> dict:
        eng = self.worker.engine
        bm, sch = eng.block_manager, eng.scheduler
        reqs = list(sch.requests.values())
        now = time.monotonic()
        tokens = sum(n for t, n in self._token_times if t >= now - TOKEN_RATE_WINDOW_S)
        return {
            "role": self.role, "incarnation": self.incarnation, "pid": os.getpid(),
            "metrics_address": self.metrics_address,
            "kv_blocks_used": bm.num_used_blocks, "kv_blocks_total": bm.num_blocks,
            "block_size": bm.block_size, "running": len(sch.running),
            "waiting": len(sch.waiting) + len(sch.receiving),
            "queued_prompt_tokens": sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in reqs
                                        if not r.is_finished and r.status != RequestStatus.WAITING_FOR_KV),
            "remaining_decode_tokens": sum(max(0, r.sampling_params.max_tokens - r.num_output_tokens)
                                           for r in reqs if not r.prefill_only and not r.is_finished),
            "tokens_per_s": tokens / TOKEN_RATE_WINDOW_S,
            "generated_tokens": self._generated,
            "prefix_query_tokens": bm.prefix_queries, "prefix_hit_tokens": bm.prefix_hits,
            "kv_transfer": self._transfer_stats(),
            # alpha, mean accepted tokens per verify, draft vs verify seconds (engine/spec/decoder.py)
            "speculative": eng.spec.stats() if getattr(eng, "spec", None) is not None else {},
        }

    def _transfer_stats(self) -> dict:
        side = getattr(self.worker, "sender", None) or getattr(self.worker, "receiver", None)
        return side.stats.as_dict() if side is not None else {}

    def model_info(self) -> dict:
        """What the router needs to validate requests and answer ``GetModelInfo``."""
        eng = self.worker.engine
        return {"model": str(eng.model_path), "fingerprint": eng.model_config.fingerprint(),
                "incarnation": self.incarnation, "context_length": eng.max_model_len,
                "vocab_size": eng.model_config.vocab_size, "dtype": eng.config.dtype,
                "block_size": eng.block_manager.block_size,
                "speculative": eng.spec.label if getattr(eng, "spec", None) is not None else "none",
                "quantization": quantization_name(eng.config.quantization, eng.model_path),
                "kernels": eng.kernels}

    def shutdown(self) -> None:
        self.running = False
        self.loop.join(timeout=5)
        self._run_inbox()  # nothing waits forever on a stopped loop
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.worker.close()
