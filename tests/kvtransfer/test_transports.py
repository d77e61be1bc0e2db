"""Conformance suite for FrameTransport: every registered transport must pass it unchanged."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import time
from collections.abc import Callable, Iterator

import pytest

from kvtransfer.base import TRANSPORTS, FrameTransport, _load_builtin, get_transport

_load_builtin()
# Every registered transport with its defaults, plus zmq over ipc.
PARAMS = [pytest.param((name, {}), id=name) for name in sorted(TRANSPORTS)]
if "zmq" in TRANSPORTS:
    PARAMS.append(pytest.param(("zmq", {"scheme": "ipc"}), id="zmq-ipc"))


@pytest.fixture(params=PARAMS)
def make(request) -> Iterator[Callable[[], FrameTransport]]:
    """Builds transports of the parametrized kind; closes them all after the test."""
    name, kwargs = request.param
    built: list[FrameTransport] = []

    def factory() -> FrameTransport:
        t = get_transport(name, **kwargs)
        built.append(t)
        return t

    factory.kind = name
    yield factory
    for t in built:
        t.close()


def recv_wait(t: FrameTransport, timeout: float = 10.0) -> tuple[str, list[bytes]]:
    """Next message on ``t`` with its frames as bytes; fails the test after ``timeout``."""
    end = time.monotonic() + timeout
    while (msg := t.recv()) is None:
        assert time.monotonic() < end, "no message arrived"
        time.sleep(0.0002)
    return msg[0], [bytes(f) for f in msg[1]]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown KV transport 'nope'") as e:
        get_transport("nope")
    for name in ("inproc", "zmq"):
        assert name in str(e.value)


def test_multi_buffer_message_and_reply(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    client.send(peer, [b"header", bytearray(b"\x00\x01\x02"), memoryview(b"payload" * 100)])
    sender_id, frames = recv_wait(server)
    assert frames == [b"header", b"\x00\x01\x02", b"payload" * 100]
    server.send(sender_id, [b"ack", b"x"])
    assert recv_wait(client) == (peer, [b"ack", b"x"])


def test_order_preserved_per_peer(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    for i in range(300):
        client.send(peer, [i.to_bytes(4, "little"), b"y" * (i % 7 + 1)])
    got = [int.from_bytes(recv_wait(server)[1][0], "little") for _ in range(300)]
    assert got == list(range(300))


def test_large_buffer_intact(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    big = os.urandom(64 << 20)
    client.send(peer, [b"h", big, memoryview(big)[: 1 << 20]])
    _, frames = recv_wait(server, timeout=30)
    assert len(frames) == 3 and frames[0] == b"h"
    assert frames[1] == big and frames[2] == big[: 1 << 20]


def test_replies_reach_the_right_sender(make):
    server, a, b = make(), make(), make()
    address = server.bind()
    pa, pb = a.connect(address), b.connect(address)
    a.send(pa, [b"from-a"])
    b.send(pb, [b"from-b"])
    ids = {}
    for _ in range(2):
        sender_id, frames = recv_wait(server)
        ids[frames[0]] = sender_id
    assert ids[b"from-a"] != ids[b"from-b"]
    server.send(ids[b"from-b"], [b"to-b"])
    server.send(ids[b"from-a"], [b"to-a"])
    assert recv_wait(a) == (pa, [b"to-a"])
    assert recv_wait(b) == (pb, [b"to-b"])
    time.sleep(0.05)
    assert a.recv() is None and b.recv() is None


def test_recv_none_when_empty(make):
    server, client = make(), make()
    assert client.recv() is None
    peer = client.connect(server.bind())
    assert server.recv() is None and client.recv() is None
    client.send(peer, [b"one"])
    recv_wait(server)
    assert server.recv() is None


def test_close_twice_is_safe(make):
    server, client = make(), make()
    client.connect(server.bind())
    server.close()
    server.close()
    client.close()
    client.close()
    assert client.recv() is None


def recv_or_drop(t: FrameTransport, timeout: float = 10.0) -> tuple[str, list[bytes]] | tuple[str, str]:
    """The next message, or the next drop report (peer, why), whichever comes first."""
    end = time.monotonic() + timeout
    while True:
        msg = t.recv()
        if msg is not None:
            return msg[0], [bytes(f) for f in msg[1]]
        if drops := t.dropped():
            return drops[0]
        assert time.monotonic() < end, "no message and no drop"
        time.sleep(0.0002)


def test_disconnect_forgets_and_connect_starts_afresh(make):
    server, client = make(), make()
    address = server.bind()
    peer = client.connect(address)
    client.send(peer, [b"one"])
    sender, _ = recv_wait(server)
    client.disconnect(peer)
    client.disconnect(peer)  # twice: a no-op
    client.disconnect("never-connected")  # unknown: a no-op
    peer = client.connect(address)
    client.send(peer, [b"two"])
    got = recv_or_drop(server)
    if isinstance(got[1], str):  # this transport told the server the first connection closed
        assert got[0] == sender
        got = recv_or_drop(server)
    sender, frames = got
    assert frames == [b"two"]
    server.send(sender, [b"back"])
    assert recv_wait(client) == (peer, [b"back"])
    assert client.dropped() == []  # what this side closed itself is not reported to it


def test_the_other_side_sees_a_disconnect_as_a_drop(make):
    """zmq and inproc report the peer's disconnect to the other side. UCX without endpoint
    error handling (kvtransfer/ucx/transport.py says why it stays off) cannot tell: nothing is reported
    there, and the receiver's lease (or the router's own disconnect) covers that case."""
    import time
    server, client = make(), make()
    peer = client.connect(server.bind())
    client.send(peer, [b"first"])
    sender, _ = recv_wait(server)
    client.disconnect(peer)
    if make.kind == "ucx":
        end = time.monotonic() + 1.0  # long enough for a report to have come, were there one
        while time.monotonic() < end:
            assert server.recv() is None and server.dropped() == []
            time.sleep(0.01)
        return
    assert recv_or_drop(server)[0] == sender
    assert server.recv() is None and server.dropped() == []
