"""The probe's unread streams (router/unread.py seen from outside): the greedy token opens
streamed requests and never reads them, over HTTP (SSE) and gRPC, then asks again.

- **HTTP** (``unread``): a small receive buffer (4 KiB), the status line read and nothing after
  it; tallied by status (200 admitted, 429 its ``max_concurrent``).
- **gRPC** (``grpc unread``): one channel whose streams take at most ``LOOKAHEAD`` bytes ahead of
  their reader (grpc's ``lookahead_bytes``, BDP probing off: grpc would widen the window by
  itself), so the server's writes block after a few messages; the first message read, nothing
  after it. They are opened first, one after another, so they take the greedy token's places
  before the HTTP ones do. At the end each call is read to its end (``grpc unread end``): the
  server ended it unread (RESOURCE_EXHAUSTED naming ``unread_stream_timeout_s``), it finished
  (OK), or it was still open after ``END_READ_S`` (``open``).
- **again** (``greedy again http``, ``greedy again grpc``): after the hold, the greedy token's
  next request on each protocol, retried on its ``max_concurrent`` refusal until served or
  ``wait_s`` passed: served means the places its unread streams held came back (the streams
  were ended unread, or ran to their end into buffers), and it is tallied with the seconds it
  waited (``greedy_again_{http,grpc}_s``).
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import asyncio
import json
import socket
import time

from bench.probe_wire import PROMPT, Tally, Target, completion, http_call, http_request, split
from router.aio import within

LOOKAHEAD = 1024  # bytes a gRPC stream reads ahead of its reader: a few messages
END_READ_S = 10.0  # at the end, how long each unread gRPC call is read for its status
RETRY_S = 0.5  # between the greedy token's tries to be served again


def code_and_reason(code: str, details: str) -> str:
    """A gRPC status as tallied: its code, and which limit ended it where the message says."""
    for reason in ("unread_stream_timeout_s", "max_concurrent"):
        if reason in details:
            return f"{code} ({reason})"
    return code


class UnreadStreams:
    """The greedy token's unread streams on both protocols (``open``, then ``close``)."""

    def __init__(self, t: Target, tally: Tally, model: str, http_count: int, grpc_count: int,
                 max_tokens: int) -> None:
        self.t, self.tally, self.model = t, tally, model
        self.http_count, self.grpc_count, self.max_tokens = http_count, grpc_count, max_tokens
        self.tasks: list[asyncio.Task] = []
        self.socks: list[socket.socket] = []
        self.calls: list = []
        self.channel = None

    async def open(self) -> None:
        await self._grpc()
        self._http()

    async def _grpc(self) -> None:
        if not self.grpc_count:
            return
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
        from router.client import make_request
        self.channel = grpc.aio.insecure_channel(self.t.grpc, options=[("grpc.http2.lookahead_bytes", LOOKAHEAD),
                                                                        ("grpc.http2.bdp_probe", 0)])
        stub = pb_grpc.GenerationStub(self.channel)
        meta = (("authorization", f"Bearer {self.t.greedy}"),)
        for _ in range(self.grpc_count):
            call = stub.Generate(make_request(PROMPT, max_tokens=self.max_tokens, ignore_eos=True, logprobs=5),
                                 metadata=meta)
            try:
                await call.read()
            except grpc.aio.AioRpcError as e:
                self.tally.add("grpc unread", code_and_reason(e.code().name, e.details() or ""))
                continue
            self.tally.add("grpc unread", "OK")
            self.calls.append(call)

    def _http(self) -> None:
        """The status line read, nothing after it."""
        host, port = split(self.t.http)
        body = json.dumps({"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens,
                           "stream": True, "logprobs": 5, "ignore_eos": True}).encode()
        raw = http_request("POST", "/v1/completions", self.t.http, self.t.greedy, body)

        async def one() -> None:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server's writes block soon
            s.setblocking(False)
            loop = asyncio.get_running_loop()
            try:
                await loop.sock_connect(s, (host, port))
                await loop.sock_sendall(s, raw)
                first = await within(loop.sock_recv(s, 16), 300)
            except (OSError, asyncio.TimeoutError) as e:
                self.tally.add("unread", f"failed: {type(e).__name__}")
                s.close()
                return
            self.socks.append(s)
            self.tally.add("unread", first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed")
        for _ in range(self.http_count):
            self.tasks.append(asyncio.create_task(one()))

    async def again(self, wait_s: float) -> dict:
        """The greedy token asks once more on each protocol until served; seconds waited."""
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
        from router.client import make_request
        waited: dict = {}
        t0 = time.monotonic()
        raw = http_request("POST", "/v1/completions", self.t.http, self.t.greedy, completion(self.model, 2))
        while True:
            try:
                status, _ = await http_call(self.t.http, raw)
            except (OSError, asyncio.TimeoutError) as e:
                status = f"failed: {type(e).__name__}"
            if status != 429 or time.monotonic() - t0 > wait_s:
                break
            await asyncio.sleep(RETRY_S)
        self.tally.add("greedy again http", str(status))
        waited["greedy_again_http_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        async with grpc.aio.insecure_channel(self.t.grpc) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while True:
                try:
                    async for _ in stub.Generate(make_request(PROMPT, max_tokens=2),
                                                 metadata=(("authorization", f"Bearer {self.t.greedy}"),), timeout=120):
                        pass
                    outcome = "OK"
                except grpc.aio.AioRpcError as e:
                    outcome = code_and_reason(e.code().name, e.details() or "")
                if "max_concurrent" not in outcome or time.monotonic() - t0 > wait_s:
                    break
                await asyncio.sleep(RETRY_S)
        self.tally.add("greedy again grpc", outcome)
        waited["greedy_again_grpc_s"] = time.monotonic() - t0
        return waited

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.socks:
            s.close()
        await asyncio.gather(*(self._end(call) for call in self.calls))
        if self.channel is not None:
            await self.channel.close()

    async def _end(self, call) -> None:
        """Read an unread gRPC call to its end and tally its status."""
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        try:
            async with asyncio.timeout(END_READ_S):
                while await call.read() is not grpc.aio.EOF:
                    pass
            outcome = "OK"
        except grpc.aio.AioRpcError as e:
            outcome = code_and_reason(e.code().name, e.details() or "")
        except TimeoutError:
            call.cancel()
            outcome = "open"
        self.tally.add("grpc unread end", outcome)
