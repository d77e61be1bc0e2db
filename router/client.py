"""A small gRPC client for pdserve's front door (the CLI, benchmarks and tests use it).

    stub = connect("127.0.0.1:50051")
    result = collect(stub.Generate(make_request("Hello", max_tokens=16)))

A server may be a list, ``"10.0.0.1:50051,10.0.0.2:50051"`` (``--server a,b``): one channel
over the addresses in the order given (gRPC's pick_first: the first that accepts a connection
serves every call; when its connection fails the next is tried), and a unary call that fails
with UNAVAILABLE is retried (``MAX_ATTEMPTS`` in all, backing off), so a client follows its
servers through one's loss without code of its own; streams do so through ``stream``.

A stream already answering is not retried by gRPC; ``stream`` carries it through the loss of
its router (ha.enabled; the CLI uses it): when it breaks with UNAVAILABLE after tokens came, it
asks the servers, until one answers (``RESUME_WAIT_S``), to ``Resume`` the request after the
tokens received (the new leader keeps what the workers decode: router.resume); if none has it
(NOT_FOUND, or fewer tokens than received: OUT_OF_RANGE), it sends the Generate again under the
same id and drops what was already delivered, checking that the tokens are the same (greedy or seeded output is), else
``ResumeMismatch``. The caller sees one stream either way. A stream that broke before its first
token (no router serves for now: a standby taking over) is sent again under its id, again until
one answers (``RESUME_WAIT_S``): a router that kept it attaches it from token 0 (router.resume),
any other runs it. A router that stops answering
without closing its connections (SIGSTOP, a frozen host) is found out by keepalive pings
(``KEEPALIVE_S``), and a list's connection attempt to it gives up after ``CONNECT_TIMEOUT_MS``,
so the stream resumes on the standby rather than when, if ever, the stopped one wakes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path

import grpc

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_UNSPECIFIED: None}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                   "presence_penalty", "frequency_penalty", "logprobs")


TOKEN_ENV = "PDSERVE_TOKEN"
RECONNECT_MAX_MS = 2000  # the longest a list's client waits before it tries an address that refused again
CONNECT_TIMEOUT_MS = 2000  # a list's connection attempt that has not shaken hands by then has failed
MAX_ATTEMPTS = 4  # a call's tries on UNAVAILABLE, over a list of servers (backing off 0.2 s .. 2 s)
# How long ``stream`` keeps asking for a broken stream: a standby's takeover (ha.lease_s, then
# its adoption: seconds) with room to spare; ha.resume_s (30 s by default) bounds it on the server
RESUME_WAIT_S = 30.0
# Keepalive: a stream whose router stops answering (SIGSTOP, a frozen VM, a cable pulled: no FIN
# or RST arrives) would wait forever for its next token; a ping every KEEPALIVE_S while a call is
# open, unanswered for KEEPALIVE_TIMEOUT_S, ends the connection with UNAVAILABLE, so ``stream``
# resumes on the standby within ~5 s of the stall instead of when (if) the old leader wakes.
# 2 s: well under a standby's takeover (ha.lease_s, 3 s by default), so the client asks again
# while the standby takes over; 3 s: a loaded leader's poller still acks a ping within it (acks
# come from gRPC's C core, not the event loop). Only while calls are open (an idle channel sends
# none), and the server permits one every MIN_PING_INTERVAL_S (router.grpc_guard).
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 2.0, 3.0
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
                     ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
                     ("grpc.keepalive_permit_without_calls", 0),
                     # (gRPC's default stops pinging after 2 pings until the client sends data, and a
                     # stream's client sends nothing after its request: keep pinging while it is open)
                     ("grpc.http2.max_pings_without_data", 0),
                     # (grpc 1.85 times a keepalive ping out by this, default 1 min, not by keepalive_timeout)
                     ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000))]
# gRPC retries the unary calls only: Generate and Resume streams are resent by ``stream``/``astream``,
# which know what was delivered. gRPC's own retries of them, on top, left a threaded stream waiting
# for the first message of a call sent as its router was killed, until its deadline (17 of 63
# streams with 16 threads and six kills; 0 of 52 with the streams left out: docs/failures.md)
UNARY_METHODS = ("GetModelInfo", "GetClusterStatus", "Abort")
_FAILOVER = json.dumps({
    "loadBalancingConfig": [{"pick_first": {}}],
    "methodConfig": [{"name": [{"service": "pdserve.v1.Generation", "method": m} for m in UNARY_METHODS],
                      "retryPolicy": {"maxAttempts": MAX_ATTEMPTS, "initialBackoff": "0.2s", "maxBackoff": "2s",
                                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})


def target(server: str) -> tuple[str, list[tuple[str, str | int]]]:
    """gRPC's target and channel options for ``server`` (keepalive, either way): one ``host:port`` as it is; a comma
    list as one ``ipv4:``/``ipv6:`` target over every address in order (each name resolved
    now, its first address), with pick_first, retries on UNAVAILABLE and the first name as the
    authority (what a TLS certificate is checked against).

    Raises:
        ValueError: an address without a port, a name that does not resolve, IPv4 and IPv6 mixed
            (gRPC's address lists are of one family).
    """
    parts = [p.strip() for p in server.split(",") if p.strip()]
    if len(parts) <= 1:
        return server, list(KEEPALIVE_OPTIONS)
    addrs: list[tuple[str, int]] = []
    for p in parts:
        host, sep, port = p.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"server {p!r} in {server!r}: give host:port")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            try:
                ip = ipaddress.ip_address(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0])
            except OSError as e:
                raise ValueError(f"server {p!r} in {server!r}: {e}") from None
        addrs.append((str(ip), int(port)))
    families = {ipaddress.ip_address(a).version for a, _ in addrs}
    if len(families) > 1:
        raise ValueError(f"servers {server!r}: all IPv4 or all IPv6 (gRPC lists one family)")
    uri = ("ipv4:" + ",".join(f"{a}:{port}" for a, port in addrs) if families == {4}
           else "ipv6:" + ",".join(f"[{a}]:{port}" for a, port in addrs))
    first = parts[0].rpartition(":")[0].strip("[]")
    return uri, [("grpc.service_config", _FAILOVER), ("grpc.enable_retries", 1), ("grpc.default_authority", first),
                 # (a standby that refused a while ago may lead now (router.standby): try it again
                 # within seconds, not after gRPC's default backoff of up to 2 minutes)
                 ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
                 # (also the longest a connection attempt may take, 20 s by default: a stopped router's
                 # kernel accepts the connection and its handshake never comes, and pick_first waits for
                 # that attempt to fail before it connects to the leader that serves meanwhile)
                 ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS), *KEEPALIVE_OPTIONS]


def channel(server: str, *, tls_ca: str | None = None, token: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None) -> grpc.Channel:
    """A channel to ``host:port`` (or a list of them: see the module docstring): TLS when
    ``tls_ca`` is given (the CA that signed the server's certificate; ``tls_cert``/``tls_key``:
    this client's own, for mTLS), and every call carrying ``authorization: Bearer TOKEN``
    (``token``, else $PDSERVE_TOKEN, else none)."""
    token = token or os.environ.get(TOKEN_ENV) or None
    uri, options = target(server)
    if tls_ca:
        def read(path: str | None) -> bytes | None:
            return Path(path).expanduser().read_bytes() if path else None
        creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
        ch = grpc.secure_channel(uri, creds, options=options)
    else:
        ch = grpc.insecure_channel(uri, options=options)
    return grpc.intercept_channel(ch, _Bearer(token)) if token else ch


def connect(server: str, **security) -> pb_grpc.GenerationStub:
    """A Generation stub on ``channel(server, **security)``."""
    return pb_grpc.GenerationStub(channel(server, **security))


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token to every call's metadata (call credentials would refuse a plaintext
    channel, and a loopback server without TLS may still want tokens)."""

    def __init__(self, token: str) -> None:
        self.metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return _Details(details, [*(details.metadata or ()), self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata) -> None:
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready = d.credentials, getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


def make_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                 messages: Sequence[dict] | None = None, request_id: str = "",
                 stop: Sequence[str] = (), ignore_eos: bool = False, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one input and sampling keywords (unset: server defaults)."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling fields: {', '.join(sorted(unknown))}")
    sp = pb.SamplingParams(stop=list(stop), ignore_eos=ignore_eos,
                           **{k: v for k, v in sampling.items() if v is not None})
    req = pb.GenerateRequest(request_id=request_id, sampling=sp)
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    return req


def usage_dict(u: pb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "cached_prompt_tokens": u.cached_prompt_tokens, "ttft_s": u.ttft_s, "mean_tpot_s": u.mean_tpot_s,
            "prefill_worker": u.prefill_worker, "decode_worker": u.decode_worker,
            "prefill_placement": u.prefill_placement}


def collect(responses: Iterable[pb.GenerateResponse], on_text=None) -> dict:
    """Drain a Generate stream into ``{request_id, text, token_ids, finish_reason, usage}``;
    ``on_text(delta)`` sees each text delta as it arrives."""
    out = {"request_id": "", "text": "", "token_ids": [], "finish_reason": None, "usage": {}}
    for r in responses:
        out["request_id"] = r.request_id
        out["token_ids"] += list(r.token_ids)
        out["text"] += r.text
        if r.text and on_text is not None:
            on_text(r.text)
        if r.finish_reason:
            out["finish_reason"] = FINISH_NAMES[r.finish_reason]
            out["usage"] = usage_dict(r.usage)
    return out


class ResumeMismatch(RuntimeError):
    """A stream sent again after its router was lost answered other tokens than those already
    delivered (its sampling is not deterministic: a temperature without a seed)."""


def stream(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, *, timeout: float | None = None,
           wait_s: float = RESUME_WAIT_S, unanswered_s: float | None = None) -> Iterator[pb.GenerateResponse]:
    """``stub.Generate(request)``'s responses, carried through the loss of the router that streams
    them (module docstring). A request without an id gets one (what ``Resume`` names it by).
    ``unanswered_s`` (default ``wait_s``): how long a request no router has answered yet is sent
    again on UNAVAILABLE (a standby taking over); 0 for a client of one server, which has no
    standby to wait for (``pdserve generate`` against a server that is not there fails at once).

    Raises:
        grpc.RpcError: the call's own error, or UNAVAILABLE still after ``wait_s``.
        ResumeMismatch: sent again, the request answered other tokens.
    """
    request = _with_id(request)
    got = _Delivered()
    responses: Iterator[pb.GenerateResponse] = stub.Generate(request, timeout=timeout)
    unanswered = time.monotonic() + (wait_s if unanswered_s is None else unanswered_s)
    while True:
        try:
            for r in responses:
                yield got.add(r)
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if not got.ids:  # (none delivered: no router for now, e.g. a standby taking over)
                if time.monotonic() > unanswered:
                    raise
                time.sleep(0.2)
                responses = stub.Generate(request, timeout=timeout)
                continue
        deadline = time.monotonic() + wait_s
        while True:  # a router that resumes it, else one that runs it again
            call = stub.Resume(got.resume_request(request), timeout=timeout)
            try:
                responses = itertools.chain([next(call)], call)  # (its error, if any, shows here)
                break
            except StopIteration:
                return
            except grpc.RpcError as e:
                if e.code() in _SEND_AGAIN:
                    replay = got.replay()
                    responses = (x for r in stub.Generate(request, timeout=timeout) if (x := replay(r)) is not None)
                    break
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


async def astream(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, *, timeout: float | None = None,
                  wait_s: float = RESUME_WAIT_S,
                  unanswered_s: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """``stream`` for a ``grpc.aio`` channel's stub (bench/loadgen)."""
    request = _with_id(request)
    got, replay, first = _Delivered(), None, None
    call = stub.Generate(request, timeout=timeout)
    unanswered = time.monotonic() + (wait_s if unanswered_s is None else unanswered_s)
    while True:
        try:  # (read(), not async for: the first message of a Resume is read before the rest)
            while (r := first if first is not None else await call.read()) is not grpc.aio.EOF:
                first = None
                if replay is None or (r := replay(r)) is not None:
                    yield got.add(r)
            return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if not got.ids:  # (as in ``stream``)
                if time.monotonic() > unanswered:
                    raise
                await asyncio.sleep(0.2)
                call = stub.Generate(request, timeout=timeout)
                continue
        deadline, replay = time.monotonic() + wait_s, None
        while True:
            call = stub.Resume(got.resume_request(request), timeout=timeout)
            try:
                first = await call.read()  # (its error, if any, shows here)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() in _SEND_AGAIN:
                    call, replay = stub.Generate(request, timeout=timeout), got.replay()
                    break
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)


# Resume's answers that call for sending the request again: none kept here (NOT_FOUND), or one
# kept with fewer tokens than were delivered (OUT_OF_RANGE: a run sent again before, which the
# router was lost in; its replay from token 0 is checked against what was delivered)
_SEND_AGAIN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE)


def _with_id(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """``request``, or a copy of it with an id of its own if it has none."""
    if request.request_id:
        return request
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.request_id = uuid.uuid4().hex
    return out


class _Delivered:
    """What a stream delivered to its caller: token ids and characters of text."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.chars = 0

    def add(self, r: pb.GenerateResponse) -> pb.GenerateResponse:
        self.ids += r.token_ids
        self.chars += len(r.text)
        return r

    def resume_request(self, request: pb.GenerateRequest) -> pb.ResumeRequest:
        return pb.ResumeRequest(request_id=request.request_id, received_tokens=len(self.ids))

    def replay(self):
        """A filter over the request's responses sent again: each less what was delivered (None
        when nothing is left of it). Raises ResumeMismatch at tokens other than those delivered."""
        got, chars = list(self.ids), self.chars
        at = [0, 0]  # tokens and characters of the replay matched so far

        def trim(r: pb.GenerateResponse) -> pb.GenerateResponse | None:
            ids = list(r.token_ids)
            n = min(len(ids), len(got) - at[0])
            if ids[:n] != got[at[0]:at[0] + n] or (r.finish_reason and at[0] + n < len(got)):
                raise ResumeMismatch(f"request {r.request_id!r} sent again after its router was lost answered "
                                     f"other tokens than the {len(got)} delivered (not deterministic: set a seed "
                                     "or temperature 0)")
            t = min(len(r.text), chars - at[1])
            at[0], at[1] = at[0] + n, at[1] + t
            if n or t:
                out = pb.GenerateResponse()
                out.CopyFrom(r)
                del out.token_ids[:n], out.logprobs[:n], out.prompt_logprobs[:], out.prompt_token_ids[:]
                out.text = r.text[t:]
                r = out
            return r if r.token_ids or r.text or r.finish_reason else None
        return trim
