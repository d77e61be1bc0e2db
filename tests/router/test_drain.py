"""Stopping (router.drain, router.app.stop_cluster) on real HTTP and gRPC servers: health turns
NOT_SERVING first, new requests are refused with a retry hint, running ones finish within the
grace period, and whatever outlives it is aborted. Requests are held by the fake router until
the test lets them go: no outcome here depends on timing but the short grace period's expiry."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.drain import Gate
from tests.router.front_door_fakes import COMPLETION, Served, rest, stream, until

NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING


def test_the_gate_counts_calls_and_refuses_new_ones_once_draining():
    async def run():
        gate = Gate()
        with gate.call() as first:
            assert first and gate.active == 1
            drained = asyncio.ensure_future(gate.drain(grace_s=3600))
            await asyncio.sleep(0)
            with gate.call() as late:
                assert not late and gate.active == 1  # refused, not counted
            assert not drained.done()
        assert await drained == 0  # returns as the last call ends, long before the grace period
        hurried = Gate()
        assert hurried.enter()
        task = asyncio.ensure_future(hurried.drain(grace_s=3600))
        await asyncio.sleep(0)
        hurried.hurry()  # a second signal
        assert await task == 1
        expired = Gate()
        assert expired.enter() and await expired.drain(grace_s=0) == 1
    asyncio.run(run())


@pytest.fixture
def srv():
    s = Served()
    yield s
    if not s.stopped:
        s.stop()


def _generate(ch):
    return pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="hi"), timeout=60)


def test_sigterm_turns_health_off_refuses_new_requests_and_lets_running_ones_finish(srv):
    gate = srv.router.door.gate
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    health = health_pb2_grpc.HealthStub(ch)
    srv.holding(True)
    running = _generate(ch)
    assert next(running).text == "a"
    streams = [stream(srv) for _ in range(2)]
    watch = health.Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == SERVING
    until(lambda: gate.active == 3)

    drained = srv.soon(lambda: gate.drain(grace_s=3600))
    assert next(watch).status == NOT_SERVING  # first: load balancers stop sending
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == NOT_SERVING
    status, headers, body = srv.get("/health")
    assert status == 503 and json.loads(body) == {"status": "unavailable"}
    with pytest.raises(grpc.RpcError) as e:
        list(_generate(ch))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in e.value.details()
    assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
    status, headers, body = srv.post("/v1/completions", COMPLETION)
    assert status == 503 and headers["retry-after"] == "1" and "stopping" in json.loads(body)["error"]["message"]
    assert not drained.done() and gate.active == 3  # the running ones go on

    srv.holding(False)
    assert [r.text for r in running] == ["b"]  # (its first token was read above)
    for s in streams:
        assert b"data: [DONE]" in rest(s)
    assert drained.result(timeout=30) == 0
    watch.cancel()
    ch.close()


def test_what_outlives_the_grace_period_is_aborted(srv):
    from router.app import stop_cluster
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    srv.holding(True)  # and never let go
    running = _generate(ch)
    assert next(running).text == "a"
    sse = stream(srv)
    until(lambda: srv.router.door.gate.active == 2)
    said: list[str] = []
    started = time.monotonic()
    srv.call(lambda: stop_cluster(srv.router, srv.grpc, grace_s=0.2, progress=said.append))
    srv.stopped = True
    assert time.monotonic() - started < 30  # hang guard: it did not wait for the held requests
    with pytest.raises(grpc.RpcError) as e:
        list(running)
    assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    assert b"data: [DONE]" not in rest(sse)
    assert "draining: 2 requests" in said[0] and "aborting 2 requests" in said[1]
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    ch.close()
