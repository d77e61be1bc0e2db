"""How the router refuses a request: ``Reject``, one gRPC status (and a retry hint) for the client,
raised wherever the refusal is decided (validation, admission, placement) and turned into the
API's own answer at the edge (router.server for gRPC, router.openai_http for HTTP)."""

from __future__ import annotations

import math

import grpc

from router.drain import RETRY_AFTER_S


class Reject(Exception):
    """End a Generate call with this gRPC status (and a retry hint, seconds: RESOURCE_EXHAUSTED
    has one by default; gRPC's ``retry-after`` trailing metadata, HTTP's ``Retry-After``)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s if retry_after_s is not None else \
            RETRY_AFTER_S if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None


def retry_after(seconds: float) -> str:
    """A retry hint as HTTP's Retry-After and gRPC's retry-after metadata say it: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
