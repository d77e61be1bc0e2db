"""A stream its client stops reading (router.unread, front_door.unread_stream_timeout_s): the
request is ended (its source closed: on the router, its requests aborted on every worker) while
the client still reads nothing; gRPC then answers RESOURCE_EXHAUSTED, SSE's connection is cut.
The relay itself first, then both front doors on real sockets with a tiny timeout."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.reject import Reject
from router.unread import Unread, relay
from tests.router.front_door_fakes import Served, until, until_async

TINY_S = 0.2


class Source:
    """An answer's source: ``n`` messages (None: endless), each after ``gap_s``; ``closed`` once
    its generator ended for any reason (the router's would have freed its requests)."""

    def __init__(self, n: int | None = None, gap_s: float = 0.0, fail: Exception | None = None) -> None:
        self.n, self.gap_s, self.fail, self.closed, self.sent = n, gap_s, fail, False, 0

    async def gen(self):
        try:
            while self.n is None or self.sent < self.n:
                await asyncio.sleep(self.gap_s)
                self.sent += 1
                yield self.sent
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True


def test_a_reader_gets_every_message_even_from_a_slow_source():
    """The clock runs only while a ready message waits to be taken: a source slower than the
    timeout is never cut off."""
    src = Source(n=4, gap_s=3 * TINY_S)

    async def read():
        return [m async for m in relay(src.gen(), TINY_S)]
    assert asyncio.run(read()) == [1, 2, 3, 4] and src.closed


def test_a_consumer_that_stops_taking_messages_ends_the_source_then_gets_unread():
    src, stalls = Source(), []

    async def stop_reading():
        stream = relay(src.gen(), TINY_S, on_stall=lambda: stalls.append(1))
        assert await anext(stream) == 1
        await until_async(lambda: src.closed)  # ended while the consumer still holds message 1
        assert stalls == [1]
        got = []
        with pytest.raises(Unread, match="unread_stream_timeout_s"):
            async for m in stream:  # the messages already ready, then Unread
                got.append(m)
        return got
    got = asyncio.run(stop_reading())
    assert len(got) <= 1 and src.sent <= 3  # at most one message ahead of the one being written


def test_closing_the_relay_closes_the_source_and_its_errors_reach_the_consumer():
    src = Source()

    async def close_early():
        stream = relay(src.gen(), TINY_S)
        await anext(stream)
        await stream.aclose()
    asyncio.run(close_early())
    assert src.closed

    failing = Source(n=1, fail=Reject(grpc.StatusCode.UNAVAILABLE, "no worker"))

    async def read():
        return [m async for m in relay(failing.gen(), TINY_S)]
    with pytest.raises(Reject, match="no worker"):
        asyncio.run(read())


def test_a_cancel_raised_inside_the_source_reaches_the_consumer_instead_of_a_hang():
    """A source whose own await is cancelled (not the consumer's cancel) ends the stream: the
    consumer, waiting for its next message, gets the CancelledError (bounded here by 5 s)."""
    async def source():
        yield "first"
        raise asyncio.CancelledError()  # as an inner future cancelled by someone else raises it

    async def read():
        got = []
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(5):
                async for m in relay(source(), TINY_S):
                    got.append(m)
        return got
    assert asyncio.run(read()) == ["first"]


# ---- both front doors, on real sockets -------------------------------------------------------
BIG = "x" * 16384  # messages big enough to fill flow-control windows and socket buffers quickly
MANY = 1000  # 16 MB in all: more than any window or buffer holds unread


@pytest.fixture
def served():
    # (the write timeout, which would cut an unread HTTP stream too, out of the way)
    srv = Served(front_door__unread_stream_timeout_s=TINY_S, front_door__write_timeout_s=600.0)
    srv.router.answer = [BIG] * MANY
    srv.holding(True)  # the last message waits: an answer ends only by being closed (``open``)
    yield srv
    srv.holding(False)
    srv.stop()


def test_grpc_a_stream_never_read_is_ended_and_answers_resource_exhausted(served):
    channel = grpc.insecure_channel(f"127.0.0.1:{served.port}")
    try:
        call = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(request_id="r", prompt="hi"))
        until(lambda: served.router.params)  # it started ...
        until(lambda: served.router.open == 0)  # ... and was ended while the client read nothing
        got = 0
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                got += 1
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "unread_stream_timeout_s" in err.value.details()
        assert got < MANY and served.router.finished == 0
    finally:
        channel.close()


def test_sse_a_stream_never_read_is_ended_and_its_connection_closed(served):
    body = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: a small window)
    s.settimeout(30)
    s.connect(("127.0.0.1", served.http_port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (served.http_port, len(body), body))
        until(lambda: served.router.params)
        until(lambda: served.router.open == 0)
        until(lambda: not served.router.http.server_state.connections)  # cut while the client reads nothing
        rest = b""  # what was sent before the cut, then the end (a read that hung: not closed)
        try:
            while part := s.recv(1 << 20):
                rest += part
        except ConnectionResetError:
            pass
        assert b"[DONE]" not in rest and served.router.finished == 0
    finally:
        s.close()


def test_sse_a_streamed_answer_bounds_its_connections_buffers(served):
    """A streamed answer bounds its connection's send buffers (front_door.stream_buffer_bytes,
    router.http_conn): the router's writes to a client that stopped reading wait after a few
    tens of KiB, not after the megabytes the kernel grows a loopback buffer to, so the stream
    soon counts as not read (parked: router.parking). A plain answer's connection keeps them."""
    limit = served.cfg.front_door.stream_buffer_bytes
    body = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
    s = socket.socket()
    s.connect(("127.0.0.1", served.http_port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (served.http_port, len(body), body))
        until(lambda: served.router.params)

        async def buffers():
            (conn,) = served.router.http.server_state.connections
            sock = conn.transport.get_extra_info("socket")
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), conn.transport.get_write_buffer_limits()
        until(lambda: served.call(buffers)[1][1] == limit)  # (the answer's first send sets them)
        sndbuf, (_, high) = served.call(buffers)
        assert sndbuf == 2 * limit and high == limit  # (Linux doubles SO_SNDBUF for its bookkeeping)
    finally:
        s.close()


def test_a_client_that_reads_is_not_cut_off(served):
    served.router.answer = ["a", "b", "c"]
    served.holding(False)
    status, _, body = served.post("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 4,
                                                      "stream": True})
    assert status == 200 and body.endswith(b"data: [DONE]\n\n") and served.router.finished == 1
