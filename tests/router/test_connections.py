"""Connections to the HTTP port (router.http_conn, router.http_guard) over real sockets: idle
connections never make a request a 503, a request's headers must arrive within the header
timeout however slowly they trickle, its body within the body timeout, and each client
address holds at most so many connections, the oldest idle one making room, and opens at most
so many a second (a reconnect flood is reset at its opening)."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from tests.router.front_door_fakes import (COMPLETION, HANG_GUARD_S, Served, closed_by_server, readable,
                                          rest, stream, until)

@pytest.fixture(scope="module")
def srv():
    s = Served(limits__concurrent_rpcs=2, front_door__header_timeout_s=0.3, front_door__body_timeout_s=0.3)
    yield s
    s.stop()


def test_idle_connections_do_not_count_against_the_request_limit(srv):
    idle = [srv.raw() for _ in range(6)]  # open, nothing sent yet
    kept = []
    for _ in range(3):  # kept alive after a request
        c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=HANG_GUARD_S)
        c.request("GET", "/v1/models", headers={"host": f"127.0.0.1:{srv.http_port}"})
        assert c.getresponse().read() and c.sock is not None
        kept.append(c)
    assert srv.post("/v1/completions", COMPLETION)[0] == 200
    srv.holding(True)
    streams = [stream(srv) for _ in range(2)]  # the two requests the limit allows, in progress
    until(lambda: srv.router.door.gate.active == 2)
    status, headers, body = srv.post("/v1/completions", COMPLETION)
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "service_unavailable" and "limits.concurrent_rpcs" in body.decode()
    assert srv.get("/health")[0] == 200  # probes are not requests
    srv.holding(False)
    for s in streams:
        assert b"data: [DONE]" in rest(s)
    until(lambda: srv.router.door.gate.active == 0)
    assert srv.post("/v1/completions", COMPLETION)[0] == 200
    for s in idle:
        s.close()
    for c in kept:
        c.close()


def test_headers_must_arrive_within_the_header_timeout(srv):
    silent = srv.raw()
    partial = srv.raw()
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert closed_by_server(silent) and closed_by_server(partial)
    # slowloris: a byte at a time, each in time, the whole never: the timer is not reset by bytes
    slow = srv.raw()
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nX-Slow: %s\r\n\r\n" % (srv.http_port, b"a" * 2000)
    for i in range(len(head)):
        if readable(slow):
            break
        try:
            slow.sendall(head[i:i + 1])
        except OSError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the whole head went through byte by byte")
    assert closed_by_server(slow)


def test_a_kept_alive_connection_gets_the_same_timeout_for_its_next_request(srv):
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=HANG_GUARD_S)
    c.request("GET", "/health", headers={"host": f"127.0.0.1:{srv.http_port}"})
    assert c.getresponse().read()
    c.sock.sendall(b"GET /health HTTP/1.1\r\n")  # and the rest never
    assert closed_by_server(c.sock)


def test_a_body_that_does_not_arrive_is_a_408(srv):
    s = srv.raw()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\"" % srv.http_port)
    answer = rest(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"front_door.body_timeout_s" in answer


def test_each_client_address_has_a_connection_cap_that_idle_ones_make_room_in():
    srv = Served(front_door__connections_per_client=3)
    try:
        a, b, c = srv.raw(), srv.raw(), srv.raw()
        for s in (a, b, c):  # each registered, oldest first
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % srv.http_port)
            got = b""
            while not got.endswith(b'{"status":"ok"}'):  # the whole answer: nothing left to read
                got += s.recv(65536)
        assert srv.post("/v1/completions", COMPLETION)[0] == 200  # a fourth: the oldest idle one goes
        assert closed_by_server(a) and not readable(b) and not readable(c)
        b.close()
        c.close()
        srv.holding(True)
        streams = [stream(srv) for _ in range(3)]  # three busy connections: none can go
        late = srv.raw()
        assert rest(late).startswith(b"HTTP/1.1 503")
        srv.holding(False)
        for s in streams:
            assert b"data: [DONE]" in rest(s)
    finally:
        srv.stop()


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_slot_freed():
    """The write timeout: a stream whose client reads nothing more blocks the server's writes;
    after front_door.write_timeout_s the connection is aborted (the rest of the stream never
    sent) and its slot under limits.concurrent_rpcs given back. A client that reads gets the
    same large stream whole."""
    import socket
    srv = Served(front_door__write_timeout_s=0.5, limits__concurrent_rpcs=1)
    try:
        srv.router.extra = (1000, "x" * 8192)  # ~8 MB of events: more than every buffer between (4 MB)
        body = json.dumps({**COMPLETION, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (srv.http_port, len(body), body))
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(HANG_GUARD_S)
        s.connect(("127.0.0.1", srv.http_port))
        s.sendall(request)
        assert s.recv(12).startswith(b"HTTP/1.1 200")  # then nothing more is read
        until(lambda: srv.router.door.gate.active == 1)
        until(lambda: srv.router.door.gate.active == 0)  # cut off: the only slot is free again
        try:
            got = rest(s)
        except ConnectionResetError:
            got = b""
        assert b"data: [DONE]" not in got
        s.close()
        reader = srv.raw()  # the same stream, read as it comes: whole
        reader.sendall(request)
        assert b"data: [DONE]" in rest(reader)
    finally:
        srv.stop()


def test_new_connections_per_address_follow_a_bucket_of_rate_and_burst():
    from router.conn_rate import NewConnections
    now = [0.0]
    rate = NewConnections(rate=2.0, burst=3, clock=lambda: now[0])
    assert [rate.admit("10.0.0.1") for _ in range(4)] == [True, True, True, False]  # the burst, then none
    assert rate.admit("10.0.0.2")  # another address has its own
    now[0] += 0.5  # one connection's worth of refill (2 a second)
    assert [rate.admit("10.0.0.1") for _ in range(2)] == [True, False]
    now[0] += 100.0  # refilled to the burst, never beyond it
    assert [rate.admit("10.0.0.1") for _ in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError):
        NewConnections(rate=0.0, burst=3)


def test_the_rate_table_forgets_addresses_whose_bucket_refilled():
    from router.conn_rate import PRUNE_AT, NewConnections
    now = [0.0]
    rate = NewConnections(rate=1.0, burst=2, clock=lambda: now[0])
    for i in range(PRUNE_AT):
        assert rate.admit(f"10.1.{i // 256}.{i % 256}")
    assert len(rate.buckets) == PRUNE_AT
    now[0] += 2.0  # every bucket full again: idle addresses
    assert rate.admit("10.9.9.9")
    assert list(rate.buckets) == ["10.9.9.9"]


def test_an_ipv6_host_is_one_client_across_its_64_and_a_mapped_ipv4_is_its_ipv4():
    """Per-client limits key an IPv6 address by its /64: a host spraying fresh addresses from
    its /64 shares one bucket (and one connection cap) instead of a new allowance each."""
    from router.conn_rate import NewConnections, client_key
    from router.grpc_guard import client_address
    assert client_key("2001:db8:1:2::7") == client_key("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::7") != client_key("2001:db8:1:2::7")
    assert client_key("::ffff:10.0.0.1") == client_key("10.0.0.1") == "10.0.0.1"
    assert client_key("fe80::1%eth0") == "fe80::/64"
    assert client_key("/run/pdserve.sock") == "/run/pdserve.sock"  # not an address: as it is
    assert client_address("ipv6:[2001:db8:1:2::9]:443") == "2001:db8:1:2::/64"
    assert client_address("ipv6:%5Bfe80::1%25eth0%5D:443") == "fe80::/64"
    assert client_address("ipv4:10.0.0.1:5000") == "10.0.0.1"
    rate = NewConnections(rate=1.0, burst=2, clock=lambda: 0.0)
    sprayed = [rate.admit(client_key(f"2001:db8:1:2::{i:x}")) for i in range(1, 6)]
    assert sprayed == [True, True, False, False, False] and len(rate.buckets) == 1


def test_an_address_over_its_rate_of_new_connections_is_reset_and_others_are_not():
    """front_door.new_connections_per_client_s: a client opening connections in a tight loop is
    reset at its opening (no answer written) once past its burst; another address is served."""
    srv = Served(front_door__new_connections_per_client_s=0.001, front_door__new_connections_burst=2)
    try:
        for _ in range(2):  # the burst (a refill of 0.001 a second adds no connection meanwhile)
            assert srv.post("/v1/completions", COMPLETION)[0] == 200
        assert closed_by_server(srv.raw())  # the third: reset before any answer
        other = socket.socket()
        other.bind(("127.0.0.2", 0))  # (all of 127/8 is loopback on Linux: another client address)
        other.settimeout(HANG_GUARD_S)
        other.connect(("127.0.0.1", srv.http_port))
        other.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % srv.http_port)
        assert rest(other).startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        srv.stop()
