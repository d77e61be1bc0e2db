"""UCX transport, dropped connections: what this side can tell without endpoint error handling
(a peer it cannot reach, a peer that came back on a new connection while messages of its old
one were cut), that a disconnected peer is forgotten and reached again afresh, and that new
connections reuse the endpoint kept for the peer's address (no shared memory mapped again)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import time

import pytest

pytest.importorskip("ucxx", reason="ucxx (pip ucxx-cu12) is not importable: no UCX transport here")

from kvtransfer.base import TransferState  # noqa: E402
from kvtransfer.sender import KVSender  # noqa: E402
from kvtransfer.ucx import UcxTransport  # noqa: E402
from tests.kvtransfer.test_faults import peer_mod, spawn  # noqa: E402,F401  (spawn is a fixture)
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
        assert len(server.receiver._cut) == 1  # kept until UCX is done with its buffer (close cancels it)
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


def shared_memory_mappings() -> int:
    """Mappings of shared-memory segments in this process (UCX's sysv and posix ones)."""
    with open("/proc/self/maps") as f:
        return sum("/SYSV" in line or "/dev/shm/" in line for line in f)


def test_severed_connections_reuse_their_endpoint_so_no_shared_memory_is_mapped_again(spawn):
    """The chaos fault ``sever`` 10 times mid-transfer against a receiver process, each followed
    by a new connection (hello, the untold fail, the next transfer): the sender's process maps
    no more shared memory than after its first transfer, and a transfer after them all
    delivers the right bytes. An endpoint per connection mapped the receiver's segments again
    each time, never unmapped once the receiver had connected back (UCX's rendezvous does, for
    frames above its shared-memory eager size): prefill RSS grew in steps."""
    tokens = 200  # 12.8 KB frames: rendezvous (4 KB ones go eagerly, and showed no growth)
    sender = KVSender(UcxTransport(), peer_mod.make_layout(4), lease_s=30.0)
    try:
        receiver = spawn("receiver", "ucx", "30")
        address = receiver.wait_for("ADDR")[1]
        sender.connect(address, timeout_s=20)

        def transfer(tid: str, seed: int, sever: bool) -> None:
            receiver.tell(f"EXPECT {tid} {tokens} {seed}")
            receiver.wait_for(f"EXPECTING {tid}", sender.progress)
            sender.begin(tid, address, tokens)  # after a sever: a new connection first
            for layer, (k, v) in enumerate(peer_mod.make_kv(seed, tokens)):
                if sever and layer == 1:
                    sender.inject("sever")
                    assert not sender.send_layer(tid, layer, k, v)
                    assert sender.poll(tid) is TransferState.FAILED and "severed" in sender.error(tid)
                    return
                assert sender.send_layer(tid, layer, k, v)
            assert receiver.wait_for(f"FINISHED {tid}", sender.progress)[2:] == ["done", "ok"]

        transfer("first", 1, sever=False)
        baseline = shared_memory_mappings()
        for i in range(10):
            transfer(f"severed{i}", 2 + i, sever=True)
            if i:  # its fail reached the receiver on this connection: its blocks are free again
                receiver.wait_for(f"FINISHED severed{i - 1} failed", sender.progress)
        transfer("last", 99, sever=False)
        assert "FINISHED severed9 failed " in receiver.seen
        assert shared_memory_mappings() == baseline
        assert sender.transport._peers.num_endpoints == 1
        receiver.tell("EXIT")
        assert receiver.proc.wait(timeout=20) == 0
    finally:
        sender.close()



def test_the_progress_thread_waits_when_events_never_clear(make):
    """A UCX worker whose ``arm()`` keeps refusing (events progress never clears: seen on prefill
    workers after their decode peers failed) must not make the progress thread spin a core for
    the rest of the process's life. Counted: rounds of progress in a quiet second (spinning:
    tens of thousands; waiting once arm() has refused _ARM_REFUSALS times: a few hundred), and
    a message still goes through."""
    server, client = make(), make()
    peer = client.connect(server.bind())

    class Refusing:  # the real worker, but arm() always refuses
        def __init__(self, worker):
            self._worker = worker

        def arm(self):
            return False

        def __getattr__(self, name):
            return getattr(self._worker, name)
    rounds = [0]
    pump = client._pump

    def counted():
        rounds[0] += 1
        return pump()
    client._pump = counted
    client._gen.worker = Refusing(client._gen.worker)
    time.sleep(1.5)  # past the progress thread's spin allowance (_SPIN_S)
    before = rounds[0]
    time.sleep(1.0)
    assert rounds[0] - before < 3000, rounds[0] - before
    assert client.arm_refusals >= 64
    client.send(peer, [b"still"])
    assert [bytes(f) for f in recv_wait(server)[1]] == [b"still"]
