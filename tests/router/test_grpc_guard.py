"""The gRPC port's bounds (router.grpc_guard) on a real server: the options it is built with,
and health Watch streams capped, in all and per client address, so that never-ending ones
cannot take Generate's slots."""

from __future__ import annotations

import asyncio
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


class _Aborted(Exception):
    pass


class _Context:
    """What Guard's Watch reads of a grpc ServicerContext: its peer, abort and write."""

    def __init__(self, peer: str) -> None:
        self.peer_name, self.written, self.refusal = peer, [], None

    def peer(self) -> str:
        return self.peer_name

    async def abort(self, code, details, trailing_metadata=()):
        self.refusal = (code, details)
        raise _Aborted(details)

    async def write(self, message) -> None:
        self.written.append(message)


def test_one_address_takes_only_its_share_of_the_watch_streams():
    """front_door.health_watches_per_client: an address at its share is refused, another address
    still gets a Watch, and a closed one gives its address's place back."""
    from router.drain import Gate
    from router.grpc_guard import Guard

    async def serving(request, context) -> None:
        await context.write(health_pb2.HealthCheckResponse(status=SERVING))
        await asyncio.Event().wait()

    async def settle() -> None:  # (the watches' inner tasks take a few turns of the loop to start)
        for _ in range(10):
            await asyncio.sleep(0)

    async def run() -> None:
        guard = Guard(Gate(), most_watches=8, watches_per_client=2)
        watch = guard._watch(serving)
        a = [_Context(f"ipv4:10.0.0.1:{port}") for port in (5001, 5002, 5003)]
        b = _Context("ipv6:[2001:db8::7]:5001")
        held = [asyncio.create_task(watch(None, c)) for c in a[:2]]
        await settle()
        with pytest.raises(_Aborted):
            await watch(None, a[2])
        assert a[2].refusal[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "front_door.health_watches_per_client" in a[2].refusal[1]
        held.append(asyncio.create_task(watch(None, b)))  # another address: its own share
        await settle()
        assert [c.written[0].status for c in a[:2] + [b]] == [SERVING] * 3
        assert guard.watchers == {"10.0.0.1": 2, "2001:db8::/64": 1} and guard.watches == 3
        held[0].cancel()
        await asyncio.gather(held[0], return_exceptions=True)
        again = asyncio.create_task(watch(None, _Context("ipv4:10.0.0.1:5004")))
        await settle()
        assert not again.done() and guard.watchers["10.0.0.1"] == 2
        for t in held[1:] + [again]:
            t.cancel()
        await asyncio.gather(*held[1:], again, return_exceptions=True)
        assert guard.watchers == {} and guard.watches == 0  # nothing left behind
    asyncio.run(run())


def test_the_watch_share_per_address_is_enforced_on_a_real_server():
    s = Served(front_door__health_watches=4, front_door__health_watches_per_client=1)
    ch = grpc.insecure_channel(f"127.0.0.1:{s.port}")
    try:
        health = health_pb2_grpc.HealthStub(ch)
        first = health.Watch(health_pb2.HealthCheckRequest())
        assert next(first).status == SERVING
        with pytest.raises(grpc.RpcError) as e:
            next(health.Watch(health_pb2.HealthCheckRequest()))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "front_door.health_watches_per_client" in e.value.details()
        first.cancel()
    finally:
        ch.close()
        s.stop()


def test_bytes_that_are_not_the_message_are_invalid_argument_not_unknown(srv):
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    call = ch.unary_stream("/pdserve.v1.Generation/Generate")
    for raw in (b"\x12\x03\xed\xa0\x80",  # prompt: a lone surrogate's bytes, not UTF-8
                b"\x12\xff"):  # a length past the end
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    ch.close()
