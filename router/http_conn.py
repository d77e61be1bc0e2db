"""Connections to the HTTP port, bounded before any request exists (uvicorn's h11 protocol, extended).

What uvicorn offers is used as is: ``timeout_keep_alive`` (``front_door.keepalive_s``) closes a
connection idle between requests, ``h11_max_incomplete_event_size`` (``front_door.header_bytes``)
caps a request's line and headers. What it lacks is added here, per connection:

- **Header timeout** (``front_door.header_timeout_s``, against slowloris): from a connection's
  opening, or from the first byte of its next request, the request line and headers must all be
  in within this, however slowly bytes trickle; else the connection is closed. (The body has its
  own: router.http_body.)
- **Write timeout** (``front_door.write_timeout_s``, against a client that stops reading its
  stream): asyncio pauses a connection's writes when more than its high-water mark (64 KiB) is
  unsent, and uvicorn then holds the response's next ``send`` until the client reads. A pause
  that lasts this long aborts the connection: the response's ``send`` returns, its request sees
  the disconnect and ends its requests on every worker (router.openai_http), freeing the slot
  it held under ``limits.concurrent_rpcs`` and its token's ``max_concurrent``. A client that
  reads, however slowly, keeps the buffer draining and is not cut off.
- **Unread streams** (``front_door.unread_stream_timeout_s``, router.unread): each request's
  ASGI scope carries its connection's ``abort`` (extension ``ABORT``), so a stream whose client
  took no next event that long is cut off at once, its requests already ended.
- **A stream's buffers** (``front_door.stream_buffer_bytes``): a streamed answer calls its
  connection's ``streaming`` (extension ``STREAM``), which bounds the kernel's send buffer
  (``SO_SNDBUF``; Linux doubles it) and asyncio's high-water mark to it. Otherwise the kernel
  grows a loopback or LAN connection's buffer to megabytes, and a client that stops reading
  an SSE stream would take hundreds of tokens, each with its decode steps, before the server's
  writes wait and the stream counts as not read (its requests parked: router.parking). The
  answer puts them back at its end (a keep-alive connection's next, plain, answer may need
  them for a large body on a long link; the kernel's own growing does not come back). Over TLS
  the bound applies to the TLS layer's buffer, over the TCP transport's default 64 KiB.
- **Connection caps**: ``front_door.connections_per_client`` open connections per client
  address, ``front_door.connections`` in all. At a cap, the oldest *idle* connection there (no
  request in progress: waiting for its headers, or kept alive between requests) is closed to
  make room, so a flood of idle connections cannot lock out a client with work to do, from
  another address or its own; when every one is busy, the new connection gets a 503 and is closed.
- **New connections per address** (``front_door.new_connections_per_client_s``, a burst of
  ``new_connections_burst``; router.conn_rate), against clients that open and close
  connections in a tight loop (the caps above never meet them: they hold none for long): a
  connection beyond its address's rate is reset at once, before uvicorn sets it up, with no
  answer written (the least work the event loop that serves every request can do for it).

Requests in progress are counted by router.http_guard (idle connections do not count), not by
uvicorn's ``limit_concurrency``, which counts connections and is left off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.conn_rate import NewConnections, client_key
from router.drain import RETRY_AFTER_S

log = logging.getLogger("pdserve.router")

_BUSY_BODY = json.dumps({"error": {"message": "too many connections (front_door.connections_per_client, "
                                              "front_door.connections); retry shortly", "type": "server_error",
                                   "param": None, "code": "service_unavailable"}}).encode()
# The ASGI scope extension under which each request finds its connection's ``abort`` (a stream
# its client stopped reading is cut off at once: router.unread; no ASGI message can abort)
ABORT = "pdserve.abort"
STREAM = "pdserve.stream"  # ... and its ``streaming``: the connection's buffers bounded for a stream

BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: %d\r\ncontent-length: %d\r\n\r\n%s" % (RETRY_AFTER_S, len(_BUSY_BODY), _BUSY_BODY))


class ConnTable:
    """The open connections, oldest first, per client address and in all."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self.by_client: dict[str, dict[GuardedH11, None]] = {}
        self.all: dict[GuardedH11, None] = {}

    def admit(self, conn: GuardedH11) -> bool:
        """Register ``conn``, closing an idle one to make room at a cap; False: no room."""
        mine = self.by_client.get(conn.client_key, {})
        if len(mine) >= self.per_client and not self._evict(mine):
            return False
        if len(self.all) >= self.total and not self._evict(self.all):
            return False
        self.by_client.setdefault(conn.client_key, {})[conn] = None
        self.all[conn] = None
        return True

    def _evict(self, group: dict[GuardedH11, None]) -> bool:
        victim = next((c for c in group if c.idle()), None)
        if victim is None:
            return False
        victim.close_idle()
        self.remove(victim)
        return True

    def remove(self, conn: GuardedH11) -> None:
        self.all.pop(conn, None)
        mine = self.by_client.get(conn.client_key)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.client_key]


class GuardedH11(H11Protocol):
    """uvicorn's H11Protocol with a header timeout and the connection caps (``guarded`` makes
    the class for one server)."""

    table: ConnTable
    rate: NewConnections
    header_timeout_s: float
    write_timeout_s: float
    stream_buffer_bytes: int

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self.client_key = ""
        self.refused = False  # reset at its opening (over its address's rate): uvicorn never saw it

    def connection_made(self, transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self.client_key = client_key(peer[0] if isinstance(peer, tuple) and peer else "")
        if not self.rate.admit(self.client_key):
            self.refused = True
            transport.abort()
            return
        super().connection_made(transport)
        if not self.table.admit(self):
            transport.write(BUSY)
            transport.close()
            return
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self._stop_timer()
        self._stop_write_timer()
        self.table.remove(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)
        self._watch_head()

    def handle_events(self) -> None:
        super().handle_events()
        # A request just begun has its cycle, whose app task has not run yet: it finds the hook
        if self.cycle is not None and not self.cycle.response_complete:
            extensions = self.cycle.scope.setdefault("extensions", {})
            extensions[ABORT], extensions[STREAM] = self._abort_stream, self._streaming

    def _streaming(self) -> Streaming:
        """This connection now streams an answer: its buffers bounded (module doc)."""
        return Streaming(self.transport, self.stream_buffer_bytes)

    def _abort_stream(self) -> None:
        self.transport.abort()  # (connection_lost follows: the response sees a disconnect)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timeout)

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def _write_timeout(self) -> None:
        self._write_timer = None
        log.info("event=write_timeout client=%s: %d bytes unread for %.0f s; connection closed",
                 self.client_key, self.transport.get_write_buffer_size(), self.write_timeout_s)
        self.transport.abort()  # (connection_lost follows: the response sees a disconnect)

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def idle(self) -> bool:
        """No request in progress: waiting for one's headers, or kept alive between requests."""
        return self.cycle is None or self.cycle.response_complete

    def close_idle(self) -> None:
        self._stop_timer()
        if not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    def _watch_head(self) -> None:
        """A timer while a request's headers are awaited (armed once: more bytes do not reset it)."""
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)
        else:
            self._stop_timer()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and self.idle():
            self.close_idle()

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class Streaming:
    """A connection's buffers bounded for one streamed answer (module doc), put back by ``end``."""

    def __init__(self, transport: asyncio.Transport, limit: int) -> None:
        self.transport, self.sock = transport, transport.get_extra_info("socket")
        self.limits = transport.get_write_buffer_limits()
        self.sndbuf = None
        try:
            if self.sock is not None:
                self.sndbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)
            transport.set_write_buffer_limits(high=limit)
        except (OSError, RuntimeError):  # (the connection closed meanwhile: nothing to bound)
            pass

    def gone(self) -> bool:
        """The connection closed (a send then returns without sending: uvicorn)."""
        return self.transport.is_closing()

    def end(self) -> None:
        if self.gone():
            return
        try:
            if self.sndbuf is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf // 2)  # (Linux doubles it)
            self.transport.set_write_buffer_limits(high=self.limits[1], low=self.limits[0])
        except (OSError, RuntimeError):
            pass


def guarded(front_door) -> type[GuardedH11]:
    """The protocol class for one HTTP server under ``front_door`` (router.config.FrontDoorConfig)."""
    return type("GuardedH11", (GuardedH11,), {
        "table": ConnTable(front_door.connections_per_client, front_door.connections),
        "rate": NewConnections(front_door.new_connections_per_client_s, front_door.new_connections_burst),
        "header_timeout_s": front_door.header_timeout_s, "write_timeout_s": front_door.write_timeout_s,
        "stream_buffer_bytes": front_door.stream_buffer_bytes})
