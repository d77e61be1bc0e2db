"""KV transfer interfaces: cache layouts, transfer states, and the frame transport.

kvtransfer knows tensors and bytes, not requests. A transfer moves the KV of a token range of
one sequence, layer by layer, from a sender's paged cache into blocks a receiver reserved:

    receiver (decode)                          sender (prefill)
    reserve blocks, expect(transfer_id) ─┐
                                         └──►  begin(transfer_id, receiver address)
                                               send_layer(i) as soon as layer i is computed
    scatter each frame into its blocks  ◄────  frames: [header, K bytes, V bytes]
    (if expected) keep the trailer      ◄────  end(transfer_id, trailer): a small map after
                                               the last layer (decode: the first token)
    all layers (+ trailer) in: DONE, ack ───►  DONE: free own blocks
    corrupt frame, or end in with KV missing,
    or the connection dropped: FAILED, fail ─► FAILED at once (a dropped connection: both
                                               sides notice it, where the transport can tell)
    lease deadline passed: FAILED, free        ack lost / receiver dead: FAILED after the lease

Transports only move messages (lists of buffers) between endpoints; the lifecycle above is
written once on top of them, so every transport behaves the same.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Buffer = bytes | bytearray | memoryview


class TransferState(enum.Enum):
    """Polled state of one transfer, on either side. DONE and FAILED are final."""

    WAITING = "waiting"  # set up, no frame moved yet
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True)
class KVLayout:
    """One side's paged KV cache, as advertised in the handshake.

    Attributes:
        fingerprint: hash of the model architecture (``ModelConfig.fingerprint()``); the two
            sides must agree or the transfer is refused.
        num_layers, num_kv_heads, head_dim: the model's KV shape (all heads of the model).
        head_start, head_end: the head shard this side holds (tensor parallelism); the whole
            range [0, num_kv_heads) without it.
        block_size: tokens per block on this side (the wire format does not depend on it).
        dtype: "float32", "bfloat16" or "float16".
    """

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    head_start: int = 0
    head_end: int = -1  # -1: num_kv_heads

    @property
    def heads(self) -> tuple[int, int]:
        return self.head_start, (self.num_kv_heads if self.head_end < 0 else self.head_end)

    @classmethod
    def of_engine(cls, engine) -> KVLayout:
        """The layout of an ``engine.llm_engine.LLMEngine``'s cache (all heads)."""
        mc = engine.model_config
        return cls(mc.fingerprint(), mc.num_layers, mc.num_kv_heads, mc.head_dim,
                   engine.block_manager.block_size, engine.config.dtype)


MAX_ENDED = 4096  # popped transfer ids remembered to recognise late messages
# Drop reports kept for a caller that does not drain ``FrameTransport.dropped`` (a benchmark
# loop): far more than one loop iteration can produce, and never unbounded memory.
MAX_DROP_REPORTS = 1024
# The default lease, on both sides: seconds of silence (no frame, no renewal) after which a
# transfer fails and its blocks are freed. Long: a live sender renews it while its prompt
# waits, and the router frees a lost worker's blocks itself; the lease is the last resort.
LEASE_S = 120.0


@dataclass
class TransferStats:
    """Totals since start, for metrics. ``seconds``: first byte to completion, DONE ones only."""

    done: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    forged: int = 0  # messages dropped for a missing or wrong MAC (kvtransfer.auth)

    def as_dict(self) -> dict:
        return {"done": self.done, "failed": self.failed, "bytes": self.bytes, "seconds": self.seconds,
                "forged": self.forged}

    def __add__(self, other: TransferStats) -> TransferStats:
        """Both sides' totals in one (a worker that sends and receives); a new object."""
        return TransferStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class TransferTable:
    """The bookkeeping sender and receiver share: live transfers, newly final ones, and a
    bounded memory of popped ones (so a late message is told from an unknown id).

    Subclasses call :meth:`_init_table` and keep objects with ``.state`` and ``.error`` in
    ``_transfers``; they append an id to ``_finished`` when its transfer turns final.
    """

    def _init_table(self) -> None:
        self.stats = TransferStats()
        self._first_byte: dict[str, float] = {}  # live transfer id -> when its first KV moved
        self._transfers: dict = {}
        self._finished: list[str] = []
        self._ended: OrderedDict[str, tuple[TransferState, str | None]] = OrderedDict()

    def _moved(self, transfer_id: str, nbytes: int) -> None:
        """Count KV bytes of a transfer that just went out or came in."""
        self.stats.bytes += nbytes
        self._first_byte.setdefault(transfer_id, self._clock())

    def poll(self, transfer_id: str) -> TransferState:
        """State of a transfer (no I/O: call ``progress`` to advance it).

        Raises:
            KeyError: never started here, or popped so long ago it is forgotten.
        """
        if transfer_id in self._transfers:
            return self._transfers[transfer_id].state
        if transfer_id in self._ended:
            return self._ended[transfer_id][0]
        raise KeyError(f"unknown transfer {transfer_id!r}")

    def error(self, transfer_id: str) -> str | None:
        """Why a transfer FAILED (None unless it did)."""
        t = self._transfers.get(transfer_id)
        return t.error if t is not None else self._ended.get(transfer_id, (None, None))[1]

    def forget(self, transfer_id: str) -> None:
        """Take a final transfer out of the live table without ``pop_finished`` reporting it:
        its owner is done with it (aborted its request), and its id may be used again at once
        (a re-placed request is reserved under the same id right after its abort). No-op for a
        transfer still live or unknown."""
        t = self._transfers.get(transfer_id)
        if t is None or not t.state.is_final:
            return
        del self._transfers[transfer_id]
        if transfer_id in self._finished:
            self._finished.remove(transfer_id)
        self._first_byte.pop(transfer_id, None)
        self.stats.failed += t.state == TransferState.FAILED
        self._ended[transfer_id] = (t.state, t.error)
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def pop_finished(self) -> list[tuple[str, TransferState]]:
        """Transfers that became DONE or FAILED since the last call, in order; they leave the
        live table. The caller frees or admits their blocks now."""
        out = []
        now = self._clock()
        for tid in self._finished:
            t = self._transfers.pop(tid)
            out.append((tid, t.state))
            started = self._first_byte.pop(tid, None)
            if t.state == TransferState.DONE:
                self.stats.done += 1
                self.stats.seconds += now - started if started is not None else 0.0
            else:
                self.stats.failed += 1
            self._ended[tid] = (t.state, t.error)
        self._finished.clear()
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        return out


class FrameTransport(ABC):
    """Moves messages (lists of buffers) between endpoints, never blocking the caller for long.

    Every endpoint can ``bind`` (to be reachable at an address) and ``connect`` to others'
    addresses. Messages are delivered whole and in order per peer. ``recv`` returns the next
    message from any peer with that peer's id, so a receiver can reply (ack) to the sender.

    ``device_frames`` says whether ``send`` also takes GPU buffers (``__cuda_array_interface__``
    objects) and ``recv`` may return frames as CUDA tensors; only then do senders keep KV on
    the GPU (``encode_frames(keep_on_device=True)``).

    Connections. A transport that can tell when its connection with a peer dropped (closed or
    reset by the other side, a failed request, a queue over its bound) forgets that peer's
    connection and reports it by :meth:`dropped`; ``recv`` returns None before any message
    that follows a drop, so a caller that calls ``dropped`` whenever ``recv`` returns None
    handles each drop before what came after it. A later ``connect`` opens a fresh connection.
    What each transport notices is in its module docstring; what none notices (a peer that
    died silently), the lifecycle's lease does.
    """

    name = "base"
    device_frames: bool = False

    @abstractmethod
    def bind(self) -> str:
        """Start accepting peers; returns the address others ``connect`` to (the newest, where
        a transport's address can change: ``ucx/transport.py``)."""

    def identity(self, address: str) -> str:
        """What stays the same across every address one peer has had: the key to know a peer
        by (the address itself, unless the transport's addresses change)."""
        return address

    @abstractmethod
    def connect(self, address: str) -> str:
        """Open a path to the endpoint at ``address``; returns its peer id for ``send``."""

    @abstractmethod
    def send(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Queue one message for ``peer``. Buffers must stay unchanged until sent."""

    @abstractmethod
    def recv(self) -> tuple[str, list[Buffer]] | None:
        """Next complete message as (peer id, frames), or None if none is waiting."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Close this side's connection with ``peer`` and forget every table entry kept for it
        (messages still queued to it are dropped); the peer may notice it as a drop. No-op for
        a peer this side does not know. A later ``connect`` to its address starts afresh."""

    @abstractmethod
    def dropped(self) -> list[tuple[str, str]]:
        """Peers whose connection dropped since the last call, in order, as (peer id, why).
        Their connection state is already forgotten, as after :meth:`disconnect`."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets/endpoints. Safe to call twice."""


TRANSPORTS: dict[str, Callable[..., FrameTransport]] = {}


def register_transport(name: str, factory: Callable[..., FrameTransport]) -> None:
    TRANSPORTS[name] = factory


def get_transport(name: str, **kwargs) -> FrameTransport:
    """Build the transport registered as ``name``; unknown names list the valid ones."""
    _load_builtin()
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; valid: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](**kwargs)


# The transports that ship with pdserve (name -> module that registers it): what a config may name.
BUILTIN_TRANSPORTS = {"ucx": "kvtransfer.ucx.transport", "zmq": "kvtransfer.zmq_transport", "inproc": "kvtransfer.inproc"}


def _load_builtin() -> None:
    # Transports register themselves on import; import lazily so a missing optional
    # dependency (ucxx) only matters to whoever asks for that transport. Any other import
    # error is a bug and surfaces.
    import importlib
    for mod in BUILTIN_TRANSPORTS.values():
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if mod != BUILTIN_TRANSPORTS["ucx"] or (e.name or "").split(".")[0] not in ("ucxx", "rmm"):
                raise
