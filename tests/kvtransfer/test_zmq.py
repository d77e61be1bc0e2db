"""zmq transport: a peer that takes nothing is dropped at the outbox bound (never silently short
of a message), one slow ROUTER peer holds up no other, and closed connections are reported."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvtransfer import zmq_transport
from kvtransfer.zmq_transport import ZmqTransport


@pytest.fixture
def make(monkeypatch) -> Iterator[Callable[[], ZmqTransport]]:
    """Transports with a tiny high-water mark and outbox bound; all closed after the test."""
    monkeypatch.setattr(zmq_transport, "HWM_MESSAGES", 1)
    monkeypatch.setattr(zmq_transport, "MAX_QUEUED_MESSAGES", 4)
    built: list[ZmqTransport] = []

    def factory(**kw) -> ZmqTransport:
        built.append(ZmqTransport(**kw))
        return built[-1]

    yield factory
    for t in built:
        t.close()


def wait_for(cond: Callable[[], object], timeout: float = 10.0) -> object:
    end = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < end, "condition never held"
        time.sleep(0.001)
    return got


BLOB = b"x" * (1 << 20)  # 64 of them are far more than loopback's socket buffers hold


def test_a_receiver_that_takes_nothing_is_dropped_at_the_bound(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    for _ in range(64):  # the server never reads
        client.send(peer, [BLOB])
    (dropped,) = wait_for(client.dropped)
    assert dropped[0] == peer and "bound" in dropped[1]
    assert not client._dealers and client.unroutable > 0  # what came after the drop: counted, not sent
    with pytest.raises(ValueError, match="unknown zmq peer"):  # the report is taken: connect() again
        client.send(peer, [b"late"])


def test_one_stuck_router_peer_holds_up_no_other_and_is_dropped_at_the_bound(make):
    server, stuck, live = make(), make(), make()
    address = server.bind()
    for c, name in ((stuck, b"stuck"), (live, b"live")):
        c.send(c.connect(address), [name])
    ids: dict[bytes, str] = {}
    while len(ids) < 2:
        if (msg := server.recv()) is not None:
            ids[bytes(msg[1][0])] = msg[0]
    for _ in range(3):  # this peer never reads: the replies wait in its own outbox
        server.send(ids[b"stuck"], [BLOB])
    server.send(ids[b"live"], [b"for you"])  # not behind them

    def live_got() -> bytes | None:
        server.recv()  # flushes outboxes
        msg = live.recv()
        return bytes(msg[1][0]) if msg is not None else None
    assert wait_for(live_got) == b"for you"
    for _ in range(64):
        server.send(ids[b"stuck"], [BLOB])
    (dropped,) = wait_for(server.dropped)
    assert dropped[0] == ids[b"stuck"] and "bound" in dropped[1]


def test_a_dealer_reports_the_other_side_closing_and_reaches_it_again(make):
    server, client = make(), make()
    address = server.bind()
    peer = client.connect(address)
    client.send(peer, [b"hi"])
    wait_for(server.recv)
    port = int(address.rsplit(":", 1)[1])
    server.close()  # the receiver's process goes away...
    (dropped,) = wait_for(lambda: client.recv() or client.dropped())
    assert dropped[0] == peer and not client._dealers
    again = make(port=port)  # ...and comes back on the same address
    assert again.bind() == address
    client.send(client.connect(address), [b"again"])
    sender, frames = wait_for(again.recv)
    assert bytes(frames[0]) == b"again"


def test_a_router_maps_each_connection_to_its_peer(make):
    server, a, b = make(), make(), make()
    address = server.bind()
    for c in (a, b):
        c.send(c.connect(address), [b"x"])
    ids = {wait_for(server.recv)[0] for _ in range(2)}
    assert set(server._peer_fd) == {bytes.fromhex(i) for i in ids} and len(server._fd_peer) == 2
    a.close()
    dropped = wait_for(lambda: server.recv() or server.dropped())
    assert len(dropped) == 1 and dropped[0][0] in ids
    assert len(server._peer_fd) == len(server._fd_peer) == 1
