"""A bug inside the router's request path fails that request with INTERNAL naming it, and is
logged with its request id; gRPC's default would be a bare UNKNOWN with nothing logged."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.auth import FrontDoor
from router.config import load_config
from router.server import Router


class Context:
    def __init__(self) -> None:
        self.aborted: tuple | None = None

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def test_an_unexpected_exception_is_internal_and_logged(caplog):
    router = object.__new__(Router)  # only what Generate touches: the door, generate and its hold
    router.door, router.cfg = FrontDoor(), load_config(None)
    router.stream_hold = lambda: None

    async def broken(request, owner, time_left, hold=None):
        raise KeyError("decode-7")
        yield  # (an async generator, as the real one)

    router.generate = broken
    ctx = Context()

    async def call():
        async for _ in router.Generate(pb.GenerateRequest(request_id="r-1", prompt="hi"), ctx):
            pass

    with caplog.at_level(logging.ERROR, logger="pdserve.router"), pytest.raises(grpc.aio.AbortError):
        asyncio.run(call())
    code, details = ctx.aborted
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in details and "decode-7" in details
    assert any("rid=r-1 event=internal_error" in r.getMessage() for r in caplog.records)
