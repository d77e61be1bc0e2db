"""KV receiver (decode side): scatters pushed KV frames into blocks that decode reserved.

Lifecycle of one transfer here (``TransferState``)::

    expect() ─► WAITING ──first valid frame──► TRANSFERRING ──every layer x head x token in──► DONE
                   │                                │              (and the trailer, if expected) (ack → senders)
                   └── bad or corrupt frame | KV lost in transit | a sender's connection dropped
                       | sender's fail | abort() | lease deadline passed ──► FAILED (fail → senders)

``expect`` starts the lease: ``lease_s`` of silence and the transfer is FAILED unless DONE, so
decode can always free the reserved blocks, even when the sender died silently. Each frame and
each ``renew`` (sent while the prompt is still queued at the sender) starts it over. Once a
transfer is final nothing more is written into its blocks: later frames for it are dropped.

Failing fast instead of at the lease. A transfer's *peers* are the transport peers that sent
its ``begin`` (MAC-checked with auth), a data frame or its ``end`` for it. It FAILS at once when:

- a data message names it (its header's transfer id, read as far as the header decodes) but
  cannot be accepted: a header that does not decode or a MAC that does not match ("corrupt
  KV frame"), if it comes from one of its peers; from any other peer such a message is only
  dropped and counted (``dropped_frames``, ``stats.forged``), so a stranger cannot fail others'
  transfers. A frame whose header decodes but does not fit (range, fingerprint, checksum)
  fails it as before, whoever sent it: with auth only its sender can MAC one;
- ``end`` has come from every peer sending a head while KV cells (layer x head) of that head
  are still missing: transports deliver each peer's messages in order, so those frames were
  lost ("N KV cells never arrived"). ``begin`` names the heads each peer sends; cells of heads
  whose sender has not begun yet (tensor-parallel shards) are not judged;
- the transport reports the connection of one of its peers dropped (the others are told).

Tables (exactly these): ``_transfers`` (id → live transfer, or final but not yet popped),
``_finished`` (ids that turned final, in order, drained by ``pop_finished``), ``_ended``
(recently popped ids → final state, bounded, so late messages are told from unknown ones) and
``trailers`` (DONE transfers' trailers until the caller takes them as it pops them).

Wire protocol, shared with ``sender.py``. A message of ONE frame is a control message: a small
msgpack map with a ``"type"`` field; a message of THREE frames is KV data
``[header, K bytes, V bytes]`` (``format.py``); anything else is dropped. With a ``PlaneAuth``
(``auth.py``) each message has its MAC as one more frame, and one without a valid MAC is
dropped and counted (``stats.forged``) before it can change anything: data and ``end`` are
MAC'd with the transfer's secret (``expect`` returns it), the rest with the cluster key.

    hello    {layout}                    sender → receiver; answered by hello_ok {layout}
    begin    {id, num_tokens, token_start, heads}  sender → receiver, before its frames: makes
             the sender a peer of the transfer (acked/failed with it); ``heads`` [lo, hi): the
             model heads it sends (absent: all). A begin for a transfer this side does not
             expect is answered by fail: decode must ``expect`` before prefill begins.
    end      {id, trailer}               sender → receiver after its last frame: a small map the
             receiver hands over with DONE (``take_trailer``; decode: the first token). A
             transfer expected with ``trailer=True`` is DONE only once every frame and it are in.
    ack      {id}                        receiver → senders: all KV is in; they may free
    renew    {id}                        sender → receiver while the prompt still waits in the
             sender's queue: the lease starts over (a live sender never lets it expire)
    fail     {id, reason}                either way: the transfer is FAILED (bad frame, abort,
                                         lease, dropped connection), the other side stops too
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import msgpack
import torch

from kvtransfer.auth import PlaneAuth, new_secret
from kvtransfer.base import LEASE_S, Buffer, FrameTransport, KVLayout, TransferState, TransferTable
from kvtransfer.format import FrameError, FrameHeader, decode_frames, peek_transfer_id, scatter_layer

MAX_CONTROL_BYTES = 1 << 16  # a control message is ~200 bytes; refuse to unpack more


# ---- control messages (shared with sender.py) --------------------------------------------
def encode_control(type_: str, **fields: object) -> list[bytes]:
    """One control message: a single msgpack frame ``{"type": type_, **fields}``."""
    return [msgpack.packb({"type": type_, **fields}, use_bin_type=True)]


def decode_control(frame: Buffer) -> dict | None:
    """Returns:
        The control map, or None if ``frame`` is not a msgpack map with a str ``"type"``.
    """
    try:
        if memoryview(frame).nbytes > MAX_CONTROL_BYTES:
            return None
        msg = msgpack.unpackb(frame, raw=False)
    except Exception:  # msgpack raises several types for garbage
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("type"), str) else None


def layout_to_wire(layout: KVLayout) -> dict:
    return dataclasses.asdict(layout)


def layout_from_wire(d: object) -> KVLayout | None:
    """Returns:
        The layout, or None if ``d`` is not a well-formed layout map.
    """
    try:
        return KVLayout(**{f.name: d[f.name] for f in dataclasses.fields(KVLayout)})
    except (TypeError, KeyError):
        return None


def max_frame_bytes(layout: KVLayout, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The largest K or V frame a sender may send here: every token this cache holds, of every
    head of the model, at 4 bytes an element (float32, the widest dtype on the wire)."""
    tokens = kv_caches[0][0].shape[0] if kv_caches else 0
    return max(1, tokens * layout.num_kv_heads * layout.head_dim * 4)


# ---- receiver ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Incoming:
    block_ids: list[int]
    token_start: int
    token_end: int
    deadline: float
    missing: int  # (layer, head) cells whose whole token range has not arrived yet
    wants_trailer: bool = False
    secret: bytes | None = None  # MACs its data and trailer (with auth)
    trailer: dict | None = None
    spans: dict[tuple[int, int], list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    peers: set[str] = dataclasses.field(default_factory=set)
    heads: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # peer -> heads its begin named
    ended: set[str] = dataclasses.field(default_factory=set)  # peers whose end is in
    state: TransferState = TransferState.WAITING
    error: str | None = None

    def covered(self, layer: int, h0: int, h1: int, t0: int, t1: int) -> bool:
        """Whether tokens [t0, t1) of heads [h0, h1) of ``layer`` have all arrived."""
        return all(any(s <= t0 and t1 <= e for s, e in self.spans.get((layer, h), ()))
                   for h in range(h0, h1))

    def add(self, layer: int, h0: int, h1: int, t0: int, t1: int) -> None:
        """Record tokens [t0, t1) of heads [h0, h1) as arrived (merging token intervals)."""
        for h in range(h0, h1):
            merged: list[tuple[int, int]] = []
            a, b = t0, t1
            for s, e in self.spans.get((layer, h), ()):
                if e < a or s > b:
                    merged.append((s, e))
                else:
                    a, b = min(a, s), max(b, e)
            was_full = self.full(layer, h)
            self.spans[(layer, h)] = sorted([*merged, (a, b)])
            if not was_full and self.full(layer, h):
                self.missing -= 1

    def full(self, layer: int, h: int) -> bool:
        """Whether every token of head ``h`` of ``layer`` has arrived."""
        return self.spans.get((layer, h)) == [(self.token_start, self.token_end)]


class KVReceiver(TransferTable):
    """Receives KV transfers into reserved paged-cache blocks; never blocks (see module doc).

    Args:
        transport: this side's transport; bound here, closed by :meth:`close`.
        layout: this side's cache layout (fingerprint, heads it holds, block size).
        kv_caches: per layer (K, V), each ``[num_blocks * block_size, H_local, D]``.
        lease_s: seconds from ``expect`` after which an unfinished transfer is FAILED.
        clock: monotonic time source (a fake one in tests).
        auth: MAC every message with the cluster key / transfer secrets (``auth.py``); None:
            trust whoever reaches the transport (tests, one process).
    """

    def __init__(self, transport: FrameTransport, layout: KVLayout,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic, auth: PlaneAuth | None = None) -> None:
        h0, h1 = layout.heads
        if len(kv_caches) != layout.num_layers:
            raise ValueError(f"{len(kv_caches)} layer caches for a layout of {layout.num_layers} layers")
        for k, v in kv_caches:
            if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (h1 - h0, layout.head_dim):
                raise ValueError(f"KV cache of shape {tuple(k.shape)} does not hold heads [{h0}, {h1}) "
                                 f"x head_dim {layout.head_dim}")
        self.transport, self.layout, self.kv_caches = transport, layout, kv_caches
        self.lease_s, self._clock = lease_s, clock
        self.auth = auth.for_transport(transport) if auth is not None else None
        limit = getattr(transport, "limit_frames", None)  # (zmq, ucx: refuse bigger frames unallocated)
        if limit is not None:
            limit(max_frame_bytes(layout, kv_caches))
        self._address = transport.bind()  # (``address``: the transport's newest)
        self._init_table()  # _transfers: id -> _Incoming
        self.trailers: dict[str, dict] = {}
        self.dropped_frames = 0  # data messages not written: unknown/ended transfer, duplicate, garbage
        self.bad_messages = 0  # control messages that made no sense
        self._refused = 0  # the transport's refusals already counted in stats.forged

    @property
    def address(self) -> str:
        """Where senders reach this receiver: the transport's newest address (a UCX transport's
        changes when it replaces its worker; older ones still reach it for a while)."""
        try:
            self._address = self.transport.bind()
        except RuntimeError:  # closed: the last one it had
            pass
        return self._address

    # ---- decode's side of the lifecycle -------------------------------------------------
    def expect(self, transfer_id: str, block_ids: Sequence[int], num_tokens: int,
               token_start: int = 0, trailer: bool = False) -> bytes | None:
        """Announce a transfer into blocks the caller already reserved; starts its lease.

        Args:
            transfer_id: id the sender will use.
            block_ids: the sequence's blocks on this side, from token 0, covering at least
                ``token_start + num_tokens`` tokens.
            num_tokens: tokens to receive.
            token_start: sequence position of the first one (e.g. after a local prefix hit).
            trailer: DONE needs the sender's ``end`` trailer too (see ``take_trailer``).
        Returns:
            With auth: the transfer's secret, for the sender's ``begin`` only. Else None.
        Raises:
            ValueError: id already live, or blocks too few for the token range.
        """
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        token_end = token_start + num_tokens
        if num_tokens < 1 or token_start < 0 or token_end > len(block_ids) * self.layout.block_size:
            raise ValueError(f"tokens [{token_start}, {token_end}) need {len(block_ids)} blocks of "
                             f"{self.layout.block_size} to cover them and num_tokens >= 1")
        self._ended.pop(transfer_id, None)
        h0, h1 = self.layout.heads
        secret = new_secret() if self.auth is not None else None
        self._transfers[transfer_id] = _Incoming(
            list(block_ids), token_start, token_end, self._clock() + self.lease_s,
            missing=self.layout.num_layers * (h1 - h0), wants_trailer=trailer, secret=secret)
        return secret

    def take_trailer(self, transfer_id: str) -> dict | None:
        """The trailer of a DONE transfer (once; None if it had none). Take it as you pop it."""
        return self.trailers.pop(transfer_id, None)

    def abort(self, transfer_id: str) -> None:
        """FAIL a live transfer and tell its senders; no-op for one already final."""
        t = self._transfers.get(transfer_id)
        if t is None and transfer_id not in self._ended:
            raise KeyError(f"unknown transfer {transfer_id!r}")
        if t is not None and not t.state.is_final:
            self._fail(transfer_id, t, "aborted by the receiver")

    def close(self) -> None:
        """Close the transport. Safe to call twice."""
        self.transport.close()

    # ---- network -----------------------------------------------------------------------
    def progress(self) -> None:
        """Handle every waiting message, then fail transfers whose lease has passed."""
        refused = getattr(self.transport, "refused", 0)  # (ucx: headers refused before allocation)
        if refused > self._refused:  # counted with the forged ones: a stranger's, or a peer gone bad
            self.stats.forged += refused - self._refused
            self._refused = refused
        while True:
            msg = self.transport.recv()
            if msg is None:
                drops = self.transport.dropped()  # handled before the messages that follow them
                if not drops:
                    break
                for peer, why in drops:
                    self._on_dropped(peer, why)
                continue
            peer, frames = msg
            tag = None
            if self.auth is not None:
                frames, tag = PlaneAuth.split(frames)
                if tag is None and len(frames) != 3:  # data: a missing MAC is judged with its transfer
                    self.stats.forged += 1  # no MAC: not from a worker of this cluster
                    continue
            if len(frames) == 3:
                self._on_data(peer, frames, tag)
            elif len(frames) == 1 and (ctl := decode_control(frames[0])) is not None:
                if self.auth is not None and ctl["type"] != "end" and not self.auth.valid(frames, tag):
                    self.stats.forged += 1
                    continue
                self._on_control(peer, ctl, frames, tag)
            else:
                self.dropped_frames += 1
        now = self._clock()
        for tid, t in self._transfers.items():
            if not t.state.is_final and now >= t.deadline:
                self._fail(tid, t, f"lease of {self.lease_s:g}s expired before all KV arrived")

    def _on_dropped(self, peer: str, why: str) -> None:
        """A peer's connection dropped: its transfers FAIL (their other peers are told)."""
        for tid, t in self._transfers.items():
            if not t.state.is_final and peer in t.peers:
                t.peers.discard(peer)  # unreachable on that connection
                self._fail(tid, t, f"connection to KV sender dropped: {why}")

    def _send(self, peer: str, type_: str, **fields: object) -> None:
        msg = encode_control(type_, **fields)
        self.transport.send(peer, self.auth.seal(msg) if self.auth is not None else msg)

    def _on_control(self, peer: str, msg: dict, frames: list[Buffer], tag: bytes | None) -> None:
        kind, tid = msg["type"], msg.get("id")
        if kind == "hello":
            self._send(peer, "hello_ok", layout=layout_to_wire(self.layout))
            return
        if not isinstance(tid, str) or kind not in ("begin", "end", "fail", "renew"):
            self.bad_messages += 1
            return
        t = self._transfers.get(tid)
        state, error = (t.state, t.error) if t is not None else self._ended.get(tid, (None, None))
        if kind == "fail":
            if t is not None and not t.state.is_final:
                t.peers.discard(peer)  # it knows; tell the other senders (head shards), if any
                self._fail(tid, t, f"sender aborted: {msg.get('reason')}")
            return
        if kind == "renew":  # the sender still has it queued: the lease starts over
            if t is not None and not t.state.is_final:
                t.deadline = max(t.deadline, self._clock() + self.lease_s)
            return
        if kind == "end":
            if t is None or t.state.is_final:
                self.bad_messages += 1  # unknown, or late for an ended transfer
            elif self.auth is not None and not self.auth.valid(frames, tag, t.secret):
                self.stats.forged += 1  # the first token comes only from the transfer's own sender
            elif not isinstance(msg.get("trailer"), dict) or t.trailer is not None:
                t.peers.add(peer)
                self._fail(tid, t, "bad transfer trailer: not a map, or a second one")
            else:
                t.peers.add(peer)
                t.ended.add(peer)
                t.trailer = msg["trailer"]
                t.deadline = max(t.deadline, self._clock() + self.lease_s)
                self._done_if_complete(tid, t)
                if not t.state.is_final and (lost := self._lost_cells(t)):
                    self._fail(tid, t, f"{lost} KV cells never arrived: every sender's end is in, so their "
                                       f"frames were lost in transit")
            return
        # begin
        if state is None:
            self._send(peer, "fail", id=tid, reason=f"receiver {self.address} does not expect transfer {tid!r} "
                                                    f"(decode must expect() before prefill begins)")
        elif state is TransferState.FAILED:
            self._send(peer, "fail", id=tid, reason=error)
        elif state is TransferState.DONE:
            self._send(peer, "ack", id=tid)
        elif (msg.get("token_start"), msg.get("num_tokens")) != (t.token_start, t.token_end - t.token_start):
            t.peers.add(peer)
            self._fail(tid, t, f"sender begins tokens [{msg.get('token_start')}, +{msg.get('num_tokens')}) but "
                               f"the receiver expects [{t.token_start}, {t.token_end})")
        else:
            t.peers.add(peer)
            heads = msg.get("heads")
            if (isinstance(heads, list) and len(heads) == 2 and all(type(h) is int for h in heads)
                    and 0 <= heads[0] < heads[1] <= self.layout.num_kv_heads):
                t.heads[peer] = (heads[0], heads[1])

    def _lost_cells(self, t: _Incoming) -> int:
        """Cells (layer x head) still missing whose every sender has sent its end: in-order
        delivery per peer means they can no longer arrive."""
        h0, h1 = self.layout.heads
        ended: set[int] = set()
        pending: set[int] = set()  # heads a peer without its end in may still send
        for p in t.peers:
            lo, hi = t.heads.get(p, (0, self.layout.num_kv_heads))
            (ended if p in t.ended else pending).update(range(max(lo, h0), min(hi, h1)))
        return sum(not t.full(layer, h) for layer in range(self.layout.num_layers) for h in ended - pending)

    def _on_data(self, peer: str, frames: list[Buffer], tag: bytes | None) -> None:
        try:
            header = FrameHeader.decode(frames[0])
        except FrameError as e:
            self._refuse(peer, peek_transfer_id(frames[0]), f"corrupt KV frame: {e}", forged=False)
            return
        tid = header.transfer_id
        t = self._transfers.get(tid)
        if t is None or t.state.is_final:
            self.dropped_frames += 1  # unknown, or late for an ended transfer
            return
        if self.auth is not None and not self.auth.valid(frames, tag, t.secret):
            self._refuse(peer, tid, "corrupt KV frame: its MAC does not match", forged=True)
            return
        t.peers.add(peer)
        h0, h1 = self.layout.heads
        lo, hi = max(header.head_start, h0), min(header.head_end, h1)
        try:
            if header.layer >= self.layout.num_layers or header.num_kv_heads != self.layout.num_kv_heads:
                raise FrameError(f"frame for layer {header.layer} of {header.num_kv_heads} heads does not "
                                 f"fit {self.layout.num_layers} layers x {self.layout.num_kv_heads} heads")
            if not (t.token_start <= header.token_start and header.token_end <= t.token_end) or lo >= hi:
                raise FrameError(f"frame tokens [{header.token_start}, {header.token_end}) heads "
                                 f"[{header.head_start}, {header.head_end}) outside expected tokens "
                                 f"[{t.token_start}, {t.token_end}) heads [{h0}, {h1})")
            if t.covered(header.layer, lo, hi, header.token_start, header.token_end):
                self.dropped_frames += 1  # duplicate
                return
            header, k, v = decode_frames(frames, fingerprint=self.layout.fingerprint)
            scatter_layer(self.kv_caches[header.layer], t.block_ids, self.layout.block_size,
                          header, k, v, local_head_start=h0)
        except FrameError as e:
            self._fail(tid, t, f"bad KV frame: {e}")
            return
        t.add(header.layer, lo, hi, header.token_start, header.token_end)
        self._moved(tid, k.numel() * k.element_size() * 2)
        t.deadline = max(t.deadline, self._clock() + self.lease_s)  # the lease bounds silence
        t.state = TransferState.TRANSFERRING
        self._done_if_complete(tid, t)

    def _refuse(self, peer: str, tid: str | None, reason: str, forged: bool) -> None:
        """A data message that cannot be accepted. Sent by a peer of the live transfer it names,
        that transfer FAILS now (damaged in transit, or a bug: the lease would only wait);
        from anyone else it is counted and changes nothing."""
        t = self._transfers.get(tid) if tid is not None else None
        if t is not None and not t.state.is_final and peer in t.peers:
            self._fail(tid, t, reason)
        elif forged:
            self.stats.forged += 1  # not from the sender the router chose: it writes nothing
        else:
            self.dropped_frames += 1  # no transfer of this peer's to blame

    def _done_if_complete(self, tid: str, t: _Incoming) -> None:
        if t.missing == 0 and (t.trailer is not None or not t.wants_trailer):
            t.state = TransferState.DONE
            self._finished.append(tid)
            if t.trailer is not None:
                self.trailers[tid] = t.trailer
            for p in t.peers:
                self._send(p, "ack", id=tid)

    def _fail(self, tid: str, t: _Incoming, reason: str) -> None:
        t.state, t.error = TransferState.FAILED, reason
        self._finished.append(tid)
        for p in t.peers:
            self._send(p, "fail", id=tid, reason=reason)
