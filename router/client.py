"""A small gRPC client for pdserve's front door (the CLI, benchmarks and tests use it).

    stub = connect("127.0.0.1:50051")
    result = collect(stub.Generate(make_request("Hello", max_tokens=16)))
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_UNSPECIFIED: None}
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                   "presence_penalty", "frequency_penalty", "logprobs")


TOKEN_ENV = "PDSERVE_TOKEN"


def channel(server: str, *, tls_ca: str | None = None, token: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None) -> grpc.Channel:
    """A channel to ``host:port``: TLS when ``tls_ca`` is given (the CA that signed the
    server's certificate; ``tls_cert``/``tls_key``: this client's own, for mTLS), and every call
    carrying ``authorization: Bearer TOKEN`` (``token``, else $PDSERVE_TOKEN, else none)."""
    token = token or os.environ.get(TOKEN_ENV) or None
    if tls_ca:
        def read(path: str | None) -> bytes | None:
            return Path(path).expanduser().read_bytes() if path else None
        creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
        ch = grpc.secure_channel(server, creds)
    else:
        ch = grpc.insecure_channel(server)
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
