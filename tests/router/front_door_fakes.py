"""A router without workers behind the real front door (HTTP and gRPC servers on real sockets).

``FakeRouter`` is what the front door touches of router.server.Router: its ``generate`` runs
the router's own validation (router.requests, with the real tokenizer when given one, tool_choice
included) and then answers two tokens, the second after ``hold`` is set (or the texts of
``answer``, one response each); ``Served`` runs both servers on an event
loop in a thread, as ``pdserve serve`` does.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import threading
import time
from types import SimpleNamespace

import grpc

from engine.errors import InvalidRequestError
from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.auth import FrontDoor
from router.config import load_config
from router.requests import Limits, prompt_ids, request_id, sampling_params, tool_call_token, with_tool_choice
from router.server import Reject
from router.unread import Unread, relay


class FakeRouter(pb_grpc.GenerationServicer):
    def __init__(self, cfg, tokenizer=None) -> None:
        self.cfg, self.door, self.tokenizer = cfg, FrontDoor(), tokenizer
        self.limits = Limits(context_length=128, vocab_size=tokenizer.vocab_size if tokenizer else 1000,
                             default_max_tokens=8, input=cfg.limits)
        self.served_model_name, self.roles = "m", ("colocated",)
        self.pools = SimpleNamespace(any_alive=lambda role: True)
        self.jobs: dict = {}
        self.token_text = str
        self.http, self.http_port = None, None
        self.hold: asyncio.Event | None = None  # None: answer at once
        self.extra: tuple[int, str] = (0, "")  # (responses, text of each) between the first and the hold
        self.finished = 0
        self.answer: list[str] | None = None  # each response's text instead of "a", "b"; the last stops
        self.params: list = []  # each request's SamplingParams, as the router's validation built them
        self.open = 0  # answers in progress (a request's generator not yet closed)

    async def detokenize(self, ids):  # as Router.detokenize
        return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.decode, ids)

    def job(self, owner, request_id):  # as Router.job: no job runs here
        return self.jobs.get(request_id)

    def stream_hold(self):  # as Router.stream_hold: nothing here to park
        return None

    async def generate(self, request, owner, time_left, prefer=None, hold=None):
        """``answers``, counted in ``open`` while it runs (closed early too: a request ended)."""
        self.open += 1
        try:
            async for r in self.answers(request):
                yield r
        finally:
            self.open -= 1

    async def answers(self, request):
        try:
            request_id(request, self.limits)
            n = len(prompt_ids(request, self.tokenizer, self.limits)) if self.tokenizer is not None else 1
            params = sampling_params(request.sampling, self.limits, n)
            if self.tokenizer is not None:
                params = with_tool_choice(request, params, tool_call_token(self.tokenizer))
        except InvalidRequestError as e:
            raise Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self.params.append(params)
        if self.answer is not None:
            for k, text in enumerate(self.answer):
                last = k == len(self.answer) - 1
                if last and self.hold is not None:
                    await self.hold.wait()
                yield pb.GenerateResponse(request_id=request.request_id, text=text,
                                          finish_reason=pb.FINISH_REASON_STOP if last else 0,
                                          usage=pb.Usage(prompt_tokens=n, completion_tokens=k + 1) if last else None)
            self.finished += 1
            return
        lps = [pb.TokenLogprob(token_id=7, logprob=-0.5, top=[pb.TopLogprob(token_id=7, logprob=-0.5)] *
                               (params.logprobs or 0))] if params.logprobs is not None else []
        yield pb.GenerateResponse(request_id=request.request_id, text="a", logprobs=lps)
        for _ in range(self.extra[0]):
            yield pb.GenerateResponse(request_id=request.request_id, text=self.extra[1])
        if self.hold is not None:
            await self.hold.wait()
        self.finished += 1
        yield pb.GenerateResponse(request_id=request.request_id, text="b", logprobs=lps,
                                  finish_reason=pb.FINISH_REASON_LENGTH,
                                  usage=pb.Usage(prompt_tokens=n, completion_tokens=2))

    async def Generate(self, request, context):  # (as Router.Generate: relayed, router.unread)
        try:
            async for r in relay(self.generate(request, "", None), self.cfg.front_door.unread_stream_timeout_s):
                yield r
        except Unread as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Reject as e:
            await context.abort(e.code, str(e))

    async def stop(self) -> None:
        pass


class Served:
    """``FakeRouter`` behind the real HTTP (router.openai_http) and gRPC (router.server) servers.

    ``overrides``: config keys (``front_door.header_timeout_s``) -> values."""

    def __init__(self, tokenizer=None, host: str = "127.0.0.1", **overrides) -> None:
        from router.openai_http import start_http
        from router.server import start_server
        self.cfg = load_config(None, {k.replace("__", "."): v for k, v in overrides.items()})
        self.router = FakeRouter(self.cfg, tokenizer)
        self.stopped = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            self.router.hold = asyncio.Event()
            self.router.hold.set()
            self.grpc, self.port = await start_server(self.router, host, 0)
            self.router.http, self.http_port = await start_http(self.router, host, 0, self.cfg.security)

        self.call(start)

    def call(self, coro_fn, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def soon(self, coro_fn):
        """Start ``coro_fn()`` on the server's loop; returns its concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)

    def holding(self, on: bool) -> None:
        """Make the next answers wait before their last token (True), or let them all go."""
        self.loop.call_soon_threadsafe(self.router.hold.clear if on else self.router.hold.set)

    def stop(self) -> None:
        from router.app import stop_cluster
        self.stopped = True
        self.call(lambda: stop_cluster(self.router, self.grpc))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def post(self, path: str, body, headers: dict | None = None, conn=None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a POST; ``body``: bytes as is, anything else as JSON."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = {"content-type": "application/json", "host": f"127.0.0.1:{self.http_port}", **(headers or {})}
        c = conn or http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        c.request("POST", path, data, {k: v for k, v in hdrs.items() if v is not None})
        r = c.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        if conn is None:
            c.close()
        return out

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        c.request("GET", path, headers={"host": f"127.0.0.1:{self.http_port}", **(headers or {})})
        r = c.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        c.close()
        return out

    def raw(self) -> socket.socket:
        """A plain TCP connection to the HTTP port (30 s hang guard on reads)."""
        s = socket.create_connection(("127.0.0.1", self.http_port))
        s.settimeout(30)
        return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (reads end) without sending an HTTP answer first."""
    try:
        data = s.recv(65536)
    except ConnectionResetError:
        return True
    return data == b""


HANG_GUARD_S = 30  # only against a hang: every wait below ends as soon as its condition holds


def until(cond) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, "hang guard"
        time.sleep(0.01)


async def until_async(cond) -> None:
    """``until`` inside an event loop: the loop runs while it waits."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, "hang guard"
        await asyncio.sleep(0.01)


def stream(srv) -> socket.socket:
    """A streamed completion in progress (its first token read); the server closes it at the end."""
    body = json.dumps({**COMPLETION, "stream": True}).encode()
    s = srv.raw()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (srv.http_port, len(body), body))
    got = b""
    while b"data: " not in got:
        part = s.recv(65536)
        assert part, got
        got += part
    assert got.startswith(b"HTTP/1.1 200")
    return s


def rest(s: socket.socket) -> bytes:
    out = b""
    while part := s.recv(65536):
        out += part
    return out


def readable(s: socket.socket) -> bool:
    return bool(select.select([s], [], [], 0)[0])


COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
