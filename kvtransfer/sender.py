"""KV sender (prefill side): pushes each layer's KV to a receiver as soon as it is computed.

Lifecycle of one transfer here (``TransferState``)::

    begin() ─► WAITING ──first send_layer()──► TRANSFERRING ──(end()) receiver's ack──► DONE
                  │                                 │
                  └── receiver's fail | abort() | disconnect() | connection dropped
                      | no ack by lease_s + margin_s ──► FAILED

Prefill frees its own blocks when ``pop_finished`` reports the transfer, DONE or FAILED: DONE
means the receiver holds all KV; FAILED means it never will (no ack within ``lease_s`` +
``margin_s`` of our last frame: the receiver's lease, which our frames renew, has surely
passed; or the connection it went on dropped, or this side disconnected the receiver).
While a transfer is WAITING (its prompt queued here) we renew the receiver's lease every
``lease_s / 3`` and never time it out ourselves.
Frames are copied out of the cache by ``gather_layer`` before ``send_layer``, so freeing never
races an in-flight send (on a GPU transport the gathered copy itself is sent, from the GPU).

Connections (one per receiver address, ``links.py``): ``connect`` handshakes (blocking); when
the transport reports the connection dropped, the transfers on it FAIL at once and the next
``begin`` to that address dials again without blocking: hello, begin and frames go out
together, in order, and the hello_ok that comes back is checked when it arrives (no answer
within ``RECONNECT_TIMEOUT_S``, or another model: the transfers on it FAIL). ``disconnect``
forgets a receiver (the router calls it when a decode worker is lost or retired).

Tables (exactly these): ``links`` (receiver address → its connection and layout; peer id →
its hello_ok while a handshake waits, ``links.py``), ``_transfers`` (id → live transfer, or
final but not yet popped), ``_finished`` (ids that turned final, drained by ``pop_finished``),
``_ended`` (recently popped ids → final state, bounded, so late acks are told from unknown
ones) and ``_fault`` (one armed chaos fault, :meth:`inject`).

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
from kvtransfer.links import RECONNECT_TIMEOUT_S, LayoutMismatch, Links
from kvtransfer.receiver import MAX_CONTROL_BYTES, decode_control, encode_control

__all__ = ["CHAOS_FAULTS", "KVSender", "LayoutMismatch", "RECONNECT_TIMEOUT_S"]

# What inject() can do to the next KV data message (chaos benchmark, tests).
CHAOS_FAULTS = ("corrupt", "drop", "sever")


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
    """Pushes KV transfers to receivers; never blocks except in :meth:`connect`.

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
        self.links = Links(transport, layout, self._send, clock, self._fail_on)
        self._init_table()  # _transfers: id -> _Outgoing
        self._fault: str | None = None
        self.dropped_messages = 0  # late acks/fails for ended transfers, and garbage

    # ---- connections ----------------------------------------------------------------------
    def connect(self, address: str, timeout_s: float = 10.0) -> KVLayout:
        """Handshake with the receiver at ``address`` (blocks until it replies; once per
        connection: again only after it dropped or was disconnected).

        Args:
            address: the receiver's ``KVReceiver.address``.
            timeout_s: wall-clock seconds to wait for the reply.
        Returns:
            The receiver's layout.
        Raises:
            LayoutMismatch: different model fingerprint or shape, or no heads in common.
            TimeoutError: no reply (receiver not running its ``progress`` loop, or gone).
            ConnectionError: the connection dropped during the handshake.
        """
        self._take_drops()
        link = self.links.dial(address)
        end = time.monotonic() + timeout_s  # real time: a blocking call, whatever clock tests use
        while link.state == "connecting":
            self.progress()
            if time.monotonic() > end:
                why = f"KV receiver at {address} did not answer the handshake within {timeout_s:g}s"
                self.links.close(address, why, forget=True)
                raise TimeoutError(why)
            time.sleep(0.0005)
        if link.state == "refused":
            raise LayoutMismatch(link.why)
        if link.state != "ready":
            raise ConnectionError(f"connection to KV receiver at {address} dropped during the handshake: {link.why}")
        return link.layout

    def disconnect(self, address: str) -> None:
        """Forget the receiver at ``address`` (its connection and every table entry for it);
        its live transfers FAIL at once. No-op for an unknown address. Call it when that
        receiver is lost or retired, so tables do not grow as workers come and go."""
        self.links.close(address, f"KV receiver {address} was disconnected by this sender", forget=True)

    # ---- prefill's side of the lifecycle ------------------------------------------------
    def connected(self, address: str) -> bool:
        """Whether :meth:`connect` to ``address`` completed (its connection may have dropped
        since: ``begin`` dials again by itself then)."""
        link = self.links.get(address)
        return link is not None and link.layout is not None

    def begin(self, transfer_id: str, address: str, num_tokens: int, token_start: int = 0,
              secret: bytes | None = None) -> None:
        """Start a transfer to a connected receiver that already ``expect``-ed it. If the
        connection to it dropped since, dial again first (without blocking: see the module doc).

        Args:
            transfer_id: id the receiver expects.
            address: the receiver's address (``connect`` first).
            num_tokens: tokens to send; the receiver must expect the same range.
            token_start: sequence position of the first one.
            secret: with auth, the transfer's secret from the receiver's ``expect``.
        Raises:
            ValueError: not connected (or the connection dropped and the address is known to be
                gone), id already live, an empty range, or no secret with auth.
        """
        self._take_drops()
        link = self.links.get(address)
        if link is None or link.layout is None:
            raise ValueError(f"not connected to KV receiver {address}: call connect() first")
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id!r} is already live")
        if num_tokens < 1 or token_start < 0:
            raise ValueError(f"bad token range: start {token_start}, {num_tokens} tokens")
        if self.auth is not None and not secret:
            raise ValueError("this sender authenticates its frames: begin() needs the transfer's secret")
        if link.state == "dropped":
            try:
                link = self.links.dial(address, deadline=self._clock() + RECONNECT_TIMEOUT_S)
            except ConnectionError as e:  # a transport that knows at once the address is gone
                raise ValueError(f"KV receiver {address} is unreachable ({e}): call connect() again "
                                 f"once it is back") from e
        self._ended.pop(transfer_id, None)
        now = self._clock()
        heads = self.links.common_heads(link.layout)
        self._transfers[transfer_id] = _Outgoing(link.peer, token_start, num_tokens, heads,
                                                 now + self.lease_s + self.margin_s, secret, now + self.lease_s / 3)
        self._send(link.peer, encode_control("begin", id=transfer_id, num_tokens=num_tokens,
                                             token_start=token_start, heads=list(heads)))

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
        fault, self._fault = self._fault, None
        if fault == "sever":  # chaos: cut the connection as a reset would; the message is lost with it
            self.transport.disconnect(t.peer)
            self.links.dropped(t.peer, "severed by inject('sever')")
            return False
        if fault != "drop":  # chaos "drop": the message is lost in transit
            self._send(t.peer, frames, t.secret, corrupt=fault == "corrupt")
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

    # ---- chaos hook: tests and the chaos benchmark only, never the serving path ------------
    def inject(self, kind: str) -> None:
        """TEST/CHAOS HOOK. Fault the next KV data message this sender sends (one armed at a
        time; a second call replaces the first):

        - ``"corrupt"``: its header goes out cut short, so it does not decode (a MAC, if any,
          no longer matches either): the receiver fails the transfer at once;
        - ``"drop"``: it is not sent, as if lost in transit: the receiver fails the transfer
          at once when the transfer's ``end`` shows KV missing;
        - ``"sever"``: instead of sending it, the connection to that transfer's receiver is cut
          as a reset would cut it: the transfers on it FAIL at once, and the next ``begin``
          to that address dials again.

        Raises:
            ValueError: an unknown kind (the message lists the valid ones).
        """
        if kind not in CHAOS_FAULTS:
            raise ValueError(f"unknown KV fault {kind!r}; valid: {', '.join(CHAOS_FAULTS)}")
        self._fault = kind

    # ---- network -----------------------------------------------------------------------
    def _send(self, peer: str, frames: list[Buffer], secret: bytes | None = None, corrupt: bool = False) -> None:
        """Send, with the MAC frame under ``secret`` (data, trailer) or the cluster key."""
        frames = self.auth.seal(frames, secret) if self.auth is not None else frames
        if corrupt:  # chaos: damaged in transit, after the MAC was computed
            frames = [bytes(frames[0])[:-1], *frames[1:]]
        self.transport.send(peer, frames)

    def progress(self) -> None:
        """Handle dropped connections and every waiting reply, then fail transfers with no ack
        by their deadline or on a re-handshake that failed."""
        while True:
            msg = self.transport.recv()
            if msg is None:
                if not self._take_drops():  # a drop is handled before what came after it
                    break
                continue
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
                self.links.answered(peer, ctl.get("layout"))
                continue
            tid = ctl.get("id")
            t = self._transfers.get(tid) if isinstance(tid, str) else None
            if t is None or t.state.is_final or t.peer != peer or ctl["type"] not in ("ack", "fail"):
                self.dropped_messages += 1  # late, unknown, or from the wrong peer
            elif ctl["type"] == "ack":
                self._end(tid, t, TransferState.DONE, None, notify=False)
            else:
                self._end(tid, t, TransferState.FAILED, f"receiver: {ctl.get('reason')}", notify=False)
        self.links.settle()
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

    def _take_drops(self) -> bool:
        """Handle the connections the transport reports dropped; True if there were any."""
        drops = self.transport.dropped()
        for peer, why in drops:
            self.links.dropped(peer, why)
        return bool(drops)

    def _fail_on(self, peer: str, reason: str, notify: bool) -> list[str]:
        """FAIL every live transfer on ``peer``; returns their ids."""
        failed = [tid for tid, t in self._transfers.items() if t.peer == peer and not t.state.is_final]
        for tid in failed:
            self._end(tid, self._transfers[tid], TransferState.FAILED, reason, notify=notify)
        return failed

    def _end(self, tid: str, t: _Outgoing, state: TransferState, error: str | None, notify: bool) -> None:
        t.state, t.error = state, error
        self._finished.append(tid)
        if notify:
            self._send(t.peer, encode_control("fail", id=tid, reason=error))
