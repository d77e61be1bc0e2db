"""KV sender (prefill side): pushes each layer's KV to a receiver as soon as it is computed.

Lifecycle of one transfer here (``TransferState``)::

    begin() ─► WAITING ──first send_layer()──► TRANSFERRING ──(end()) receiver's ack──► DONE
                  │                                 │
                  └── receiver's fail | abort() | no ack by lease_s + margin_s ──► FAILED

Prefill frees its own blocks when ``pop_finished`` reports the transfer, DONE or FAILED: DONE
means the receiver holds all KV; FAILED means it never will (no ack within ``lease_s`` +
``margin_s`` of our last frame: the receiver's lease, which our frames renew, has surely
passed). While a transfer is WAITING (its prompt queued here) we renew the receiver's lease
every ``lease_s / 3`` and never time it out ourselves.
Frames are copied out of the cache by ``gather_layer`` before ``send_layer``, so freeing never
races an in-flight send (on a GPU transport the gathered copy itself is sent, from the GPU).

Tables (exactly these): ``_peers`` (receiver address → its peer id and layout, set by the
``connect`` handshake), ``_transfers`` (id → live transfer, or final but not yet popped),
``_finished`` (ids that turned final, drained by ``pop_finished``) and ``_ended`` (recently
popped ids → final state, bounded, so late acks are told from unknown ones).

The wire protocol (control messages hello/hello_ok/begin/end/renew/ack/fail; 3-frame KV data;
with a ``PlaneAuth``, a MAC frame after each) is described in ``receiver.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from kvtransfer.auth import PlaneAuth
from kvtransfer.base import LEASE_S, Buffer, FrameTransport, KVLayout, TransferState, TransferTable
from kvtransfer.format import encode_frames
from kvtransfer.receiver import MAX_CONTROL_BYTES, decode_control, encode_control, layout_from_wire, layout_to_wire


class LayoutMismatch(ValueError):
    """The receiver's KV layout cannot take this sender's KV (other model, or no common heads)."""


@dataclasses.dataclass
class _Outgoing:
    peer: str
    token_start: int
    num_tokens: int
    heads: tuple[int, int]  # model heads sent: ours that the receiver also holds
    deadline: float
    secret: bytes | None = None  # the receiver's, from the router: MACs our data and trailer
    renew_at: float = 0.0  # while WAITING: when to renew the receiver's lease next
    state: TransferState = TransferState.WAITING
    error: str | None = None


class KVSender(TransferTable):
    """Pushes KV transfers to receivers; never blocks except in the one-time :meth:`connect`.

    Args:
        transport: this side's transport (closed by :meth:`close`).
        layout: this side's cache layout (fingerprint, heads it holds).
        lease_s: the receivers' lease; use the same value on both sides.
        clock: monotonic time source (a fake one in tests).
        margin_s: extra wait past ``lease_s`` for an ack already in flight; default
            ``max(0.5, lease_s / 10)``.
        auth: MAC every message (``auth.py``); then ``begin`` needs the transfer's secret.
    """

    def __init__(self, transport: FrameTransport, layout: KVLayout, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic, margin_s: float | None = None,
                 auth: PlaneAuth | None = None) -> None:
        self.transport, self.layout, self.lease_s, self._clock = transport, layout, lease_s, clock
        self.auth = auth.for_transport(transport) if auth is not None else None
        self.margin_s = max(0.5, lease_s / 10) if margin_s is None else margin_s
        self._peers: dict[str, tuple[str, KVLayout]] = {}
        self._hello: dict[str, KVLayout] = {}  # peer id -> layout from its hello_ok
        self._init_table()  # _transfers: id -> _Outgoing
        self.dropped_messages = 0  # late acks/fails for ended transfers, and garbage

    # ---- handshake ---------------------------------------------------------------------
    def connect(self, address: str, timeout_s: float = 10.0) -> KVLayout:
        """Handshake with the receiver at ``address`` (blocks until it replies; once per peer).

        Args:
            address: the receiver's ``KVReceiver.address``.
            timeout_s: wall-clock seconds to wait for the reply.
        Returns:
            The receiver's layout.
        Raises:
            LayoutMismatch: different model fingerprint or shape, or no heads in common.
            TimeoutError: no reply (receiver not running its ``progress`` loop, or gone).
        """
        if address in self._peers:
            return self._peers[address][1]
        peer = self.transport.connect(address)
        self._hello.pop(peer, None)
        self._send(peer, encode_control("hello", layout=layout_to_wire(self.layout)))
        end = time.monotonic() + timeout_s  # real time: a blocking call, whatever clock tests use
        while (remote := self._hello.get(peer)) is None:
            self.progress()
            if time.monotonic() > end:
                raise TimeoutError(f"KV receiver at {address} did not answer the handshake within {timeout_s:g}s")
            time.sleep(0.0005)
        mine = self.layout
        if remote.fingerprint != mine.fingerprint:
            raise LayoutMismatch(f"KV receiver at {address} has model fingerprint {remote.fingerprint!r}, "
                                 f"this sender {mine.fingerprint!r}: different model or architecture")
        shape = ("num_layers", "num_kv_heads", "head_dim")
        if any(getattr(remote, f) != getattr(mine, f) for f in shape):
            raise LayoutMismatch(f"KV receiver at {address} has layers/heads/head_dim "
                                 f"{[getattr(remote, f) for f in shape]}, this sender {[getattr(mine, f) for f in shape]}")
        if self._common_heads(remote) is None:
            raise LayoutMismatch(f"KV receiver at {address} holds heads {remote.heads}, this sender "
                                 f"{mine.heads}: nothing to send")
        self._peers[address] = (peer, remote)
        return remote

    def _common_heads(self, remote: KVLayout) -> tuple[int, int] | None:
        lo, hi = max(self.layout.heads[0], remote.heads[0]), min(self.layout.heads[1], remote.heads[1])
        return (lo, hi) if lo < hi else None

    # ---- prefill's side of the lifecycle ------------------------------------------------
    def begin(self, transfer_id: str, address: str, num_tokens: int, token_start: int = 0,
              secret: bytes | None = None) -> None:
        """Start a transfer to a connected receiver that already ``expect``-ed it.

        Args:
            transfer_id: id the receiver expects.
            address: the receiver's address (``connect`` first).
            num_tokens: tokens to send; the receiver must expect the same range.
            token_start: sequence position of the first one.
            secret: with auth, the transfer's secret from the receiver's ``expect``.
        Raises:
            ValueError: not connected, id already live, an empty range, or no secret with auth.
        """
        if address not in self._peers:
            raise ValueError(f"not connected to KV receiver {address}: call connect() first")
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already live")
        if num_tokens < 1 or token_start < 0:
            raise ValueError(f"bad token range: start {token_start}, {num_tokens} tokens")
        if self.auth is not None and not secret:
            raise ValueError("this sender authenticates its frames: begin() needs the transfer's secret")
        peer, remote = self._peers[address]
        self._ended.pop(transfer_id, None)
        now = self._clock()
        self._transfers[transfer_id] = _Outgoing(peer, token_start, num_tokens, self._common_heads(remote),
                                                 now + self.lease_s + self.margin_s, secret, now + self.lease_s / 3)
        self._send(peer, encode_control("begin", id=transfer_id, num_tokens=num_tokens, token_start=token_start))

    def send_layer(self, transfer_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                   token_start: int | None = None) -> bool:
        """Queue one layer's KV (non-blocking); call right after the layer is computed.

        Args:
            transfer_id: a begun transfer.
            layer: layer index.
            k, v: ``[T, H_local, D]`` KV of this sender's heads (from ``gather_layer``); only
                the heads the receiver holds are sent.
            token_start: position of ``k[0]``; default the transfer's start. A transfer may be
                sent in token chunks; together they must cover its range once per layer.
        Returns:
            False if the transfer has already ended (e.g. the receiver failed it): nothing sent.
        Raises:
            KeyError: unknown transfer. ValueError: shapes or ranges that do not fit.
        """
        t = self._live(transfer_id)
        if t is None:
            return False
        h0, h1 = self.layout.heads
        start = t.token_start if token_start is None else token_start
        if (k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (h1 - h0, self.layout.head_dim)
                or not 0 <= layer < self.layout.num_layers
                or not t.token_start <= start < start + k.shape[0] <= t.token_start + t.num_tokens):
            raise ValueError(f"layer {layer} KV {tuple(k.shape)}/{tuple(v.shape)} at token {start} does not fit "
                             f"{self.layout.num_layers} layers x heads [{h0}, {h1}) x {self.layout.head_dim} "
                             f"over tokens [{t.token_start}, {t.token_start + t.num_tokens})")
        lo, hi = t.heads
        if (lo, hi) != (h0, h1):
            k, v = k[:, lo - h0:hi - h0], v[:, lo - h0:hi - h0]
        # GPU KV goes from device memory when the transport can (UCX with CUDA), else via host.
        frames = encode_frames(transfer_id, self.layout.fingerprint, layer, start, k, v,
                               self.layout.num_kv_heads, head_start=lo,
                               keep_on_device=getattr(self.transport, "device_frames", False))
        self._send(t.peer, frames, t.secret)
        self._moved(transfer_id, k.numel() * k.element_size() * 2)
        t.deadline = self._clock() + self.lease_s + self.margin_s  # the lease bounds silence, not length
        t.state = TransferState.TRANSFERRING
        return True

    def _live(self, transfer_id: str) -> _Outgoing | None:
        """The live transfer to send for; None if it has ended. Raises KeyError if unknown."""
        t = self._transfers.get(transfer_id)
        if t is None and transfer_id not in self._ended:
            raise KeyError(f"unknown transfer {transfer_id!r}: begin() it first")
        return None if t is None or t.state.is_final else t

    def end(self, transfer_id: str, trailer: dict) -> bool:
        """Send the transfer's trailer after its last layer: a small map the receiver hands to
        its caller with DONE (decode: the first token, so it needs no other message to start).

        Returns:
            False if the transfer has already ended: nothing sent.
        Raises:
            KeyError: unknown transfer. ValueError: not a map, or too big for a control message.
        """
        t = self._live(transfer_id)
        if t is None:
            return False
        msg = encode_control("end", id=transfer_id, trailer=trailer) if isinstance(trailer, dict) else None
        if msg is None or len(msg[0]) > MAX_CONTROL_BYTES:
            raise ValueError(f"a trailer is a map of at most {MAX_CONTROL_BYTES} bytes encoded")
        self._send(t.peer, msg, t.secret)
        t.deadline = self._clock() + self.lease_s + self.margin_s
        return True

    def abort(self, transfer_id: str) -> None:
        """FAIL a live transfer and tell the receiver; no-op for one already final."""
        t = self._transfers.get(transfer_id)
        if t is None and transfer_id not in self._ended:
            raise KeyError(f"unknown transfer {transfer_id!r}")
        if t is not None and not t.state.is_final:
            self._end(transfer_id, t, TransferState.FAILED, "aborted by the sender", notify=True)

    def close(self) -> None:
        """Close the transport. Safe to call twice."""
        self.transport.close()

    # ---- network -----------------------------------------------------------------------
    def _send(self, peer: str, frames: list[Buffer], secret: bytes | None = None) -> None:
        """Send, with the MAC frame under ``secret`` (data, trailer) or the cluster key."""
        self.transport.send(peer, self.auth.seal(frames, secret) if self.auth is not None else frames)

    def progress(self) -> None:
        """Handle every waiting reply, then fail transfers with no ack by their deadline."""
        while (msg := self.transport.recv()) is not None:
            peer, frames = msg
            if self.auth is not None:
                frames, tag = PlaneAuth.split(frames)
                if not self.auth.valid(frames, tag):
                    self.stats.forged += 1  # not from a worker of this cluster: changes nothing
                    continue
            ctl = decode_control(frames[0]) if len(frames) == 1 else None
            if ctl is None:
                self.dropped_messages += 1
                continue
            if ctl["type"] == "hello_ok":
                layout = layout_from_wire(ctl.get("layout"))
                if layout is not None:
                    self._hello[peer] = layout
                continue
            tid = ctl.get("id")
            t = self._transfers.get(tid) if isinstance(tid, str) else None
            if t is None or t.state.is_final or t.peer != peer or ctl["type"] not in ("ack", "fail"):
                self.dropped_messages += 1  # late, unknown, or from the wrong peer
            elif ctl["type"] == "ack":
                self._end(tid, t, TransferState.DONE, None, notify=False)
            else:
                self._end(tid, t, TransferState.FAILED, f"receiver: {ctl.get('reason')}", notify=False)
        now = self._clock()
        for tid, t in self._transfers.items():
            if t.state == TransferState.WAITING:
                # Queued behind other prompts here: keep the receiver's reservation alive. If we
                # die, the renewals stop and its lease frees the blocks.
                t.deadline = now + self.lease_s + self.margin_s
                if now >= t.renew_at:
                    t.renew_at = now + self.lease_s / 3
                    self._send(t.peer, encode_control("renew", id=tid))
            elif not t.state.is_final and now >= t.deadline:
                self._end(tid, t, TransferState.FAILED,
                          f"no ack within the lease ({self.lease_s:g}s + {self.margin_s:g}s margin)", notify=True)

    def _end(self, tid: str, t: _Outgoing, state: TransferState, error: str | None, notify: bool) -> None:
        t.state, t.error = state, error
        self._finished.append(tid)
        if notify:
            self._send(t.peer, encode_control("fail", id=tid, reason=error))
