"""The gRPC port's bounds (router.grpc_guard) on a real server: the options it is built with,
and health Watch streams capped so that never-ending ones cannot take Generate's slots."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.config import load_config
from router.grpc_guard import server_options
from tests.router.front_door_fakes import Served

SERVING = health_pb2.HealthCheckResponse.SERVING


def test_server_options_follow_the_config():
    cfg = load_config(None, {"front_door.grpc_max_age_s": 120, "front_door.grpc_streams_per_connection": 8,
                             "limits.message_bytes": 1000})
    opts = dict(server_options(cfg.front_door, cfg.limits))
    assert opts["grpc.max_connection_age_ms"] == 120_000 and opts["grpc.max_concurrent_streams"] == 8
    assert opts["grpc.max_receive_message_length"] == opts["grpc.max_send_message_length"] == 1000
    assert opts["grpc.max_connection_idle_ms"] == 300_000 and opts["grpc.max_connection_age_grace_ms"] == 600_000
    assert opts["grpc.keepalive_time_ms"] == 60_000 and opts["grpc.keepalive_timeout_ms"] == 20_000
    assert opts["grpc.max_allowed_incoming_connections"] == 2048
    assert opts["grpc.server_handshake_timeout_ms"] == 10_000


@pytest.fixture(scope="module")
def srv():
    s = Served(front_door__health_watches=2, limits__concurrent_rpcs=4, front_door__grpc_calls_per_client=3)
    yield s
    s.stop()


def test_watch_streams_are_capped_and_generate_keeps_its_slots(srv):
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    health = health_pb2_grpc.HealthStub(ch)
    watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
    assert [next(w).status for w in watches] == [SERVING, SERVING]
    extra = health.Watch(health_pb2.HealthCheckRequest())
    with pytest.raises(grpc.RpcError) as e:
        next(extra)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "front_door.health_watches" in e.value.details()
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == SERVING  # Check is not capped
    gen = pb_grpc.GenerationStub(ch)
    for _ in range(6):  # more than concurrent_rpcs - watches in a row: each slot comes back
        out = list(gen.Generate(pb.GenerateRequest(prompt="hi"), timeout=30))
        assert "".join(r.text for r in out) == "ab"
    watches[0].cancel()  # a closed Watch gives its place back
    deadline = time.monotonic() + 30  # hang guard only
    while True:
        w = health.Watch(health_pb2.HealthCheckRequest())
        try:
            assert next(w).status == SERVING
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.01)
    w.cancel()
    watches[1].cancel()
    ch.close()


def test_an_unknown_health_service_is_still_not_found(srv):
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    with pytest.raises(grpc.RpcError) as e:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()


def test_each_client_address_has_a_cap_on_calls_in_progress(srv):
    """front_door.grpc_calls_per_client: one address cannot take every RPC slot; a finished call
    gives its place back (health is not counted: it has its own cap)."""
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    gen = pb_grpc.GenerationStub(ch)
    srv.holding(True)
    held = [gen.Generate(pb.GenerateRequest(prompt="hi"), timeout=30) for _ in range(3)]
    assert [next(h).text for h in held] == ["a"] * 3
    with pytest.raises(grpc.RpcError) as e:
        list(gen.Generate(pb.GenerateRequest(prompt="hi"), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "grpc_calls_per_client" in e.value.details()
    assert dict(e.value.trailing_metadata())["retry-after"] == "1"
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == SERVING
    srv.holding(False)
    assert ["".join(r.text for r in [next(h)] + list(h)) for h in held] == ["b"] * 3
    assert "".join(r.text for r in gen.Generate(pb.GenerateRequest(prompt="hi"), timeout=30)) == "ab"
    ch.close()


def test_bytes_that_are_not_the_message_are_invalid_argument_not_unknown(srv):
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    call = ch.unary_stream("/pdserve.v1.Generation/Generate")
    for raw in (b"\x12\x03\xed\xa0\x80",  # prompt: a lone surrogate's bytes, not UTF-8
                b"\x12\xff"):  # a length past the end
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    ch.close()
