"""router/client.py with a list of servers (``--server a,b``): the first that accepts serves,
a lost one's calls go to the next, a call refused with UNAVAILABLE is retried; real gRPC
servers on loopback (their Generation service answers GetModelInfo with its own name)."""

from __future__ import annotations

import json
import socket
from concurrent import futures

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.client import KEEPALIVE_OPTIONS, MAX_ATTEMPTS, connect, target


class _Named(pb_grpc.GenerationServicer):
    """Answers GetModelInfo with its name; the first ``unavailable`` calls get UNAVAILABLE."""

    def __init__(self, name: str, unavailable: int = 0) -> None:
        self.name, self.unavailable, self.calls = name, unavailable, 0

    def GetModelInfo(self, request, context):
        self.calls += 1
        if self.calls <= self.unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not leading")
        return pb.ModelInfo(model=self.name)


def _server(servicer: _Named) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_the_first_server_that_accepts_serves_in_the_order_given():
    a, b = _Named("a"), _Named("b")
    (sa, pa), (sb, pb_) = _server(a), _server(b)
    try:
        assert connect(f"127.0.0.1:{pa},127.0.0.1:{pb_}").GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model == "a"
        dead = _closed_port()
        assert connect(f"127.0.0.1:{dead},127.0.0.1:{pb_}").GetModelInfo(pb.GetModelInfoRequest(),
                                                                          timeout=10).model == "b"
    finally:
        sa.stop(0)
        sb.stop(0)


def test_a_lost_server_s_next_calls_go_to_the_next_one():
    a, b = _Named("a"), _Named("b")
    (sa, pa), (sb, pb_) = _server(a), _server(b)
    try:
        stub = connect(f"127.0.0.1:{pa},127.0.0.1:{pb_}")
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model == "a"
        sa.stop(0).wait()
        # the first try may still meet the old connection (UNAVAILABLE): retried, on b
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model == "b"
    finally:
        sa.stop(0)
        sb.stop(0)


def test_unavailable_is_retried_up_to_the_limit():
    flaky = _Named("a", unavailable=MAX_ATTEMPTS - 1)
    s, port = _server(flaky)
    try:
        stub = connect(f"127.0.0.1:{port},127.0.0.1:{_closed_port()}")
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=20).model == "a"
        assert flaky.calls == MAX_ATTEMPTS
        never = _Named("a", unavailable=10 * MAX_ATTEMPTS)
        s2, port2 = _server(never)
        try:
            with pytest.raises(grpc.RpcError) as e:
                connect(f"127.0.0.1:{port2},127.0.0.1:{_closed_port()}").GetModelInfo(pb.GetModelInfoRequest(),
                                                                                      timeout=20)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and never.calls == MAX_ATTEMPTS
        finally:
            s2.stop(0)
    finally:
        s.stop(0)


def test_a_list_becomes_one_target_of_one_family_and_bad_lists_are_refused():
    uri, options = target("127.0.0.1:5001, localhost:5002")
    assert uri == "ipv4:127.0.0.1:5001,127.0.0.1:5002" and dict(options)["grpc.default_authority"] == "127.0.0.1"
    assert target("[::1]:5001,[::1]:5002")[0] == "ipv6:[::1]:5001,[::1]:5002"
    # gRPC retries no stream: router.client ``stream`` resends them (its retries on top hung some)
    retried = {n["method"] for c in json.loads(dict(options)["grpc.service_config"])["methodConfig"] for n in c["name"]}
    assert retried == {"GetModelInfo", "GetClusterStatus", "Abort"}
    assert target("127.0.0.1:5001") == ("127.0.0.1:5001", KEEPALIVE_OPTIONS)  # one server: as it was, with keepalive
    for bad in ("127.0.0.1,127.0.0.2:5002", "127.0.0.1:5001,[::1]:5002", "no-such-host.invalid:1,127.0.0.1:2"):
        with pytest.raises(ValueError):
            target(bad)
