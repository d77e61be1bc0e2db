"""The ports of a standby router (router.leader): held, and refusing, until it leads.

A standby binds the ports it will serve on, so that nothing else takes them and a client or a
probe that reaches it learns at once that it does not serve here:

- gRPC: every connection is closed as soon as it is accepted, before gRPC's handshake. The
  client sees UNAVAILABLE, and a client of a list of servers (router.client, ``--server a,b``:
  gRPC's pick_first) moves on to the next address: the leader. A gRPC server answering
  UNAVAILABLE instead would keep a pick_first client on the standby (the first address that
  accepts a connection serves every call), and its retries would meet the same refusal.
- HTTP (the OpenAI API): every request, ``/health`` too, is answered 503 with ``Retry-After``
  and the OpenAI error body, then the connection closes. Plain HTTP: with TLS configured, a
  client's handshake fails instead (refused either way).

When it leads, the router closes these and starts its real servers on the same ports
(router.app); a connection attempted in between is refused by the kernel (UNAVAILABLE too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from router.aio import within
from router.drain import RETRY_AFTER_S

HEAD_BYTES, HEAD_TIMEOUT_S = 16384, 5.0  # what a standby reads of a request before answering (it answers anyway)
_BODY = json.dumps({"error": {"message": "this router is a standby (another leads the cluster); retry on another",
                              "type": "server_error", "param": None, "code": "service_unavailable"}}).encode()
_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
           + f"retry-after: {RETRY_AFTER_S}\r\ncontent-length: {len(_BODY)}\r\n".encode()
           + b"connection: close\r\n\r\n" + _BODY)


async def _refuse_grpc(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()  # (a reset, not a graceful close: the client gives up on this address at once)


async def _refuse_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):  # (a client that sends nothing, or too much, gets the answer too)
        await within(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
    with contextlib.suppress(ConnectionError):
        writer.write(_ANSWER)
        await writer.drain()
    writer.close()


class StandbyPorts:
    """The standby's listeners on ``host``: gRPC ``port`` and (unless None) ``http_port``."""

    def __init__(self, host: str, port: int, http_port: int | None) -> None:
        self.host, self.port, self.http_port = host, port, http_port
        self._servers: list[asyncio.base_events.Server] = []

    async def start(self) -> None:
        """Bind and refuse (OSError if a port is taken). ``port``/``http_port`` 0: a free one,
        and the attributes say which."""
        ports = [(self.port, _refuse_grpc)] + ([(self.http_port, _refuse_http)] if self.http_port is not None else [])
        for i, (port, refuse) in enumerate(ports):
            server = await asyncio.start_server(refuse, self.host, port, reuse_address=True, limit=HEAD_BYTES)
            self._servers.append(server)
            bound = server.sockets[0].getsockname()[1]
            if i == 0:
                self.port = bound
            else:
                self.http_port = bound

    async def stop(self) -> None:
        """Free the ports (the leader's servers bind them next)."""
        for server in self._servers:
            server.close()
            await server.wait_closed()
        self._servers.clear()
