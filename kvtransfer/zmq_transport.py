"""ZeroMQ frame transport: one ROUTER socket to be reached at, one DEALER per connected address.

- ``bind`` opens a ROUTER on ``tcp://<host>:<random port>`` (``scheme="tcp"``) or on a fresh
  ``ipc://`` socket file in the temp directory (``scheme="ipc"``, same host only, faster).
  Messages arriving there are reported with the sender's routing identity (hex) as peer id,
  and ``send`` to that id replies through the ROUTER.
- ``connect(address)`` opens a DEALER to it; the peer id is the address itself, both for
  ``send`` and for the messages that come back on that DEALER.

Sending never blocks: each message is offered with ``NOBLOCK``; if the socket's high-water mark
is reached it waits, in order, in a per-socket outbox that every later ``send`` and ``recv``
call flushes first (so per-peer order holds). Payload frames go ``copy=False``: pyzmq keeps a
reference to each buffer until libzmq has written it, so callers need not keep them alive, but
must not modify them until then (frames below pyzmq's copy threshold are copied anyway).
The ROUTER runs with ``ROUTER_MANDATORY``: a reply to a peer that has disconnected is dropped
and counted in ``unroutable`` instead of being silently lost. Sockets close with ``LINGER=0``.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from collections import deque
from collections.abc import Sequence

import zmq

from kvtransfer.base import Buffer, FrameTransport, register_transport


class ZmqTransport(FrameTransport):
    """A FrameTransport over pyzmq (registered as ``"zmq"``).

    Args:
        scheme: "tcp" or "ipc".
        host: interface the ROUTER binds to for tcp (loopback by default).
    """

    name = "zmq"

    def __init__(self, scheme: str = "tcp", host: str = "127.0.0.1") -> None:
        if scheme not in ("tcp", "ipc"):
            raise ValueError(f"unknown zmq scheme {scheme!r}; valid: ipc, tcp")
        self.scheme, self.host = scheme, host
        self._ctx = zmq.Context.instance()  # shared: one I/O thread for every transport
        self._router: zmq.Socket | None = None
        self._address: str | None = None
        self._ipc_path: str | None = None
        self._dealers: dict[str, zmq.Socket] = {}  # address -> DEALER
        self._outbox: dict[zmq.Socket, deque[list[Buffer]]] = {}
        self._turn = 0  # round-robin start for recv, so no socket starves the others
        self._closed = False
        self.unroutable = 0  # replies dropped because their peer had disconnected

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
            sock.bind(f"tcp://{self.host}:*")
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"pdserve-{uuid.uuid4().hex[:16]}.ipc")
            self._address = f"ipc://{self._ipc_path}"
            sock.bind(self._address)
        self._router = sock
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
            sock.connect(address)
            self._dealers[address] = sock
        return address

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._outbox[sock] = deque()
        return sock

    # ---- messages ------------------------------------------------------------------------
    def send(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Queue one message for ``peer`` (a connected address or a ROUTER peer's hex id).

        Raises:
            ValueError: ``peer`` is neither.
        """
        self._check_open()
        sock = self._dealers.get(peer)
        if sock is not None:
            msg = list(frames)
        else:
            try:
                ident = bytes.fromhex(peer)
            except ValueError:
                ident = b""
            if self._router is None or not ident:
                raise ValueError(f"unknown zmq peer {peer!r}: connect() to it first")
            sock, msg = self._router, [ident, *frames]
        self._outbox[sock].append(msg)
        self._flush(sock)

    def _flush(self, sock: zmq.Socket) -> None:
        queue = self._outbox[sock]
        while queue:
            try:
                # A multipart message is queued atomically: Again means nothing was taken.
                sock.send_multipart(queue[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self.unroutable += 1  # ROUTER peer went away
            queue.popleft()

    def recv(self) -> tuple[str, list[Buffer]] | None:
        """Flush outboxes, then take the next waiting message from any socket.

        Returns:
            (peer id, frames as memoryviews) or None when nothing is waiting.
        """
        if self._closed:
            return None
        for sock, queue in self._outbox.items():
            if queue:
                self._flush(sock)
        sources: list[tuple[str | None, zmq.Socket]] = list(self._dealers.items())
        if self._router is not None:
            sources.append((None, self._router))
        for i in range(len(sources)):
            address, sock = sources[(self._turn + i) % len(sources)]
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._turn = (self._turn + i + 1) % len(sources)
            if address is None:  # ROUTER: first part is the sender's routing identity
                return parts[0].bytes.hex(), [p.buffer for p in parts[1:]]
            return address, [p.buffer for p in parts]
        return None

    def close(self) -> None:
        """Close every socket (unsent messages are dropped) and remove the ipc file."""
        if self._closed:
            return
        self._closed = True
        for sock in self._outbox:
            sock.close(linger=0)
        self._outbox.clear()
        self._dealers.clear()
        self._router = None
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("zmq transport is closed")


register_transport("zmq", ZmqTransport)
