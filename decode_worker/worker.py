"""Decode worker core: reserves blocks, receives KV from prefill workers, decodes.

Lifecycle of a request here:
    reserve() -> engine receiving (blocks reserved, KV expected under a lease)
    -> the transfer is DONE and the first token known -> engine waiting -> running (continuous
    batch) -> finished (blocks freed). A FAILED transfer (lease, bad frame, abort) aborts the
    request and frees its blocks. ``first_tokens`` and ``arrived`` hold the two halves until
    both are in, whichever comes first. The Ray actor around it (the cluster issue) forwards.
"""

from __future__ import annotations

from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams
from kvtransfer.base import FrameTransport, KVLayout, TransferState
from kvtransfer.receiver import KVReceiver


class DecodeWorker:
    """Engine + KV receiver. Drive it with :meth:`step`; never blocks."""

    def __init__(self, engine: LLMEngine, transport: FrameTransport, lease_s: float = 30.0) -> None:
        self.engine = engine
        self.receiver = KVReceiver(transport, KVLayout.of_engine(engine), engine.runner.kv_caches, lease_s=lease_s)
        self.first_tokens: dict[str, int] = {}
        self.arrived: set[str] = set()
        self.failed: dict[str, str] = {}

    @property
    def address(self) -> str:
        return self.receiver.address

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> bool:
        """Reserve blocks for the prompt's KV and expect its transfer. False: not now."""
        blocks = self.engine.add_remote(prompt_ids, params, request_id=request_id)
        if blocks is None:
            return False
        self.receiver.expect(request_id, blocks, len(prompt_ids))
        return True

    def first_token(self, request_id: str, token: int) -> list[RequestOutput]:
        """The prefill worker's first token for ``request_id``."""
        self.first_tokens[request_id] = token
        return self._admit(request_id)

    def abort(self, request_id: str) -> None:
        """Fail the transfer first (late frames are then dropped), then free the blocks."""
        try:
            self.receiver.abort(request_id)
        except KeyError:
            pass
        self.engine.abort(request_id)
        self.first_tokens.pop(request_id, None)
        self.arrived.discard(request_id)

    def _admit(self, rid: str) -> list[RequestOutput]:
        if rid not in self.arrived or rid not in self.first_tokens:
            return []
        self.arrived.discard(rid)
        out = self.engine.kv_arrived(rid, first_token=self.first_tokens.pop(rid))
        return [out] if out is not None else []

    def step(self) -> list[RequestOutput]:
        """Receive KV, admit what is complete, run one decode step; returns new tokens."""
        self.receiver.progress()
        outputs: list[RequestOutput] = []
        for rid, state in self.receiver.pop_finished():
            if state == TransferState.DONE:
                self.arrived.add(rid)
                outputs += self._admit(rid)
            else:
                self.failed[rid] = self.receiver.error(rid) or "transfer failed"
                self.engine.abort(rid)
                self.first_tokens.pop(rid, None)
        if self.engine.scheduler.has_work():
            outputs += self.engine.step()
        return outputs

    def close(self) -> None:
        self.receiver.close()
