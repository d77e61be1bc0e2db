"""Adaptive worker core: one engine, a KV sender and a KV receiver, so the same worker can
prefill for others (its KV goes out, as a prefill worker's), decode what others prefilled (as
a decode worker's), and prefill and decode its own requests (as a colocated worker's).

Which of these it is asked to do is the router's choice (its *role*, ``router/roles.py``);
the worker itself has no role, so switching one costs no restart: it keeps its weights, its
compiled graphs and its prefix cache, and what it took in the old role finishes here.

Lifecycle of a request: as in ``prefill_worker.worker`` for one submitted with a decode
address (``submit``), as in ``decode_worker.worker`` for one reserved (``reserve``) or added
to the engine directly (a local prefill). The two sides share the engine's queues, blocks and
step; ``transfers`` (outgoing) tells the first kind from the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams
from kvtransfer.auth import PlaneAuth
from kvtransfer.base import LEASE_S, FrameTransport, TransferState
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from worker.protocol import Reservation


class AdaptiveWorker:
    """Engine + KV sender + KV receiver (each on its own transport: both read what arrives).
    Drive it with :meth:`step`; never blocks but in a handshake, as ``PrefillWorker``."""

    def __init__(self, engine: LLMEngine, send_transport: FrameTransport, recv_transport: FrameTransport,
                 lease_s: float = LEASE_S, auth: PlaneAuth | None = None, transfer_thread: bool = False,
                 transfer_cpus: set[int] | None = None) -> None:
        self.engine = engine
        self.decoder = DecodeWorker(engine, recv_transport, lease_s, auth)
        self.prefiller = PrefillWorker(engine, send_transport, lease_s, auth, transfer_thread, transfer_cpus)
        self.sender, self.receiver = self.prefiller.sender, self.decoder.receiver

    @property
    def address(self) -> str:
        """Its KV receiver's address (where prefilling workers send this worker's KV)."""
        return self.decoder.address

    @property
    def transfers(self) -> dict:
        """Outgoing transfers: engine id -> where its KV goes (``PrefillWorker.transfers``)."""
        return self.prefiller.transfers

    @property
    def failed(self) -> dict[str, str]:
        """Requests whose incoming KV failed (``DecodeWorker.failed``), until reported."""
        return self.decoder.failed

    def take_failed(self) -> dict[str, str]:
        """``DecodeWorker.take_failed``."""
        return self.decoder.take_failed()

    def connect(self, decode_address: str) -> None:
        self.prefiller.connect(decode_address)

    def disconnect(self, decode_address: str) -> None:
        self.prefiller.disconnect(decode_address)

    def reserve(self, engine_id: str, prompt_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Decode side: ``DecodeWorker.reserve``."""
        return self.decoder.reserve(engine_id, prompt_ids, params)

    def submit(self, engine_id: str, prompt_ids: list[int], params: SamplingParams, decode_address: str,
               reservation: Reservation | None = None) -> None:
        """Prefill side: ``PrefillWorker.submit``."""
        self.prefiller.submit(engine_id, prompt_ids, params, decode_address, reservation)

    def abort(self, engine_id: str) -> None:
        """Stop a request whichever side holds it (its transfers fail: peers free their blocks)."""
        if engine_id in self.prefiller.transfers:
            self.prefiller.abort(engine_id)
        self.decoder.abort(engine_id)

    def step(self, beat: Callable[[], None] | None = None
             ) -> tuple[list[RequestOutput], list[RequestOutput], list[tuple[str, TransferState]]]:
        """Receive and admit KV, run one engine step (streaming the KV of what it prefills for
        others), then transfer bookkeeping.

        Returns:
            (outputs of requests decoding here, first tokens of requests prefilled for other
            workers, outgoing transfers that ended: their blocks are freed); ``beat`` as in
            ``PrefillWorker.step``
        """
        outputs = self.decoder.receive()
        sending = set(self.prefiller.transfers)  # (submits come between steps: this is every one)
        stepped, ended = self.prefiller.step(beat)
        outputs += [o for o in stepped if o.request_id not in sending]
        return outputs, [o for o in stepped if o.request_id in sending], ended

    def close(self) -> None:
        self.prefiller.close()
        self.decoder.close()
