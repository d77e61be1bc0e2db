"""ZeroMQ frame transport: one ROUTER socket to be reached at, one DEALER per connected address.

- ``bind`` opens a ROUTER on ``tcp://<host>:<port>`` (``scheme="tcp"``; a random free port by
  default, a fixed one lets a restarted process come back on the same address) or on a fresh
  ``ipc://`` socket file in the temp directory (``scheme="ipc"``, same host only, faster).
  Messages arriving there are reported with the sender's routing identity (hex) as peer id,
  and ``send`` to that id replies through the ROUTER.
- ``connect(address)`` opens a DEALER to it; the peer id is the address itself, both for
  ``send`` and for the messages that come back on that DEALER.

Sending never blocks: each message is offered with ``NOBLOCK``; if the peer's high-water mark
is reached it waits, in order, in that peer's outbox (one per DEALER, one per ROUTER peer, so
one slow peer never holds up the others) that every later ``send`` and ``recv`` call flushes
first (so per-peer order holds). libzmq never drops a message at its high-water mark here
(a DEALER and a ``ROUTER_MANDATORY`` ROUTER refuse it instead): an outbox holds at most
``MAX_QUEUED_MESSAGES`` / ``MAX_QUEUED_BYTES``, and a peer that lets its outbox pass that
bound is dropped (reported by ``dropped``), never quietly short of a frame. Payload frames go
``copy=False``: pyzmq keeps a reference to each buffer until libzmq has written it, so callers
need not keep them alive, but must not modify them until then (frames below pyzmq's copy
threshold are copied anyway). A reply to a ROUTER peer that has disconnected is dropped and
counted in ``unroutable``. Sockets close with ``LINGER=0``.

Size. Every socket refuses a frame above ``max_frame_bytes`` (libzmq's MAXMSGSIZE, which it
checks per frame as the frame's length arrives, before allocating it): the peer's connection is
cut, reported dropped like any other, and nothing else changes. The default is UCX's
``MAX_FRAME_BYTES``; a receiver lowers it to what its cache can hold (``limit_frames``, before
``bind``). libzmq has no bound on the frames of one message: a KV message has 4.

Dropped connections. Every socket sends ZMTP heartbeats, so a peer that vanished without
closing its socket is cut after ``HEARTBEAT_TIMEOUT_MS``; a socket monitor reports each
closed connection. A DEALER whose connection closed (the receiver restarted, a reset, a
heartbeat timeout) is closed in turn and its address reported by ``dropped``: a later
``connect`` opens a fresh DEALER. On the ROUTER, events name a file descriptor: the fd each
peer's messages come from (``SRCFD``) maps it to the peer, whose drop is reported the same
way (a peer that never sent anything has nothing to lose). libzmq cannot close one ROUTER
peer's connection, so ``disconnect`` of such a peer only forgets its tables.

Tables: ``_dealers`` (address → DEALER, its monitor and outbox), ``_replies`` (ROUTER peer →
outbox, only while non-empty), ``_fd_peer``/``_peer_fd`` (live ROUTER connections that have
sent something), ``_dropped`` (reports not yet taken, bounded).
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransfer.base import MAX_DROP_REPORTS, Buffer, FrameTransport, register_transport

# libzmq's own default, stated: past it a send is refused (Again) and waits in our outbox.
HWM_MESSAGES = 1000
# A peer that has not taken this much from us is treated as gone. Messages: far more than the
# layers x chunks of every prompt in flight to one decode worker; bytes: seconds of KV at
# network speed, and a bound on what one stuck peer can pin in this process's memory.
MAX_QUEUED_MESSAGES = 1 << 16
MAX_QUEUED_BYTES = 4 << 30
MAX_FRAME_BYTES = 4 << 30  # the default size limit of one received frame (zmq MAXMSGSIZE), as UCX's

# Heartbeats notice a peer that vanished without closing (power loss, partition): sooner than
# the 120 s lease, yet a PONG may wait behind one large KV message already being written.
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 30_000


@dataclass
class _Outbox:
    """Messages a peer's pipe had no room for yet, in order, with their size."""

    msgs: deque[list[Buffer]] = field(default_factory=deque)
    nbytes: int = 0

    def full_for(self, n: int) -> bool:
        return len(self.msgs) >= MAX_QUEUED_MESSAGES or (bool(self.msgs) and self.nbytes + n > MAX_QUEUED_BYTES)


@dataclass
class _Dealer:
    sock: zmq.Socket
    monitor: zmq.Socket
    out: _Outbox = field(default_factory=_Outbox)


def _size(frames: Sequence[Buffer]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class ZmqTransport(FrameTransport):
    """A FrameTransport over pyzmq (registered as ``"zmq"``).

    Args:
        scheme: "tcp" or "ipc".
        host: interface the ROUTER binds to for tcp (loopback by default).
        port: tcp port to bind; 0 (default): any free one.
    """

    name = "zmq"

    def __init__(self, scheme: str = "tcp", host: str = "127.0.0.1", port: int = 0) -> None:
        if scheme not in ("tcp", "ipc"):
            raise ValueError(f"unknown zmq scheme {scheme!r}; valid: ipc, tcp")
        self.scheme, self.host, self.port = scheme, host, port
        self._ctx = zmq.Context.instance()  # shared: one I/O thread for every transport
        self._router: zmq.Socket | None = None
        self._router_mon: zmq.Socket | None = None
        self._address: str | None = None
        self._ipc_path: str | None = None
        self._dealers: dict[str, _Dealer] = {}
        self._replies: dict[bytes, _Outbox] = {}
        self._fd_peer: dict[int, bytes] = {}
        self._peer_fd: dict[bytes, int] = {}
        self._dropped: deque[tuple[str, str]] = deque(maxlen=MAX_DROP_REPORTS)
        self._held: tuple[str, list[Buffer]] | None = None  # a message that arrived after a drop
        self._turn = 0  # round-robin start for recv, so no socket starves the others
        self._closed = False
        self.max_frame_bytes = MAX_FRAME_BYTES  # (limit_frames)
        self.unroutable = 0  # messages dropped: a ROUTER peer had disconnected, or a dropped DEALER
        self.drops = 0  # connections reported dropped, in all

    # ---- endpoints -----------------------------------------------------------------------
    def bind(self) -> str:
        """Open the ROUTER (once).

        Returns:
            The address others ``connect`` to, e.g. ``tcp://127.0.0.1:45123``.
        """
        self._check_open()
        if self._address is not None:
            return self._address
        sock = self._socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.scheme == "tcp":
            sock.bind(f"tcp://{self.host}:{self.port or '*'}")
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"pdserve-{uuid.uuid4().hex[:16]}.ipc")
            self._address = f"ipc://{self._ipc_path}"
            sock.bind(self._address)
        self._router, self._router_mon = sock, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return self._address

    def connect(self, address: str) -> str:
        """Open (once) a DEALER to ``address``; zmq connects in the background and queues.

        Args:
            address: a ``tcp://`` or ``ipc://`` address from another endpoint's ``bind``.
        Returns:
            The peer id for ``send``: the address itself.
        """
        self._check_open()
        if address not in self._dealers:
            sock = self._socket(zmq.DEALER)
            # Explicit ids must not start with a zero byte (zmq reserves those for its own).
            sock.setsockopt(zmq.ROUTING_ID, b"k" + uuid.uuid4().bytes)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self._dealers[address] = _Dealer(sock, monitor)
        return address

    def limit_frames(self, max_frame_bytes: int) -> None:
        """Refuse received frames above ``max_frame_bytes`` (cut their connection) on sockets
        opened from now on: call it before ``bind`` and ``connect``."""
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
        sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        return sock

    def disconnect(self, peer: str) -> None:
        """Close the DEALER to ``peer`` (its queued messages are dropped); for a ROUTER peer,
        forget its outbox and connection entry (libzmq cannot close that one connection)."""
        if peer in self._dealers:
            self._close_dealer(peer)
            return
        ident = _ident(peer)
        self._replies.pop(ident, None)
        fd = self._peer_fd.pop(ident, None)
        if fd is not None:
            self._fd_peer.pop(fd, None)

    def dropped(self) -> list[tuple[str, str]]:
        if not self._closed:
            self._poll_events()
        out = list(self._dropped)
        self._dropped.clear()
        return out

    def _close_dealer(self, address: str) -> None:
        d = self._dealers.pop(address)
        d.sock.disable_monitor()
        d.monitor.close(linger=0)
        d.sock.close(linger=0)

    def _drop(self, peer: str, why: str) -> None:
        """Forget a peer whose connection dropped and report it."""
        self.disconnect(peer)
        self._report(peer, why)

    def _report(self, peer: str, why: str) -> None:
        self._dropped.append((peer, why))
        self.drops += 1

    # ---- messages ------------------------------------------------------------------------
    def send(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Queue one message for ``peer`` (a connected address or a ROUTER peer's hex id).

        A message to a DEALER dropped since the caller last took ``dropped`` is discarded and
        counted in ``unroutable`` (the report tells the caller).

        Raises:
            ValueError: ``peer`` is neither.
        """
        self._check_open()
        d = self._dealers.get(peer)
        if d is not None:
            sock, out, msg = d.sock, d.out, list(frames)
        elif any(p == peer for p, _ in self._dropped):
            self.unroutable += 1  # its drop is reported, not yet taken: the caller will learn
            return
        else:
            ident = _ident(peer)
            if self._router is None or not ident:
                raise ValueError(f"unknown zmq peer {peer!r}: connect() to it first")
            sock, out, msg = self._router, self._replies.setdefault(ident, _Outbox()), [ident, *frames]
        n = _size(frames)
        if out.full_for(n):
            self._drop(peer, f"it took nothing of {len(out.msgs)} queued messages ({out.nbytes} bytes): "
                             f"past the bound of {MAX_QUEUED_MESSAGES} messages / {MAX_QUEUED_BYTES} bytes")
            return
        out.msgs.append(msg)
        out.nbytes += n
        self._flush(peer, sock, out)

    def _flush(self, peer: str, sock: zmq.Socket, out: _Outbox) -> None:
        while out.msgs:
            msg = out.msgs[0]
            try:
                # A multipart message is queued atomically: Again means nothing was taken.
                sock.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self.unroutable += 1  # ROUTER peer went away
            out.msgs.popleft()
            out.nbytes -= _size(msg[1:] if sock is self._router else msg)
        if sock is self._router:
            self._replies.pop(_ident(peer), None)  # kept only while something waits

    def recv(self) -> tuple[str, list[Buffer]] | None:
        """Flush outboxes, notice dropped connections, then take the next waiting message.

        Returns:
            (peer id, frames as memoryviews) or None when nothing is waiting, or when a drop
            was noticed first (``dropped`` has it; call again for the messages after it).
        """
        if self._closed:
            return None
        for address, d in list(self._dealers.items()):
            if d.out.msgs:
                self._flush(address, d.sock, d.out)
        for ident, out in list(self._replies.items()):
            self._flush(ident.hex(), self._router, out)
        if self._poll_events():
            return None
        if self._held is not None:
            msg, self._held = self._held, None
            return msg
        sources: list[tuple[str | None, zmq.Socket]] = [(a, d.sock) for a, d in self._dealers.items()]
        if self._router is not None:
            sources.append((None, self._router))
        for i in range(len(sources)):
            address, sock = sources[(self._turn + i) % len(sources)]
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._turn = (self._turn + i + 1) % len(sources)
            if address is not None:
                return address, [p.buffer for p in parts]
            # ROUTER: the first part is the sender's routing identity
            msg = parts[0].bytes.hex(), [p.buffer for p in parts[1:]]
            if self._track(parts[0].bytes, parts[-1]):
                self._held = msg  # the drop it revealed goes first
                return None
            return msg
        return None

    def _track(self, ident: bytes, part: zmq.Frame) -> bool:
        """Map the connection (fd) a ROUTER message came from to its peer; True if that shows
        an earlier connection dropped (the peer came back on a new one, or the fd now serves
        another peer) whose event was not seen."""
        try:
            fd = part.get(zmq.SRCFD)  # deprecated in libzmq, still served; without it: leases only
        except (zmq.ZMQError, AttributeError):
            return False
        if self._peer_fd.get(ident) == fd:
            return False
        dropped = False
        old_fd = self._peer_fd.pop(ident, None)
        if old_fd is not None:
            self._fd_peer.pop(old_fd, None)
            self._report(ident.hex(), "it reconnected: the earlier connection closed")
            dropped = True
        old = self._fd_peer.pop(fd, None)
        if old is not None:
            self._peer_fd.pop(old, None)
            self._replies.pop(old, None)
            self._report(old.hex(), "connection closed")
            dropped = True
        self._fd_peer[fd], self._peer_fd[ident] = ident, fd
        return dropped

    def _poll_events(self) -> bool:
        """Take every waiting monitor event; True if some connection dropped."""
        seen = self.drops
        for address, d in list(self._dealers.items()):
            if _disconnects(d.monitor):
                self._drop(address, "connection closed by the peer, reset, or heartbeat timeout")
        if self._router_mon is not None:
            for fd in _disconnects(self._router_mon):
                ident = self._fd_peer.pop(fd, None)
                if ident is not None:
                    self._peer_fd.pop(ident, None)
                    self._replies.pop(ident, None)
                    self._report(ident.hex(), "connection closed by the peer, reset, or heartbeat timeout")
        return self.drops != seen

    def close(self) -> None:
        """Close every socket (unsent messages are dropped) and remove the ipc file."""
        if self._closed:
            return
        self._closed = True
        for address in list(self._dealers):
            self._close_dealer(address)
        if self._router is not None:
            self._router.disable_monitor()
            self._router_mon.close(linger=0)
            self._router.close(linger=0)
        self._router = self._router_mon = self._held = None
        self._replies.clear()
        self._fd_peer.clear()
        self._peer_fd.clear()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("zmq transport is closed")


def _ident(peer: str) -> bytes:
    try:
        return bytes.fromhex(peer)
    except ValueError:
        return b""


def _disconnects(monitor: zmq.Socket) -> list[int]:
    """File descriptors of the connections a monitor reports closed since the last call."""
    fds = []
    while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # cheaper than a failing NOBLOCK recv
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            fds.append(event["value"])
    return fds


register_transport("zmq", ZmqTransport)
