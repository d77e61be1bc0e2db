"""Decode worker core: reserves blocks, receives KV from prefill workers, decodes.

Lifecycle of a request here:
    reserve() -> engine receiving (blocks reserved, a cached prefix shared, the rest's KV
    expected under a lease) -> the transfer
    is DONE: every layer's KV and its trailer, the prefill's first token -> engine waiting ->
    running (continuous batch) -> finished (blocks freed). A FAILED transfer (lease, bad frame,
    abort) or a first token the engine refuses aborts the request and frees its blocks
    (``failed``: engine id -> why, until the runtime takes them). The Ray actor around it forwards.

Requests are known here by their engine id (``worker.protocol``: the engine's request id and
the KV transfer's id are the same value).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams
from kvtransfer.auth import PlaneAuth
from kvtransfer.base import LEASE_S, FrameTransport, KVLayout, TransferState
from kvtransfer.receiver import KVReceiver
from worker.protocol import Reservation


class DecodeWorker:
    """Engine + KV receiver. Drive it with :meth:`step`; never blocks."""

    def __init__(self, engine: LLMEngine, transport: FrameTransport, lease_s: float = LEASE_S,
                 auth: PlaneAuth | None = None) -> None:
        self.engine = engine
        self.receiver = KVReceiver(transport, KVLayout.of_engine(engine), engine.runner.kv_caches, lease_s=lease_s,
                                   auth=auth)
        self.failed: dict[str, str] = {}  # engine id -> why, until ``take_failed``

    @property
    def address(self) -> str:
        return self.receiver.address

    def take_failed(self) -> dict[str, str]:
        """The requests that failed here since the last call (engine id -> why)."""
        failed, self.failed = self.failed, {}
        return failed

    def reserve(self, engine_id: str, prompt_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Reserve blocks for the prompt's KV and expect its transfer: only the part after a
        prefix this worker's cache already holds (it is shared, not sent again).

        Returns:
            What the prefill side's ``submit`` needs (the transfer's secret, the first
            position to send); None: not now.
        """
        slot = self.engine.add_remote(prompt_ids, params, request_id=engine_id)
        if slot is None:
            return None
        try:
            secret = self.receiver.expect(engine_id, slot.block_ids, len(prompt_ids) - slot.token_start,
                                          token_start=slot.token_start, trailer=True)
        except ValueError:  # (a bug if ever seen: the engine sized the blocks) never hold them
            self.engine.abort(engine_id)
            raise
        return Reservation(secret or b"", slot.token_start)

    def abort(self, engine_id: str) -> None:
        """Fail the transfer first (late frames are then dropped), then free the blocks. The
        transfer is forgotten at once: the router may reserve again under the same id (a
        placement undone because its prefill worker was lost meanwhile), and a late report of
        the old one would fail the new request."""
        try:
            self.receiver.abort(engine_id)
        except KeyError:
            pass
        self.receiver.forget(engine_id)
        self.receiver.take_trailer(engine_id)
        self.engine.abort(engine_id)

    def _start_decoding(self, eid: str, trailer: dict | None) -> list[RequestOutput]:
        """Start decoding after the prefill's first token (from the transfer's trailer)."""
        token = trailer.get("first_token") if trailer is not None else None
        try:
            out = self.engine.kv_arrived(eid, first_token=token if type(token) is int else -1)
        except InvalidRequestError as e:  # a token outside the vocabulary, or none
            self.failed[eid] = f"bad first token from the prefill worker: {e}"
            self.engine.abort(eid)
            return []
        except KeyError:  # no longer waiting for its KV (a bug if ever seen): never end the step
            self.failed[eid] = "its KV arrived for a request not waiting for it"
            self.engine.abort(eid)
            return []
        return [out] if out is not None else []

    def receive(self) -> list[RequestOutput]:
        """Receive KV and admit the requests whose transfer is complete (outputs: a first
        token that already ends its request); a failed transfer aborts its request."""
        self.receiver.progress()
        outputs: list[RequestOutput] = []
        for eid, state in self.receiver.pop_finished():
            if state == TransferState.DONE:
                outputs += self._start_decoding(eid, self.receiver.take_trailer(eid))
            else:
                self.failed[eid] = self.receiver.error(eid) or "transfer failed"
                self.engine.abort(eid)
        return outputs

    def step(self, beat: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Receive KV, admit what is complete, run one decode step; returns new tokens.
        ``beat`` is called between layers (the step loop's mid-step report: a colocated worker's
        prompt chunk may take long)."""
        outputs = self.receive()
        if self.engine.scheduler.has_work():
            outputs += self.engine.step(layer_done=None if beat is None else (lambda i, plan: beat()))
        return outputs

    def close(self) -> None:
        self.receiver.close()
