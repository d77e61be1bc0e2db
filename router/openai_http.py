"""The OpenAI-compatible HTTP front door, beside gRPC in the router's process and event loop.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
with ``stream: true``, ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Every
request goes through ``Router.generate``, as gRPC's do: the same validation, admission queue,
placement, limits and tokens (``Authorization: Bearer``). Shapes: router.openai_api (requests),
router.openai_answer (responses).

Errors are OpenAI's JSON with the matching status: 400 bad input (``param`` names it; a body
too deep, not JSON or with a lone surrogate too: router.http_body), 401 no valid token, 403 a
foreign Host or Origin (router.http_guard), 404 unknown model, 408 a body too slow, 413 body
over ``limits.message_bytes``, 415 a body that is not JSON, 429 admission queue full (or no
capacity for ``router.queue_timeout_s``, or over the token's policy: router.admission; with
``Retry-After``), 503 no worker, too many requests in progress, or
stopping (with ``Retry-After``). No malformed body is a 500. A streamed request answers
with its status until its first token is out; an error after that comes as a last event
``data: {"error": ...}``. A client that disconnects ends its requests on every worker at once:
each response watches the connection (not only the next write, which may be far off while a
request waits for admission).

Limits: ``limits.message_bytes`` per body, ``limits.choices`` per request (prompts x n),
``front_door.logprob_entries`` log probabilities per answer (router.openai_api),
``limits.concurrent_rpcs`` requests in progress (beyond: 503; idle connections do not count),
and ``front_door.unread_stream_timeout_s`` for a stream's client to take its next event
(router.unread: beyond, its requests end and the connection is aborted).
Connections: router.http_conn (header and write timeouts, caps per client address and in all). ``/health``
is open, as gRPC's health service is: 200 while a worker of every role serves and the router
is not stopping (router.drain), 503 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from router.auth import is_loopback
from router.http_body import read_json
from router.http_conn import ABORT, STREAM, guarded
from router.http_guard import Guard
from router.openai_answer import Shaper, models_list
from router.openai_api import (IDEMPOTENCY_HEADER, ApiError, ChatCompletionRequest, CompletionRequest, api_error,
                               check_logprob_budget, parse, requests_for)
from router.reject import Reject, retry_after
from router.unread import Unread, relay

log = logging.getLogger("pdserve.router")

SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
               "x-accel-buffering": "no"}


class ClientGone(Exception):
    """The client closed the connection."""


async def _decode(router, ids) -> str:
    """A prompt's token ids as text (echo), checked first (the router's own check comes later)
    and decoded on the tokenizer's thread, not the event loop."""
    ids = list(ids)
    lim = router.limits
    if len(ids) >= lim.context_length or any(not 0 <= t < lim.vocab_size for t in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {lim.vocab_size}) and fewer than "
                            f"{lim.context_length}", "prompt")
    return await router.detokenize(ids)


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, coro):
    """``coro``'s result, unless the client disconnects first: then it is cancelled (its
    requests freed) and ClientGone raised."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


def build_app(router):
    """The FastAPI app over ``router`` (a router.server.Router, started)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)  # Starlette's own: 404 unknown path, 405, ...
    routes = _Routes(router)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    return app


def error_response(e: ApiError) -> Response:
    """OpenAI's JSON error with its status and headers (a 401's challenge, a refusal's hint)."""
    headers = {"www-authenticate": "Bearer"} if e.status == 401 else \
        {"connection": "close"} if e.status in (408, 413) else None  # (the body's rest unread)
    if getattr(e, "retry_after", None) is not None:  # (a refusal's hint: _refusal)
        headers = {**(headers or {}), "retry-after": e.retry_after}
    # (ASCII JSON: a message may quote the client's input, lone surrogates included)
    return Response(json.dumps(e.body()), status_code=e.status, headers=headers, media_type="application/json")


async def _api_error(request, e: ApiError) -> Response:
    return error_response(e)


async def _http_error(request, e: HTTPException) -> Response:
    return error_response(ApiError(e.status_code, str(e.detail), type_="invalid_request_error"))


class _Routes:
    """The app's handlers over one router (its config read once, when the app is built)."""

    def __init__(self, router) -> None:
        self.router = router
        self.limits, self.door_cfg = router.cfg.limits, router.cfg.front_door
        self.started = int(time.time())

    def caller(self, request: Request) -> str:
        """The owner of the request's token; ApiError 401 without a valid one."""
        value = request.headers.get("authorization")
        owner = self.router.door.auth.caller([("authorization", value)] if value else [])
        if owner is None:
            raise ApiError(401, "this token is not valid here" if value else
                           "this server needs `Authorization: Bearer TOKEN`", code="invalid_api_key")
        return owner

    async def health(self) -> Response:
        router = self.router
        ok = not router.door.gate.draining and router.limits is not None and \
            all(router.pools.any_alive(r) for r in router.roles)
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def models(self, request: Request):
        self.caller(request)
        return models_list(self.router.served_model_name, self.router.limits.context_length, self.started)

    async def completions(self, request: Request):
        return await self.complete(request, CompletionRequest)

    async def chat_completions(self, request: Request):
        return await self.complete(request, ChatCompletionRequest)

    async def complete(self, request: Request, kind) -> Response:
        owner = self.caller(request)
        try:
            raw = await read_json(request, self.limits.message_bytes, self.door_cfg.json_depth,
                                  self.door_cfg.body_timeout_s)
        except ClientDisconnect:  # gone while sending the body: nothing started
            return Response(status_code=499)
        req = parse(kind, raw, self.limits.choices)
        reqs, shaper = await self._shape(req, kind is ChatCompletionRequest, request.headers.get(IDEMPOTENCY_HEADER))
        hold = self.router.stream_hold()  # (parks the choices' requests while a stream is not read)
        return await _answer(request, req, _merged(self.router, reqs, owner, req.n, hold), shaper,
                             self.door_cfg, hold)

    async def _shape(self, req, chat: bool, key: str | None = None) -> tuple[list, Shaper]:
        """The request's choices as router requests (ids from ``key``: its Idempotency-Key), checked,
        and the shaper of its answer."""
        router = self.router
        if req.model != router.served_model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist here; this server serves "
                                f"{router.served_model_name!r} (GET /v1/models)", "model", code="model_not_found")
        rid, reqs = requests_for(req, "chatcmpl" if chat else "cmpl", self.limits.choices, key)
        check_logprob_budget(reqs, chat, router.limits.context_length, router.limits.default_max_tokens,
                             self.door_cfg.logprob_entries)
        echo = None
        if not chat and req.echo:  # the prompt's text before each choice's completion
            echo = [g.prompt if g.WhichOneof("input") == "prompt" else await _decode(router, g.token_ids.ids)
                    for g in reqs]
        return reqs, Shaper(chat, rid, router.served_model_name, len(reqs), router.token_text, echo,
                            tools=[t["function"]["name"] for t in req.tools] if chat and req.tools_offered else ())


async def _answer(request: Request, req, events, shaper: Shaper, door: Any, hold: Any) -> Response:
    """The whole answer, or a stream whose status the first event decides: an error before any
    token (bad input, a full queue, no worker) is a plain error answer, not a 200 stream (one
    its client stops reading has ``hold`` parked, then is ended: router.unread)."""
    try:
        if not req.stream:
            return await until_disconnect(request.receive, _whole(events, shaper, req.n))
        first = await until_disconnect(request.receive, anext(events, None))
    except Reject as e:
        await events.aclose()
        raise _refusal(e) from None
    except ClientGone:  # its requests are freed; nobody reads an answer (499: nginx's "client closed")
        await events.aclose()
        log.info("event=client_disconnected before the answer")
        return Response(status_code=499)
    except BaseException:
        await events.aclose()
        raise
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _SSE(_sse(first, events, shaper, req.n, include_usage), door, hold)


def _refusal(e: Reject) -> ApiError:
    """The HTTP answer for a router refusal, with its retry hint (429's ``Retry-After``)."""
    err = api_error(e.code, str(e))
    hint = getattr(e, "retry_after_s", None)
    err.retry_after = None if hint is None else retry_after(hint)
    return err


class _SSE(Response):
    """Server-sent events from an async iterator, ended (and the iterator closed, which
    frees its requests) when the client disconnects, whether or not a write fails, or when it
    takes no next event for ``front_door.unread_stream_timeout_s`` (router.unread; ``hold`` is
    parked before: router.parking): then the connection is aborted (router.http_conn's
    ``ABORT`` extension; without it, uvicorn closes it once we return)."""

    def __init__(self, chunks: AsyncIterator[bytes], door: Any, hold: Any) -> None:  # (no Response.__init__)
        self.chunks, self.door, self.hold, self.background = chunks, door, hold, None
        self.raw_headers = [(k.encode(), v.encode()) for k, v in SSE_HEADERS.items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        abort, streaming = (scope.get("extensions", {}).get(k) for k in (ABORT, STREAM))
        conn = streaming() if streaming is not None else None  # (bounded buffers: router.http_conn)

        async def pump() -> None:
            async with contextlib.aclosing(relay(self.chunks, self.door.unread_stream_timeout_s, abort, self.hold,
                                                 self.door.park_unread_s)) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if conn is not None and conn.gone():  # (a send returns on a closed connection:
                        raise ClientGone()  # not a taken message, which would place parked requests)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, pump())
        except (ClientGone, OSError):
            log.info("event=client_disconnected during a stream")
        except Unread:  # its requests were ended (and logged) when it stalled: router.unread
            pass
        finally:
            await self.chunks.aclose()
            if conn is not None:
                conn.end()


async def _merged(router, reqs, owner: str, n: int = 1, hold: Any = None) -> AsyncIterator[tuple[int, Any]]:
    """Every choice's responses as they come, tagged with the choice's index. A choice's
    refusal (router.server.Reject) ends them all; closing this ends them all.

    The ``n`` choices of one prompt (``reqs`` is prompt-major) share its prefill: the first
    runs alone until its first token, then the others start on the same workers, where the
    prompt's blocks are in the prefix cache by then (computed once, not n times)."""
    q: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    def start(i: int, prefer=None) -> None:
        tasks.append(asyncio.create_task(run(i, reqs[i], prefer), name=f"choice-{reqs[i].request_id}"))

    async def run(i: int, req, prefer) -> None:
        followers = range(i + 1, i + n) if n > 1 and i % n == 0 else range(0)
        try:
            async with contextlib.aclosing(router.generate(req, owner, None, prefer, hold)) as responses:
                async for r in responses:
                    if followers:
                        job = router.job(owner, req.request_id)
                        where = (job.prefill_id, job.decode_id) if job is not None else None
                        for k in followers:
                            start(k, where)
                        followers = range(0)
                    q.put_nowait((i, r, None))
            q.put_nowait((i, None, None))
        except Exception as e:  # (a cancel is not: it is ours, from the finally below)
            q.put_nowait((i, None, e))

    for i in range(0, len(reqs), n):
        start(i)
    try:
        left = len(reqs)
        while left:
            i, r, err = await q.get()
            if err is not None:
                raise err
            if r is None:
                left -= 1
            else:
                yield i, r
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _whole(events, shaper: Shaper, n: int) -> dict[str, Any]:
    async with contextlib.aclosing(events):
        async for i, r in events:
            shaper.add(i, r)
    return shaper.whole(n)


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(first, events, shaper: Shaper, n: int, include_usage: bool):
    try:
        item = first
        while item is not None:
            i, r = item
            if r.text or r.finish_reason or r.logprobs:  # (else a held-back token: its text comes later)
                for chunk in shaper.chunks(i, r):
                    yield _event(chunk)
            item = await anext(events, None)
        if include_usage:
            yield _event(shaper.usage_chunk(n))
        yield b"data: [DONE]\n\n"
    except Reject as e:  # after the first token: the status is sent; the error is an event
        yield _event(api_error(e.code, str(e)).body())
    finally:
        await events.aclose()


async def start_http(router, host: str, port: int, tls=None) -> tuple[Any, int]:
    """Serve the OpenAI API on ``host:port`` (0: a free port) on this event loop; returns
    (server, bound port). ``tls``: router.config.SecurityConfig paths (HTTPS, and client
    certificates with ``tls_client_ca``), as gRPC serves them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {e.strerror}") from None
    kw: dict[str, Any] = {}
    if tls is not None and tls.tls_cert:
        kw = dict(ssl_certfile=tls.tls_cert, ssl_keyfile=tls.tls_key)
        if tls.tls_client_ca:
            kw.update(ssl_ca_certs=tls.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    cfg = router.cfg
    sec = tls if tls is not None else cfg.security
    app = Guard(build_app(router), router.door.gate, is_loopback(host), sec, cfg.limits.concurrent_rpcs)
    # Requests in progress are limited by the Guard (uvicorn's limit_concurrency would count
    # idle connections too); connections by the protocol (router.http_conn).
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", http=guarded(cfg.front_door),
                            timeout_keep_alive=cfg.front_door.keepalive_s,
                            h11_max_incomplete_event_size=cfg.front_door.header_bytes, timeout_graceful_shutdown=1,
                            **kw)
    server = HttpServer(config)
    server.task = asyncio.create_task(server.serve(sockets=[sock]), name="http")
    while not server.started:
        if server.task.done():
            server.task.result()  # its error
            raise OSError(f"the HTTP server on {host}:{port} did not start")
        await asyncio.sleep(0.01)
    return server, sock.getsockname()[1]


class HttpServer(uvicorn.Server):
    """uvicorn's server without its signal handlers (the router's process has its own)."""

    task: asyncio.Task

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def stop(self) -> None:
        self.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)
