"""The gRPC port's bounds: server options, and an interceptor for health and stopping.

``server_kwargs`` is everything ``grpc.aio.server`` is built with (router.server.start_server):

- ``limits.concurrent_rpcs`` calls in progress (``maximum_concurrent_rpcs``; beyond:
  RESOURCE_EXHAUSTED) and ``limits.message_bytes`` per message, either way.
- ``front_door.grpc_connections`` open connections (``grpc.max_allowed_incoming_connections``)
  and ``front_door.grpc_streams_per_connection`` calls on one (HTTP/2 max concurrent streams:
  a client beyond it waits for a stream, it is not refused).
- ``grpc_handshake_timeout_s``: a new connection's TLS handshake and HTTP/2 preface must be in
  within this (``grpc.server_handshake_timeout_ms``; grpc's default is 120 s), so connections
  that send nothing do not hold places under ``grpc_connections`` for long.
- keepalive: a connection quiet for ``grpc_keepalive_s`` is pinged and closed when the ping goes
  unanswered for ``grpc_keepalive_timeout_s`` (a peer that vanished does not hold a slot).
  The other way, a client may ping while it has calls open (router.client does every
  ``KEEPALIVE_S``, to notice a stopped router), at most one every ``MIN_PING_INTERVAL_S`` while
  the server sends nothing: a third ping sooner (``grpc.http2.max_ping_strikes``) or any ping on a
  connection without calls (``grpc.keepalive_permit_without_calls`` off) is answered with GOAWAY
  ``too_many_pings``, so pings cannot be a flood (one a second per connection at most, and
  connections are capped).
- ``grpc_max_idle_s``: a connection with no call this long is closed; ``grpc_max_age_s``: a
  connection this old is asked to reconnect (GOAWAY; clients do so transparently), and the
  calls still on it are ended ``grpc_max_age_grace_s`` later. No stream lives forever: not even
  one its client stops reading (HTTP/2 flow control blocks its writes, and grpc can end the
  call only by sending its status behind them, so no write timeout like HTTP's frees it sooner:
  its token's ``max_concurrent`` bounds how many one token can leave so).

The interceptor (``Guard``), ahead of the tokens' (router.auth):

- Per client address (``context.peer()``'s address without its port), *calls*, not
  connections: grpc python has no hook at a connection's accept (an interceptor sees calls
  only), so connections are capped in all (``grpc_connections``), and the ones that carry no
  call are closed by ``grpc_handshake_timeout_s`` and ``grpc_max_idle_s``; what a connection
  can cost beyond its socket is its calls, and those are counted where they come from:

  - at most ``front_door.grpc_calls_per_client`` calls in progress, with or without a token
    (counted before the tokens are checked, so calls the tokens will refuse count too; health
    excepted, below); beyond: RESOURCE_EXHAUSTED with ``retry-after``, so one address cannot
    take every ``limits.concurrent_rpcs`` slot (tokens have their own ``max_concurrent``:
    router.policy);
  - at most ``front_door.health_watches_per_client`` of the ``health_watches`` Watch streams
    (below), so one address cannot take every place a load balancer's Watch needs.

  Behind a proxy every call has the proxy's address, and these caps are the proxy's.
- A request whose bytes are not the method's message (a string that is not UTF-8, a bad
  varint) is INVALID_ARGUMENT, not the UNKNOWN grpc answers when deserializing raises.

- ``grpc.health.v1`` stays open (load balancers probe it), but at most
  ``front_door.health_watches`` ``Watch`` streams at once, ``health_watches_per_client`` from
  one address (beyond: RESOURCE_EXHAUSTED), so never-ending Watch streams cannot take the slots
  ``Generate`` needs. ``Check`` is not counted (it answers at once, and a load balancer that
  also carries clients' calls must still be answered; ``limits.concurrent_rpcs`` bounds it).
- Stopping (router.drain): ``Check`` and every ``Watch`` say NOT_SERVING, a new ``Generate`` is
  UNAVAILABLE with ``retry-after`` (seconds) in its trailing metadata; running ones go on and are
  counted until they end. ``Abort`` and ``GetClusterStatus`` still work.
"""

from __future__ import annotations

import asyncio
import inspect
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from router.conn_rate import client_key
from router.drain import RETRY_AFTER_S, Gate

HEALTH = "/grpc.health.v1.Health/"
GENERATE = "/pdserve.v1.Generation/Generate"
NOT_SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
# Half router.client's KEEPALIVE_S (2 s): its pings come late, never early, but timers and a
# loaded machine bunch two of them; gRPC's default (5 min) would end a queued call's connection
# after the third of them, as a flood
MIN_PING_INTERVAL_S, PING_STRIKES = 1.0, 2


def server_options(front_door, limits) -> list[tuple[str, int]]:
    """``grpc.aio.server`` options for router.config FrontDoorConfig and InputLimits."""
    def ms(s: float) -> int:
        return int(s * 1000)

    fd = front_door
    return [("grpc.max_receive_message_length", limits.message_bytes),
            ("grpc.max_send_message_length", limits.message_bytes),
            ("grpc.max_allowed_incoming_connections", fd.grpc_connections),
            ("grpc.max_concurrent_streams", fd.grpc_streams_per_connection),
            ("grpc.server_handshake_timeout_ms", ms(fd.grpc_handshake_timeout_s)),
            ("grpc.keepalive_time_ms", ms(fd.grpc_keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(fd.grpc_keepalive_timeout_s)),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(MIN_PING_INTERVAL_S)),
            ("grpc.http2.max_ping_strikes", PING_STRIKES), ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_connection_idle_ms", ms(fd.grpc_max_idle_s)),
            ("grpc.max_connection_age_ms", ms(fd.grpc_max_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(fd.grpc_max_age_grace_s))]


def server_kwargs(cfg, door) -> dict:
    """Keyword arguments for ``grpc.aio.server`` (cfg: router.config.ClusterConfig, door:
    router.auth.FrontDoor)."""
    fd = cfg.front_door
    interceptors = [Guard(door.gate, fd.health_watches, fd.grpc_calls_per_client, fd.health_watches_per_client)]
    if door.auth.enabled:
        interceptors.append(door.auth.interceptor())
    return dict(maximum_concurrent_rpcs=cfg.limits.concurrent_rpcs, interceptors=interceptors,
                options=server_options(cfg.front_door, cfg.limits))


class Malformed:
    """A request whose bytes did not parse (the deserializer's answer instead of raising)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def client_address(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` as the client it counts as (conn_rate.client_key:
    the address without its port, an IPv6 one's /64)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return client_key(unquote(rest).rpartition(":")[0].strip("[]"))  # (grpc escapes [, ], %)
    return peer  # (unix sockets and the like: the whole name)


class Guard(grpc.aio.ServerInterceptor):
    """Bounds health ``Watch`` and each client address's calls, answers malformed bytes with
    INVALID_ARGUMENT, turns health NOT_SERVING and refuses ``Generate`` while draining."""

    def __init__(self, gate: Gate, most_watches: int, calls_per_client: int = 1 << 30,
                 watches_per_client: int = 1 << 30) -> None:
        self.gate, self.most_watches, self.calls_per_client = gate, most_watches, calls_per_client
        self.watches_per_client = watches_per_client
        self.watches = 0
        self.calls: dict[str, int] = {}  # client address -> calls in progress
        self.watchers: dict[str, int] = {}  # client address -> Watch streams open

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        if details.method == HEALTH + "Check" and handler.unary_unary is not None:
            return _like(handler, unary_unary=self._check(handler.unary_unary))
        if details.method == HEALTH + "Watch" and handler.unary_stream is not None:
            return _like(handler, unary_stream=self._watch(handler.unary_stream))
        if details.method.startswith(HEALTH) or handler.request_streaming:
            return handler  # (health; reflection's stream, behind the tokens)
        if handler.unary_stream is not None:
            inner = self._generate(handler.unary_stream) if details.method == GENERATE else handler.unary_stream
            return _like(handler, _safe(handler.request_deserializer), unary_stream=self._counted_stream(inner))
        if handler.unary_unary is not None:
            return _like(handler, _safe(handler.request_deserializer), unary_unary=self._counted(handler.unary_unary))
        return handler

    async def _enter(self, request, context) -> str:
        """Count the call against its client address (aborting it when malformed or over the cap)."""
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse as this method's "
                                f"message: {str(request.error)[:200]}")
        if not self.gate.holds():  # (an HA router that does not lead its cluster: router.leader)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this router does not lead its cluster; retry on another",
                                trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))
        who = client_address(context.peer())
        if self.calls.get(who, 0) >= self.calls_per_client:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.calls_per_client} calls from this address are in progress "
                                "(front_door.grpc_calls_per_client); retry shortly",
                                trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))
        self.calls[who] = self.calls.get(who, 0) + 1
        return who

    def _leave(self, who: str) -> None:
        _less(self.calls, who)

    def _counted(self, behavior):
        async def call(request, context):
            who = await self._enter(request, context)
            try:
                return await behavior(request, context)
            finally:
                self._leave(who)
        return call

    def _counted_stream(self, behavior):
        async def call(request, context):
            who = await self._enter(request, context)
            try:
                async for response in _relay(behavior(request, context)):
                    yield response
            finally:
                self._leave(who)
        return call

    def _check(self, behavior):
        async def check(request, context):
            response = await behavior(request, context)
            return NOT_SERVING if self.gate.draining and response is not None else response
        return check

    def _watch(self, behavior):
        async def watch(request, context) -> None:
            if self.watches >= self.most_watches:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{self.most_watches} health Watch streams are open (front_door.health_watches); "
                                    "use Check, or retry later")
            who = client_address(context.peer())
            if self.watchers.get(who, 0) >= self.watches_per_client:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{self.watches_per_client} health Watch streams from this address are open "
                                    "(front_door.health_watches_per_client); use Check, or retry later")
            self.watches += 1
            self.watchers[who] = self.watchers.get(who, 0) + 1
            try:
                if not self.gate.draining:
                    inner = asyncio.ensure_future(behavior(request, context))
                    drained = asyncio.ensure_future(self.gate.until_draining())
                    try:
                        await asyncio.wait({inner, drained}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for t in (inner, drained):
                            t.cancel()
                        await asyncio.gather(inner, drained, return_exceptions=True)
                    if inner.done() and not inner.cancelled() and inner.exception() is not None:
                        raise inner.exception()
                await context.write(NOT_SERVING)
                await asyncio.Event().wait()  # the stream stays (as Watch does) until the server stops
            finally:
                self.watches -= 1
                _less(self.watchers, who)
        return watch

    def _generate(self, behavior):
        async def generate(request, context):
            with self.gate.call() as admitted:
                if not admitted:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this server is stopping; retry on another "
                                        "replica", trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))
                async for response in _relay(behavior(request, context)):
                    yield response
        return generate


def _less(counts: dict[str, int], who: str) -> None:
    """One fewer for ``who`` (an address at none is forgotten: the table holds active ones only)."""
    left = counts[who] - 1
    if left:
        counts[who] = left
    else:
        del counts[who]


def _safe(deserializer):
    """``deserializer`` answering Malformed where it would raise (grpc would answer UNKNOWN)."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            return Malformed(e)
    return parse


def _like(handler: grpc.RpcMethodHandler, deserializer=None, **behavior) -> grpc.RpcMethodHandler:
    """``handler`` with one behaviour replaced (same kind and serializer; its deserializer
    unless another is given)."""
    make = grpc.unary_unary_rpc_method_handler if "unary_unary" in behavior else grpc.unary_stream_rpc_method_handler
    return make(next(iter(behavior.values())), request_deserializer=deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


async def _relay(out):
    """A stream handler's responses: ``out`` is an async generator, or a coroutine of a handler
    that writes (context.write), e.g. the tokens' refusal, and yields nothing."""
    if inspect.isasyncgen(out):
        async for response in out:
            yield response
    else:
        await out
