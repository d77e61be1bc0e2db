"""UCX transport, dropped connections: what this side can tell without endpoint error handling
(a peer it cannot reach, a peer that came back on a new endpoint while messages of its old one
were cut), and that a disconnected peer is forgotten and reached again afresh."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import time

import pytest

pytest.importorskip("ucxx", reason="ucxx (pip ucxx-cu12) is not importable: no UCX transport here")

from tests.kvtransfer.test_ucx import make, recv_wait, wait_dropped  # noqa: E402,F401  (make is a fixture)
from tests.kvtransfer.test_ucx_gpu import _RawPeer  # noqa: E402


def test_a_new_endpoint_cuts_what_the_old_one_left_incomplete(make):
    server = make()
    raw = _RawPeer(server.bind(), uid=0x0C0FFEE0)
    try:
        hello = raw.worker.address.tobytes()
        raw.send([1, 5, [3], hello], [b"one"])
        assert [bytes(f) for f in recv_wait(server)[1]] == [b"one"]
        raw.send([1, 6, [16], None])  # announces 16 bytes that never come: cut off
        raw.send([1, 900, [3], hello], [b"new"])  # first message of a new endpoint (its address again)
        assert wait_dropped(server) == [("0c0ffee0", "it reconnected: its earlier connection was cut mid-message")]
        sender, frames = recv_wait(server)
        assert sender == "0c0ffee0" and [bytes(f) for f in frames] == [b"new"]
        assert len(server._cut) == 1  # kept until UCX is done with its buffer (close cancels it)
    finally:
        raw.close()


def test_a_new_endpoint_after_a_quiet_spell_is_no_drop(make):
    server = make()
    raw = _RawPeer(server.bind(), uid=0x0C0FFEE1)
    try:
        hello = raw.worker.address.tobytes()
        raw.send([1, 5, [3], hello], [b"one"])
        recv_wait(server)
        raw.send([1, 77, [3], hello], [b"two"])  # e.g. its endpoint was closed when idle
        assert [bytes(f) for f in recv_wait(server)[1]] == [b"two"]
        time.sleep(0.05)
        assert server.recv() is None and server.dropped() == []
    finally:
        raw.close()


def test_disconnect_forgets_the_peer_and_the_next_connect_starts_a_new_endpoint(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    client.send(peer, [b"one"])
    sender, _ = recv_wait(server)
    server.send(sender, [b"reply"])
    recv_wait(client)
    assert len(client._peers) == 1
    client.disconnect(peer)
    end = time.monotonic() + 10
    while len(client._peers):  # the progress thread forgets it
        assert time.monotonic() < end
        time.sleep(0.001)
    client.send(client.connect(server.bind()), [b"two"])
    assert [bytes(f) for f in recv_wait(server)[1]] == [b"two"]
    server.send(sender, [b"reply again"])  # the server's endpoint to the client still works
    assert [bytes(f) for f in recv_wait(client)[1]] == [b"reply again"]
    assert server.dropped() == [] and client.dropped() == []
