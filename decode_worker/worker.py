"""Decode worker core: reserves blocks, receives KV from prefill workers, decodes.

Lifecycle of a request here:
    reserve() -> engine receiving (blocks reserved, a cached prefix shared, the rest's KV
    expected under a lease) -> the transfer
    is DONE: every layer's KV and its trailer, the prefill's first token -> engine waiting ->
    running (continuous batch) -> finished (blocks freed). A FAILED transfer (lease, bad frame,
    abort) or a first token the engine refuses aborts the request and frees its blocks
    (``failed``: id -> why, until the runtime reports them). The Ray actor around it forwards.
"""

from __future__ import annotations

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
        self.failed: dict[str, str] = {}

    @property
    def address(self) -> str:
        return self.receiver.address

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Reserve blocks for the prompt's KV and expect its transfer: only the part after a
        prefix this worker's cache already holds (it is shared, not sent again).

        Returns:
            What the prefill side's ``submit`` needs (the transfer's secret, the first
            position to send); None: not now.
        """
        slot = self.engine.add_remote(prompt_ids, params, request_id=request_id)
        if slot is None:
            return None
        try:
            secret = self.receiver.expect(request_id, slot.block_ids, len(prompt_ids) - slot.token_start,
                                          token_start=slot.token_start, trailer=True)
        except ValueError:  # (a bug if ever seen: the engine sized the blocks) never hold them
            self.engine.abort(request_id)
            raise
        return Reservation(secret or b"", slot.token_start)

    def abort(self, request_id: str) -> None:
        """Fail the transfer first (late frames are then dropped), then free the blocks. The
        transfer is forgotten at once: the router may reserve again under the same id (a
        placement undone because its prefill worker was lost meanwhile), and a late report of
        the old one would fail the new request."""
        try:
            self.receiver.abort(request_id)
        except KeyError:
            pass
        self.receiver.forget(request_id)
        self.receiver.take_trailer(request_id)
        self.engine.abort(request_id)

    def _admit(self, rid: str, trailer: dict | None) -> list[RequestOutput]:
        """Start decoding after the prefill's first token (from the transfer's trailer)."""
        token = trailer.get("first_token") if trailer is not None else None
        try:
            out = self.engine.kv_arrived(rid, first_token=token if type(token) is int else -1)
        except InvalidRequestError as e:  # a token outside the vocabulary, or none
            self.failed[rid] = f"bad first token from the prefill worker: {e}"
            self.engine.abort(rid)
            return []
        except KeyError:  # no longer waiting for its KV (a bug if ever seen): never end the step
            self.failed[rid] = "its KV arrived for a request not waiting for it"
            self.engine.abort(rid)
            return []
        return [out] if out is not None else []

    def receive(self) -> list[RequestOutput]:
        """Receive KV and admit the requests whose transfer is complete (outputs: a first
        token that already ends its request); a failed transfer aborts its request."""
        self.receiver.progress()
        outputs: list[RequestOutput] = []
        for rid, state in self.receiver.pop_finished():
            if state == TransferState.DONE:
                outputs += self._admit(rid, self.receiver.take_trailer(rid))
            else:
                self.failed[rid] = self.receiver.error(rid) or "transfer failed"
                self.engine.abort(rid)
        return outputs

    def step(self) -> list[RequestOutput]:
        """Receive KV, admit what is complete, run one decode step; returns new tokens."""
        outputs = self.receive()
        if self.engine.scheduler.has_work():
            outputs += self.engine.step()
        return outputs

    def close(self) -> None:
        self.receiver.close()
