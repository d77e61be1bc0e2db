"""A UCX transport replaces its UCX worker once enough peers are gone for good
(kvtransfer/ucx/generation.py): what UCX mapped of dead peers is unmapped then, and every live
peer goes on talking to it through the change, senders and receivers alike.

Why: UCX keeps a peer's shared-memory segments mapped while our UCX worker lives once that peer
connected back to it, endpoint closed or not, so a long-lived worker gained ~2 mappings (1-2.5
MB) per replaced peer, for good (the soak: a prefill worker 6 -> 12 SysV mappings over three
decode-worker replacements)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import time
from collections import deque

import pytest

pytest.importorskip("ucxx", reason="ucxx (pip ucxx-cu12) is not importable: no UCX transport here")

import torch  # noqa: E402

from engine.kv_cache import BlockManager, allocate_kv_tensors  # noqa: E402
from kvtransfer.ucx import generation as ucx_generation, peers as ucx_peers  # noqa: E402
from kvtransfer.base import TransferState  # noqa: E402
from kvtransfer.format import gather_layer  # noqa: E402
from kvtransfer.receiver import KVReceiver  # noqa: E402
from kvtransfer.sender import KVSender  # noqa: E402
from kvtransfer.ucx import UcxTransport  # noqa: E402
from kvtransfer.ucx.recv import ReceiveSide, _Incoming  # noqa: E402
from kvtransfer.ucx.wire import parse_address  # noqa: E402
from tests.kvtransfer.test_faults import peer_mod, spawn  # noqa: E402,F401  (spawn is a fixture)
from tests.kvtransfer.test_ucx import make, recv_wait  # noqa: E402,F401  (make is a fixture)
from tests.kvtransfer.test_ucx_faults import shared_memory_mappings  # noqa: E402

TOKENS = 200  # 12.8 KB frames: rendezvous, as a layer's KV is (what maps the peer's memory)


@pytest.fixture
def quick(monkeypatch):
    """Prune every 0.2 s and retire a replaced worker after 0.5 s (the defaults, 5 s and 30 s,
    only make the same events slower)."""
    monkeypatch.setattr(ucx_peers, "PRUNE_EVERY_S", 0.2)
    monkeypatch.setattr(ucx_generation, "RETIRE_AFTER_S", 0.5)


def until(cond, what: str, pump=lambda: None, timeout: float = 30.0, state=lambda: "") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"never: {what} {state()}"
        pump()
        time.sleep(0.002)


def _recycle_state(t) -> str:
    """What a replacement waits on (transport._replace_worker_if_due), for a failure's message."""
    live = set(t._peers.live_uids())
    return (f"(recycles {t.recycles}, retiring {len(t._retiring)}, stale {t._peers.stale} of {t._peers.recycle_at}, "
            f"outbox {len(t._outbox)}, live peers {len(live)}, sending {t.sender.busy(live)}, "
            f"receiving {t.receiver.receiving_from(live)}; on the retiring workers: sending "
            f"{[t.sender.busy(live, g) for g in t._retiring]}, "
            f"receiving {[t.receiver.busy_on(g.worker, live) for g in t._retiring]})")


def test_a_replaced_worker_keeps_its_peer_talking_both_ways(make, quick):
    server, client = make(), make()
    first = server.bind()
    peer = client.connect(first)
    client.send(peer, [b"before"])
    sender, frames = recv_wait(server)
    assert [bytes(f) for f in frames] == [b"before"]
    server._peers.stale = 10**6  # as if that many peers had gone: replaced at its next idle round
    until(lambda: server.recycles == 1, "the server replaced its worker")
    second = server.bind()
    assert second != first and parse_address(second)[3] == 1 and server.identity(second) == server.identity(first)
    until(lambda: not server._retiring, "the old worker was destroyed")
    client.send(peer, [b"after"])  # reaches the new worker: the old one is gone
    assert [bytes(f) for f in recv_wait(server)[1]] == [b"after"]
    server.send(sender, [b"reply"])
    assert [bytes(f) for f in recv_wait(client)[1]] == [b"reply"]
    assert client.connect(first) == peer  # a stale copy of the address: the newer one is kept
    client.send(peer, [b"still"])
    assert [bytes(f) for f in recv_wait(server)[1]] == [b"still"]
    late = make()  # a newcomer given the newest address
    late.send(late.connect(second), [b"newcomer"])
    assert [bytes(f) for f in recv_wait(server)[1]] == [b"newcomer"]
    assert server.dropped() == [] and client.dropped() == [] and late.dropped() == []


def _transfer(sender: KVSender, receiver, address: str, tid: str, seed: int) -> None:
    receiver.tell(f"EXPECT {tid} {TOKENS} {seed}")
    receiver.wait_for(f"EXPECTING {tid}", sender.progress)
    sender.begin(tid, address, TOKENS)
    for layer, (k, v) in enumerate(peer_mod.make_kv(seed, TOKENS)):
        assert sender.send_layer(tid, layer, k, v)
    assert receiver.wait_for(f"FINISHED {tid}", sender.progress)[2:] == ["done", "ok"]


def test_a_sender_outliving_its_receivers_unmaps_them(spawn, quick):
    """Six receiver processes, each killed after a transfer: the sender replaces its worker
    once RECYCLE_MIN_STALE of them are gone, and holds no more shared memory at the end than
    with one live receiver (an unreplaced worker: 2 mappings more per dead receiver, +10)."""
    sender = KVSender(UcxTransport(), peer_mod.make_layout(4), lease_s=30.0)
    try:
        baseline = None
        for n in range(6):
            receiver = spawn("receiver", "ucx", "30")
            address = receiver.wait_for("ADDR")[1]
            sender.connect(address, timeout_s=20)
            _transfer(sender, receiver, address, f"r{n}", n)
            if baseline is None:
                baseline = shared_memory_mappings()  # our worker's own + one live receiver's
            receiver.kill()
            sender.disconnect(address)  # as the router has every sender forget a lost receiver
        # (under make test's load this once never came within 30 s, where it takes under 1 s
        # alone or beside two busy cores: a failure says what held it)
        until(lambda: sender.transport.recycles >= 1 and not sender.transport._retiring,
              "the sender replaced its worker and destroyed the old one", sender.progress,
              state=lambda: _recycle_state(sender.transport))
        # Left: our worker's own and those of the receivers that died since (fewer than
        # RECYCLE_MIN_STALE, or it would be replaced again), 2 each, as measured; the live
        # receiver's 2 of the baseline are gone with it.
        assert shared_memory_mappings() <= baseline - 2 + 2 * (ucx_peers.RECYCLE_MIN_STALE - 1)
        receiver = spawn("receiver", "ucx", "30")
        address = receiver.wait_for("ADDR")[1]
        sender.connect(address, timeout_s=20)
        _transfer(sender, receiver, address, "last", 99)
    finally:
        sender.close()


def test_a_receiver_that_replaces_its_worker_keeps_its_senders(spawn, quick):
    """A sender process connected to the receiver's first address goes on sending to it (its
    transport follows the receiver's announcement), before and after the old worker is gone,
    with the right bytes; a new sender given the newest address connects and sends too."""
    lay = peer_mod.make_layout(8)
    bm = BlockManager(64, lay.block_size, enable_prefix_caching=False)
    kv = allocate_kv_tensors(lay.num_layers, 64, lay.block_size, lay.num_kv_heads, lay.head_dim, torch.float32)
    rx = KVReceiver(UcxTransport(), lay, kv, lease_s=30.0)
    first = rx.address

    def receive(child, tid: str, seed: int) -> None:
        blocks: list[int] = []
        assert bm.allocate(blocks, TOKENS)
        rx.expect(tid, blocks, TOKENS)
        child.tell(f"SEND {tid} {TOKENS} {seed} {lay.num_layers}")
        done: dict = {}
        until(lambda: done.update(rx.pop_finished()) or tid in done, f"{tid} finished", rx.progress)
        assert done[tid] is TransferState.DONE, rx.error(tid)
        got = [gather_layer(kv[layer], blocks, lay.block_size, 0, TOKENS) for layer in range(lay.num_layers)]
        assert all(torch.equal(a, b) for pair, want in zip(got, peer_mod.make_kv(seed, TOKENS))
                   for a, b in zip(pair, want))
        bm.free(blocks)

    try:
        old = spawn("sender", "ucx", first, "30")
        old.wait_for("CONNECTED", rx.progress)
        receive(old, "t1", 1)
        rx.transport._peers.stale = 10**6  # as if that many peers had gone
        until(lambda: rx.transport.recycles == 1, "the receiver replaced its worker", rx.progress)
        assert rx.address != first
        receive(old, "t2", 2)  # the sender still names the first address
        until(lambda: not rx.transport._retiring, "the old worker was destroyed", rx.progress)
        receive(old, "t3", 3)  # so this went to the new worker
        new = spawn("sender", "ucx", rx.address, "30")
        new.wait_for("CONNECTED", rx.progress)
        receive(new, "t4", 4)
        assert bm.num_used_blocks == 0
    finally:
        rx.close()


def test_a_peer_that_missed_the_announcement_follows_the_newest_address(make, quick):
    """A peer the transport had forgotten is not told of its new worker; given the newest
    address (as the router publishes it, and ``Links.get`` passes it on) it reaches the new
    worker, once the old one is gone."""
    server, client = make(), make()
    peer = client.connect(server.bind())
    client.send(peer, [b"hello"])
    sender, _ = recv_wait(server)
    server.disconnect(sender)  # forgotten (as after PEER_IDLE_S): no announcement goes to it
    server._peers.stale = 10**6
    until(lambda: server.recycles == 1 and not server._retiring, "the server replaced and destroyed its worker")
    assert client.connect(server.bind()) == peer
    client.send(peer, [b"found"])
    assert [bytes(f) for f in recv_wait(server)[1]] == [b"found"]


def test_only_live_peers_unfinished_messages_hold_a_replaced_worker():
    """A message whose sender died mid-way never completes (no error handling on our endpoints:
    its receives just wait), so it must not keep a replaced worker, and the dead peers' mappings
    it was replaced to drop, until RETIRE_FORCE_S; a live peer's, received or cut, does."""
    old, new = object(), object()
    side = ReceiveSide(lambda: [], None, None, 0, lambda item: None, lambda uid, why: None)
    side._receiving[7] = deque([_Incoming(None, None, worker=old)])  # header only: incomplete
    assert side.busy_on(old, {7}) and not side.busy_on(new, {7})
    assert not side.busy_on(old, set())  # peer 7 gone
    side._receiving.clear()
    side._cut.append((8, _Incoming(None, None, frames=[], worker=old, dropped=True, frame_reqs=[_Pending()])))
    assert side.busy_on(old, {8}) and not side.busy_on(old, {7})


class _Pending:
    completed = False
