"""router.leader and router.standby without Ray: the lease's rules on an injected clock, two
electors over one in-process lease (a leader lost, a leader that stalls past its lease), the
drain gate of a router that leads no more, and a standby's ports (gRPC refused, so a client of
a list goes on to the leader; HTTP 503)."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.client import connect
from router.config import ConfigError, load_config
from router.drain import Gate
from router.leader import SAFE, Elector, Lease, poll_s
from router.standby import StandbyPorts
from tests.router.test_client_failover import _Named, _server


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_lease_is_held_by_one_until_its_deadline_then_taken_by_the_next():
    clock = Clock()
    lease = Lease(clock=clock)
    a = lease.acquire("a", 3.0)
    assert (a.held, a.holder, a.term) == (True, "a", 1)
    clock.t += 2.0
    b = lease.acquire("b", 3.0)
    assert (b.held, b.holder, b.term, b.left_s) == (False, "a", 1, pytest.approx(1.0))
    assert lease.renew("a", 3.0) and not lease.renew("b", 3.0)  # a renews: held until +3 from now
    clock.t += 2.9
    assert not lease.acquire("b", 3.0).held and lease.holder_now() == "a"
    clock.t += 0.2  # a did not renew in time: lapsed
    assert lease.holder_now() is None
    assert not lease.renew("a", 3.0)  # lapsed is lost, even while nobody took it
    b = lease.acquire("b", 3.0)
    assert (b.held, b.holder, b.term) == (True, "b", 2)
    assert lease.acquire("b", 3.0).term == 2  # its own: renewed, the same term
    assert not lease.acquire("a", 3.0).held


def test_a_released_lease_is_free_at_once_and_release_says_whether_a_standby_waits():
    clock = Clock()
    lease = Lease(clock=clock)
    lease.acquire("a", 3.0)
    assert not lease.release("a", 3.0)  # nobody else asked
    lease.acquire("a", 3.0)
    lease.acquire("b", 3.0)  # b stands by
    clock.t += 1.0
    assert lease.release("a", 3.0)
    assert lease.acquire("b", 3.0).held
    clock.t += 10.0
    assert not lease.release("b", 3.0)  # a asked long ago: gone
    assert not lease.release("c", 3.0)  # not the holder: changes nothing


def test_a_restarted_lease_grants_nothing_for_its_quiet_time():
    clock = Clock()
    lease = Lease(quiet_s=3.0, clock=clock)
    g = lease.acquire("b", 3.0)
    assert (g.held, g.holder, g.left_s) == (False, None, 3.0)
    clock.t += 3.1
    assert lease.acquire("b", 3.0).held


def test_a_standby_polls_until_the_lease_would_lapse_within_bounds():
    assert poll_s(10.0, 3.0) == 1.0 and poll_s(0.5, 3.0) == 0.5 and poll_s(0.0, 3.0) == pytest.approx(0.1)


def test_ha_lease_s_is_checked():
    assert load_config(None, {"ha.lease_s": 2.0}).ha.lease_s == 2.0
    for bad in (0.1, 120):
        with pytest.raises(ConfigError, match="ha.lease_s"):
            load_config(None, {"ha.lease_s": bad})


def _in_process(lease: Lease):
    """A ``Lease`` called as the actor would be (one call at a time)."""
    import threading
    lock = threading.Lock()

    def call(method: str, who: str, lease_s: float):
        with lock:
            return getattr(lease, method)(who, lease_s)
    return call


LEASE_S = 0.3


class Stallable:
    """Real monotonic time that a test can jump forward (a process that was SIGSTOPped)."""

    def __init__(self) -> None:
        self.now, self.skip = time.monotonic, 0.0

    def __call__(self) -> float:
        return self.now() + self.skip


def test_a_standby_takes_over_within_the_lease_when_the_leader_is_lost():
    async def run():
        lease = _in_process(Lease())
        a, b = Elector(lease, "a", LEASE_S), Elector(lease, "b", LEASE_S)
        assert await a.acquire() == 1 and a.leading()
        keeping = asyncio.create_task(a.hold())
        taking = asyncio.create_task(b.acquire())
        await asyncio.sleep(3 * LEASE_S)  # a renews: b waits
        assert not taking.done() and a.leading() and not keeping.done()
        keeping.cancel()  # a dies
        lost = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(taking, 5) == 2
        assert asyncio.get_running_loop().time() - lost <= LEASE_S + LEASE_S / 3 + 0.5
        assert b.leading()
    asyncio.run(run())


def test_a_leader_that_stalled_past_its_lease_serves_nothing_at_once_and_learns_it_lost():
    async def run():
        lease = _in_process(Lease())
        clock = Stallable()
        a, b = Elector(lease, "a", LEASE_S, clock=clock), Elector(lease, "b", LEASE_S)
        await a.acquire()
        gate = Gate()
        gate.holds = a.leading
        assert gate.enter()
        gate.leave()
        keeping = asyncio.create_task(a.hold())
        await asyncio.sleep(LEASE_S)
        clock.skip = 10.0  # as it wakes from SIGSTOP: its lease passed
        assert gate.draining and not gate.enter()  # refused before any task of its runs
        why = await asyncio.wait_for(keeping, 5)
        assert "passed" in why
        assert await asyncio.wait_for(b.acquire(), 5) == 2
        assert not a.leading() and b.leading()
    asyncio.run(run())


def test_a_busy_loop_keeps_the_lease_and_a_renewal_refused_ends_the_leadership_at_once():
    async def run():
        inner = Lease()
        a = Elector(_in_process(inner), "a", LEASE_S)
        await a.acquire()
        assert a.until - asyncio.get_running_loop().time() <= LEASE_S * SAFE + 0.05
        keeping = asyncio.create_task(a.hold())
        await asyncio.sleep(0)
        time.sleep(LEASE_S)  # the loop blocked past the lease: the renewing thread kept it
        assert a.leading()
        inner.holder = "someone else"  # (as if it had lapsed and been taken)
        why = await asyncio.wait_for(keeping, 5)
        assert "refused" in why and not a.leading()
    asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_standby_refuses_on_both_ports_and_a_client_of_a_list_goes_on_to_the_leader():
    server, leader_port = _server(_Named("leader"))
    loop = asyncio.new_event_loop()
    ports = StandbyPorts("127.0.0.1", _free_port(), 0)
    try:
        loop.run_until_complete(ports.start())
        import threading
        threading.Thread(target=loop.run_forever, daemon=True).start()
        with pytest.raises(grpc.RpcError) as e:
            connect(f"127.0.0.1:{ports.port}").GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        stub = connect(f"127.0.0.1:{ports.port},127.0.0.1:{leader_port}")  # the standby first
        for _ in range(3):
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model == "leader"
        for path in ("/health", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as h:
                urllib.request.urlopen(f"http://127.0.0.1:{ports.http_port}{path}", timeout=5)
            assert h.value.code == 503 and h.value.headers["Retry-After"] == "1"
            assert b"standby" in h.value.read()
        asyncio.run_coroutine_threadsafe(ports.stop(), loop).result(5)
        with socket.socket() as s:  # freed: the leader's servers bind it next
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports.port))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        server.stop(0)
