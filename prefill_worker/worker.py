"""Prefill worker core: runs prompts and streams their KV, layer by layer, to decode workers.

Lifecycle of a request here (the engine's queues plus one table):
    submit() -> engine waiting -> running (prompt chunks; after each layer of each chunk its
    KV goes to the decode worker) -> prefilled (first token out, and to the decode worker as
    the transfer's trailer; blocks held) -> the transfer ends (ack or failure) -> released
    (blocks freed).
``transfers`` maps engine id -> (decode address, tokens sent so far); a request is known here
by its engine id (``worker.protocol``: the engine's request id and the KV transfer's id). The Ray actor around
this class (the cluster issue) only forwards calls; everything here is testable in-process.

Where a layer's KV is gathered and sent: on the step's own thread between two layers
(default), or with ``transfer_thread`` on a thread of its own while the next layers compute
(``kv_stream.py``), which pays only where that thread has a core the forward does not use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams
from engine.scheduler import StepPlan
from kvtransfer.auth import PlaneAuth
from kvtransfer.base import LEASE_S, FrameTransport, KVLayout, TransferState
from kvtransfer.sender import KVSender
from prefill_worker.kv_stream import LayerJob, LayerStreamer, send_job
from worker.protocol import Reservation

log = logging.getLogger("pdserve.worker")
CONNECT_ON_SUBMIT_S = 5.0  # a handshake in the step loop: short, it holds every other request meanwhile
UNREACHABLE_S = 10.0  # after a failed one, submits to that address fail at once this long (no stall per submit)


@dataclass
class _Outgoing:
    address: str
    start: int = 0  # the first position the decode side lacks (it holds a cached prefix before it)
    sent: int = 0  # tokens whose KV has been queued for every layer


class PrefillWorker:
    """Engine + KV sender. Drive it with :meth:`step`; never blocks but in a handshake
    (``connect``, or ``submit`` to a decode worker not connected yet, bounded)."""

    def __init__(self, engine: LLMEngine, transport: FrameTransport, lease_s: float = LEASE_S,
                 auth: PlaneAuth | None = None, transfer_thread: bool = False,
                 transfer_cpus: set[int] | None = None) -> None:
        self.engine = engine
        self.sender = KVSender(transport, KVLayout.of_engine(engine), lease_s=lease_s, auth=auth)
        self.transfers: dict[str, _Outgoing] = {}
        self.streamer = (LayerStreamer(self.sender, engine.runner.kv_caches, engine.block_manager.block_size,
                                       transfer_cpus) if transfer_thread else None)
        self._unreachable: dict[str, float] = {}  # decode address -> until when a submit to it fails at once

    def connect(self, decode_address: str) -> None:
        """Handshake with a decode worker (blocks until it answers; once per worker)."""
        self.sender.connect(decode_address)

    def disconnect(self, decode_address: str) -> None:
        """Forget a decode worker that is gone (its transfers fail; its tables go)."""
        self.sender.disconnect(decode_address)

    def submit(self, engine_id: str, prompt_ids: list[int], params: SamplingParams,
               decode_address: str, reservation: Reservation | None = None) -> None:
        """Queue a prompt whose KV goes to the decode worker at ``decode_address`` (connected
        here first if it is not yet), which has already reserved blocks for it
        (``DecodeWorker.reserve``, whose ``reservation`` says the transfer's secret and the
        first position to send: the whole prompt is computed here, only the rest is sent).

        Raises:
            ValueError: a reservation that starts outside the prompt (nothing admitted).
        """
        r = reservation or Reservation()
        if not 0 <= r.token_start < len(prompt_ids):
            raise ValueError(f"reservation starts at position {r.token_start}, outside the prompt's "
                             f"{len(prompt_ids)} tokens")
        if not self.sender.connected(decode_address):
            # Never connected (it came up while this worker was coming up, so neither side's
            # bring-up paired them): handshake now, bounded; a failure fails this request only,
            # and for UNREACHABLE_S the next ones at once (the loop must not stall per submit).
            key = self.sender.transport.identity(decode_address)  # (every address it has had)
            if time.monotonic() < self._unreachable.get(key, 0.0):
                raise ConnectionError(f"KV receiver {decode_address} did not answer a handshake just now")
            try:
                self.sender.connect(decode_address, timeout_s=CONNECT_ON_SUBMIT_S)
            except Exception:
                now = time.monotonic()  # (expired entries go: the table stays as small as the churn)
                self._unreachable = {a: t for a, t in self._unreachable.items() if t > now}
                self._unreachable[key] = now + UNREACHABLE_S
                raise
            self._unreachable.pop(key, None)
        self.engine.add_request(prompt_ids, params, request_id=engine_id, prefill_only=True)
        try:
            self.sender.begin(engine_id, decode_address, len(prompt_ids) - r.token_start, token_start=r.token_start,
                              secret=r.secret or None)
        except ValueError:
            self.engine.abort(engine_id)  # never half-admitted: its blocks go back at once
            raise
        self.transfers[engine_id] = _Outgoing(decode_address, start=r.token_start)

    def abort(self, engine_id: str) -> None:
        """Stop a request here and fail its transfer (the decode side frees its blocks)."""
        if engine_id in self.transfers:
            self.sender.abort(engine_id)
        self.engine.abort(engine_id)

    def _send_layer(self, layer: int, plan: StepPlan) -> None:
        """The engine's ``layer_done`` hook: send (or, with the transfer thread, queue) this
        layer's new KV of every request of the step that has a transfer."""
        bs = self.engine.block_manager.block_size
        last = layer == len(self.engine.runner.kv_caches) - 1
        for s in plan.scheduled:
            req = s.request
            t = self.transfers.get(req.request_id)
            if t is None:
                continue
            # A prefix-cache hit was never computed here: its KV goes with the first chunk. What
            # the decode side holds (before t.start) is never sent: a chunk wholly inside it sends nothing.
            start = max(t.start, 0 if t.sent == 0 else req.num_computed_tokens)
            end = req.num_computed_tokens + s.num_new_tokens
            job = LayerJob(req.request_id, layer, tuple(req.block_ids), start, end)
            if start < end and self.streamer is not None:
                self.streamer.put(job)
            elif start < end:
                try:
                    send_job(self.sender, self.engine.runner.kv_caches, bs, job)
                except Exception as e:  # one request's bad transfer (e.g. an id its header cannot hold)
                    self._transfer_failed(req.request_id, e)
                    continue
            if last:
                t.sent = end
        if self.streamer is None:
            self.sender.progress()

    def _transfer_failed(self, engine_id: str, error: Exception) -> None:
        """A request whose KV could not be sent: its transfer FAILS (the step after aborts it
        and frees its blocks). It fails that request only, never the step (i.e. the worker)."""
        log.warning("engine_id=%s event=transfer_error error=%r", engine_id, error)
        if self.transfers.pop(engine_id, None) is not None:
            self.sender.abort(engine_id)

    def step(self, beat: Callable[[], None] | None = None
             ) -> tuple[list[RequestOutput], list[tuple[str, TransferState]]]:
        """One engine step with KV streaming, then transfer bookkeeping; ``beat`` is called
        between layers (the step loop's mid-step report).

        Returns:
            (outputs: first tokens, finish_reason "prefilled" — or a normal finish when the
            first token already ends the request; transfers that ended: their blocks are freed)
        """
        try:
            # (no transfer: a step of requests decoding here, on an adaptive worker, streams nothing)
            send = self._send_layer if self.transfers else None

            def layer_done(i: int, plan) -> None:
                if send is not None:
                    send(i, plan)
                if beat is not None:
                    beat()
            hook = layer_done if send is not None or beat is not None else None
            outputs = self.engine.step(layer_done=hook) if self.engine.scheduler.has_work() else []
        finally:  # every queued layer is out before any block may move, even after an error
            errors = self.streamer.flush() if self.streamer is not None else {}
        for eid, e in errors.items():
            self._transfer_failed(eid, e)
        for o in outputs:  # the first token follows the last layer's KV: decode starts from both
            if o.request_id in self.transfers and o.new_token_ids:
                self.sender.end(o.request_id, {"first_token": o.new_token_ids[0]})
        self.sender.progress()
        ended = self.sender.pop_finished()
        for eid, _ in ended:
            self.transfers.pop(eid, None)
            # A prefilled request's blocks are freed now; one still prefilling (its transfer
            # failed early) stops and frees them too; one aborted meanwhile is already freed.
            if not self.engine.release(eid):
                self.engine.abort(eid)
        return outputs, ended

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()  # before the transport it sends on
        self.sender.close()
