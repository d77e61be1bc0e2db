"""Transfer lifecycle over every transport: decode reserves and expects, prefill pushes layer by
layer, both sides end DONE or FAILED and free their blocks."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from engine.kv_cache import BlockManager, allocate_kv_tensors
from kvtransfer.base import TRANSPORTS, FrameTransport, KVLayout, TransferState, _load_builtin, get_transport
from kvtransfer.format import encode_frames, gather_layer
from kvtransfer.receiver import KVReceiver, encode_control
from kvtransfer.sender import KVSender, LayoutMismatch

_load_builtin()
W, T, D, F = TransferState.WAITING, TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED
LAYERS, HEADS, DIM = 4, 2, 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def layout(block_size: int, dtype: str = "float32", heads: tuple[int, int] = (0, -1), fp: str = "fp-1") -> KVLayout:
    return KVLayout(fp, LAYERS, HEADS, DIM, block_size, dtype, *heads)


class Side:
    """One cache (block manager + KV tensors) of a layout."""

    def __init__(self, lay: KVLayout, num_blocks: int = 32) -> None:
        self.layout = lay
        h0, h1 = lay.heads
        self.bm = BlockManager(num_blocks, lay.block_size, enable_prefix_caching=False)
        self.kv = allocate_kv_tensors(LAYERS, num_blocks, lay.block_size, h1 - h0, DIM, DTYPES[lay.dtype])

    def reserve(self, num_tokens: int) -> list[int]:
        blocks: list[int] = []
        assert self.bm.allocate(blocks, num_tokens)
        return blocks

    def fill_random(self, blocks: list[int], num_tokens: int, seed: int) -> None:
        """Random KV of all model heads from ``seed``; this side stores the heads it holds."""
        g = torch.Generator().manual_seed(seed)
        bs, (h0, h1) = self.layout.block_size, self.layout.heads
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(num_tokens)])
        for k, v in self.kv:
            for c in (k, v):
                c[slots] = torch.randn((num_tokens, HEADS, DIM), generator=g)[:, h0:h1].to(c.dtype)

    def read(self, blocks: list[int], start: int, end: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_layer(self.kv[layer], blocks, self.layout.block_size, start, end)


@pytest.fixture(params=sorted(TRANSPORTS))
def net(request) -> Iterator[Callable[..., object]]:
    """``net(kind, layout, **kw)`` builds a KVSender or KVReceiver on a fresh transport."""
    made: list[KVSender | KVReceiver] = []

    def build(kind: str, side: Side, **kw) -> KVSender | KVReceiver:
        transport = get_transport(request.param)
        obj = (KVSender(transport, side.layout, **kw) if kind == "sender"
               else KVReceiver(transport, side.layout, side.kv, **kw))
        made.append(obj)
        return obj

    yield build
    for obj in made:
        obj.close()


def handshake(sender: KVSender, receiver: KVReceiver, timeout_s: float = 10) -> KVLayout:
    """``connect`` blocks until the receiver answers, so run the receiver's loop meanwhile."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            receiver.progress()
            time.sleep(0.0005)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    try:
        return sender.connect(receiver.address, timeout_s=timeout_s)
    finally:
        stop.set()
        th.join()


def pump(*sides: KVSender | KVReceiver, until: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while True:
        for s in sides:
            s.progress()
        if until():
            return
        assert time.monotonic() < end, "timed out pumping"
        time.sleep(0.0002)


def send_layers(sender: KVSender, src: Side, blocks: list[int], tid: str, start: int, end: int,
                layers: Sequence[int] = range(LAYERS)) -> None:
    for layer in layers:
        k, v = src.read(blocks, start, end, layer)
        assert sender.send_layer(tid, layer, k, v, token_start=start)


def assert_same(a: Side, ablocks: list[int], b: Side, bblocks: list[int], start: int, end: int) -> None:
    for layer in range(LAYERS):
        for x, y in zip(a.read(ablocks, start, end, layer), b.read(bblocks, start, end, layer)):
            assert torch.equal(bits(x), bits(y)), f"layer {layer} differs"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so equality is bitwise (not float equality)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("start", [0, 5])
def test_full_transfer_streams_layer_by_layer(net, dtype, start):
    pre, dec = Side(layout(4, dtype)), Side(layout(8, dtype))
    tx, rx = net("sender", pre), net("receiver", dec)
    assert handshake(tx, rx) == dec.layout
    n = 13
    pblocks, dblocks = pre.reserve(start + n), dec.reserve(start + n)
    pre.fill_random(pblocks, start + n, seed=1)
    rx.expect("t1", dblocks, n, token_start=start)
    tx.begin("t1", rx.address, n, token_start=start)
    pump(tx, rx, until=lambda: True)
    assert (tx.poll("t1"), rx.poll("t1")) == (W, W)
    send_layers(tx, pre, pblocks, "t1", start, start + n, layers=[0])
    assert tx.poll("t1") == T
    pump(tx, rx, until=lambda: rx.poll("t1") == T)
    assert tx.poll("t1") == T  # no ack before the last layer
    mid = start + 6  # the other layers in two token chunks, the later one first
    send_layers(tx, pre, pblocks, "t1", mid, start + n, layers=range(1, LAYERS))
    send_layers(tx, pre, pblocks, "t1", start, mid, layers=range(1, LAYERS))
    pump(tx, rx, until=lambda: tx.poll("t1") == D)
    assert rx.pop_finished() == [("t1", D)] and tx.pop_finished() == [("t1", D)]
    assert_same(pre, pblocks, dec, dblocks, start, start + n)
    assert rx.dropped_frames == 0 and tx.dropped_messages == 0
    for side, blocks in ((pre, pblocks), (dec, dblocks)):
        side.bm.free(blocks)
        assert side.bm.num_used_blocks == 0


def test_a_trailer_completes_the_transfer_and_reaches_the_receivers_caller(net):
    """Decode's first token travels as the trailer: a transfer expected with one is DONE only
    once every frame and the trailer are in, and the receiver hands the trailer over once."""
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre), net("receiver", dec)
    handshake(tx, rx)
    pblocks, dblocks = pre.reserve(9), dec.reserve(9)
    pre.fill_random(pblocks, 9, seed=4)
    rx.expect("t", dblocks, 9, trailer=True)
    tx.begin("t", rx.address, 9)
    send_layers(tx, pre, pblocks, "t", 0, 9)
    pump(tx, rx, until=lambda: rx._transfers["t"].missing == 0)  # every frame in, but no trailer:
    assert (tx.poll("t"), rx.poll("t")) == (T, T) and rx.take_trailer("t") is None  # not DONE, no ack
    assert tx.end("t", {"first_token": 42})
    pump(tx, rx, until=lambda: tx.poll("t") == D)
    assert rx.pop_finished() == [("t", D)] and tx.pop_finished() == [("t", D)]
    assert rx.take_trailer("t") == {"first_token": 42} and rx.take_trailer("t") is None
    assert_same(pre, pblocks, dec, dblocks, 0, 9)
    assert not tx.end("t", {"first_token": 1})  # ended: nothing sent
    with pytest.raises(ValueError):
        tx.begin("u", rx.address, 1)
        tx.end("u", ["not", "a", "map"])


def test_a_trailer_that_is_not_a_map_fails_the_transfer(net):
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre), net("receiver", dec)
    handshake(tx, rx)
    pblocks, dblocks = pre.reserve(5), dec.reserve(5)
    rx.expect("t", dblocks, 5, trailer=True)
    tx.begin("t", rx.address, 5)
    tx.transport.send(tx.links.get(rx.address).peer, encode_control("end", id="t", trailer=7))  # not a map
    pump(tx, rx, until=lambda: tx.poll("t") == F and rx.poll("t") == F)
    assert "trailer" in rx.error("t") and rx.take_trailer("t") is None


def test_two_concurrent_transfers_from_two_senders(net):
    pa, pb, dec = Side(layout(4)), Side(layout(2)), Side(layout(8))
    ta, tb, rx = net("sender", pa), net("sender", pb), net("receiver", dec)
    handshake(ta, rx), handshake(tb, rx)
    ba, bb = pa.reserve(20), pb.reserve(9)
    pa.fill_random(ba, 20, seed=2), pb.fill_random(bb, 9, seed=3)
    da, db = dec.reserve(20), dec.reserve(9)
    rx.expect("a", da, 20), rx.expect("b", db, 9)
    ta.begin("a", rx.address, 20), tb.begin("b", rx.address, 9)
    for layer in range(LAYERS):  # interleaved
        send_layers(ta, pa, ba, "a", 0, 20, [layer])
        send_layers(tb, pb, bb, "b", 0, 9, [layer])
    pump(ta, tb, rx, until=lambda: ta.poll("a") == D and tb.poll("b") == D)
    assert sorted(rx.pop_finished()) == [("a", D), ("b", D)]
    assert_same(pa, ba, dec, da, 0, 20)
    assert_same(pb, bb, dec, db, 0, 9)


def test_head_shard_senders_fill_one_receiver(net):
    full = Side(layout(4))
    s0, s1, dec = Side(layout(4, heads=(0, 1))), Side(layout(2, heads=(1, 2))), Side(layout(8))
    t0, t1, rx = net("sender", s0), net("sender", s1), net("receiver", dec)
    handshake(t0, rx), handshake(t1, rx)
    fb, b0, b1 = full.reserve(11), s0.reserve(11), s1.reserve(11)
    for side, blocks in ((full, fb), (s0, b0), (s1, b1)):  # each shard: its heads of `full`
        side.fill_random(blocks, 11, seed=4)
    db = dec.reserve(11)
    rx.expect("x", db, 11)
    t0.begin("x", rx.address, 11), t1.begin("x", rx.address, 11)
    send_layers(t0, s0, b0, "x", 0, 11)
    pump(t0, rx, until=lambda: rx.poll("x") == T)
    time.sleep(0.05)
    pump(t0, rx, until=lambda: True)
    assert rx.poll("x") == T and t0.poll("x") == T  # half the heads: not done
    send_layers(t1, s1, b1, "x", 0, 11)
    pump(t0, t1, rx, until=lambda: t0.poll("x") == D and t1.poll("x") == D)
    assert rx.poll("x") == D
    assert_same(full, fb, dec, db, 0, 11)


def test_sender_sends_only_the_receivers_heads(net):
    pre, dec = Side(layout(4)), Side(layout(8, heads=(1, 2)))
    tx, rx = net("sender", pre), net("receiver", dec)
    handshake(tx, rx)
    pb, db = pre.reserve(6), dec.reserve(6)
    pre.fill_random(pb, 6, seed=5)
    rx.expect("h", db, 6)
    tx.begin("h", rx.address, 6)
    send_layers(tx, pre, pb, "h", 0, 6)
    pump(tx, rx, until=lambda: tx.poll("h") == D)
    for layer in range(LAYERS):
        for x, y in zip(pre.read(pb, 0, 6, layer), dec.read(db, 0, 6, layer)):
            assert torch.equal(x[:, 1:2], y)


def test_fingerprint_mismatch_refused(net):
    tx, rx = net("sender", Side(layout(4, fp="aaaa1111"))), net("receiver", Side(layout(8, fp="bbbb2222")))
    with pytest.raises(LayoutMismatch, match="bbbb2222.*aaaa1111") as e:
        handshake(tx, rx)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="connect"):
        tx.begin("t", rx.address, 4)


def test_handshake_timeout_is_clear(net):
    rx = net("receiver", Side(layout(8)))  # never progressed: no reply
    tx = net("sender", Side(layout(4)))
    with pytest.raises(TimeoutError, match=rx.address):
        tx.connect(rx.address, timeout_s=0.3)


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_from_either_side_fails_both(net, side):
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre), net("receiver", dec)
    handshake(tx, rx)
    pb, db = pre.reserve(8), dec.reserve(8)
    rx.expect("t", db, 8)
    tx.begin("t", rx.address, 8)
    send_layers(tx, pre, pb, "t", 0, 8, [0])
    pump(tx, rx, until=lambda: rx.poll("t") == T)
    (tx if side == "sender" else rx).abort("t")
    pump(tx, rx, until=lambda: tx.poll("t") == F and rx.poll("t") == F)
    assert "aborted" in tx.error("t") and "aborted" in rx.error("t")
    assert not tx.send_layer("t", 1, *pre.read(pb, 0, 8, 1))  # ended: nothing sent
    assert tx.pop_finished() == [("t", F)] and rx.pop_finished() == [("t", F)]
    rx.abort("t"), tx.abort("t")  # no-ops once ended


def test_receiver_lease_expiry_frees_without_any_frame(net):
    clock, dec = FakeClock(), Side(layout(8))
    rx = net("receiver", dec, lease_s=2.0, clock=clock)
    db = dec.reserve(16)
    rx.expect("lost", db, 16)
    clock.now = 1.9
    rx.progress()
    assert rx.poll("lost") == W and rx.pop_finished() == []
    clock.now = 2.0
    rx.progress()
    assert rx.pop_finished() == [("lost", F)] and "lease" in rx.error("lost")
    dec.bm.free(db)
    assert dec.bm.num_used_blocks == 0


def test_sender_lease_expiry_without_ack(net):
    clock, pre, dec = FakeClock(), Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre, lease_s=2.0, clock=clock, margin_s=0.5), net("receiver", dec)
    handshake(tx, rx)
    pb = pre.reserve(4)
    rx.expect("t", dec.reserve(4), 4)
    tx.begin("t", rx.address, 4)
    send_layers(tx, pre, pb, "t", 0, 4, [0])  # receiver never progressed again: no ack
    clock.now = 2.4
    tx.progress()
    assert tx.poll("t") == T
    clock.now = 2.5
    tx.progress()
    assert tx.pop_finished() == [("t", F)] and "lease" in tx.error("t")
    pre.bm.free(pb)
    assert pre.bm.num_used_blocks == 0


def test_a_queued_transfer_renews_the_lease_and_a_dead_sender_lets_it_expire(net):
    """A prompt may wait in the prefill queue longer than the lease: the sender renews the
    receiver's lease meanwhile; once it stops (died), the lease frees the blocks."""
    clock, pre, dec = FakeClock(), Side(layout(4)), Side(layout(8))
    tx = net("sender", pre, lease_s=3.0, clock=clock, margin_s=0.5)
    rx = net("receiver", dec, lease_s=3.0, clock=clock)
    handshake(tx, rx)
    rx.expect("q", dec.reserve(4), 4)
    tx.begin("q", rx.address, 4)
    def settle():  # let messages in flight arrive (ucx delivers asynchronously)
        end = time.monotonic() + 0.02
        pump(tx, rx, until=lambda: time.monotonic() > end)
    for step in range(1, 31):  # 15 s of queueing: five leases
        clock.now = step * 0.5
        settle()
        assert tx.poll("q") == W and rx.poll("q") == W, clock.now
    pb = pre.reserve(4)
    send_layers(tx, pre, pb, "q", 0, 4, list(range(layout(4).num_layers)))
    pump(tx, rx, until=lambda: tx.poll("q") == D and rx.poll("q") == D)
    rx.expect("r", dec.reserve(4), 4)
    tx.begin("r", rx.address, 4)
    settle()
    # The sender hangs while "r" is queued: no more renewals. (Had its process died, a
    # transport that sees the connection close would fail "r" at once: test_faults.py.)
    t0 = clock.now
    clock.now = t0 + 2.9
    rx.progress()
    assert rx.poll("r") == W
    clock.now = t0 + 3.0 + 3.0 / 3  # the last renewal was at most lease/3 before t0
    rx.progress()
    assert rx.poll("r") == F and "lease" in rx.error("r")


def test_begin_for_unexpected_transfer_fails_fast(net):
    tx, rx = net("sender", Side(layout(4))), net("receiver", Side(layout(8)))
    handshake(tx, rx)
    tx.begin("nobody-expects", rx.address, 4)
    pump(tx, rx, until=lambda: tx.poll("nobody-expects") == F)
    assert "does not expect" in tx.error("nobody-expects")


def test_duplicate_and_late_frames_dropped(net):
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre), net("receiver", dec)
    raw = net("sender", pre).transport  # a bare endpoint to inject frames
    handshake(tx, rx)
    pb, db = pre.reserve(8), dec.reserve(8)
    pre.fill_random(pb, 8, seed=6)
    rx.expect("t", db, 8)
    tx.begin("t", rx.address, 8)
    send_layers(tx, pre, pb, "t", 0, 8, [0, 0, 1])  # layer 0 twice
    pump(tx, rx, until=lambda: rx.dropped_frames == 1)
    send_layers(tx, pre, pb, "t", 0, 8, [2, 3])
    pump(tx, rx, until=lambda: tx.poll("t") == D)
    peer = raw.connect(rx.address)
    k, v = pre.read(pb, 0, 8, 0)
    raw.send(peer, encode_frames("t", "fp-1", 0, 0, torch.zeros_like(k), v, HEADS))  # late
    raw.send(peer, encode_frames("never", "fp-1", 0, 0, k, v, HEADS))  # unknown
    raw.send(peer, [b"garbage", b"", b""])
    pump(rx, until=lambda: rx.dropped_frames == 4)
    assert rx.poll("t") == D
    assert_same(pre, pb, dec, db, 0, 8)  # the late zeros were not written


def test_out_of_range_frame_fails_transfer(net):
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre), net("receiver", dec)
    raw = net("sender", pre).transport  # a bare endpoint to inject frames
    handshake(tx, rx)
    rx.expect("t", dec.reserve(8), 8)
    tx.begin("t", rx.address, 8)
    pump(tx, rx, until=lambda: True)
    k = torch.zeros(4, HEADS, DIM)  # tokens [6, 10) of a transfer of [0, 8)
    raw.send(raw.connect(rx.address), encode_frames("t", "fp-1", 0, 6, k, k, HEADS))
    pump(tx, rx, until=lambda: tx.poll("t") == F and rx.poll("t") == F)
    assert "outside expected tokens" in tx.error("t")


class Corrupting(FrameTransport):
    """Wraps a transport; flips one K byte of every data frame of one transfer."""

    def __init__(self, inner: FrameTransport, transfer_id: str) -> None:
        self.inner, self.transfer_id = inner, transfer_id

    def send(self, peer, frames):
        if len(frames) == 3 and self.transfer_id.encode() in bytes(frames[0]):
            k = bytearray(frames[1])
            k[len(k) // 2] ^= 0x40
            frames = [frames[0], k, frames[2]]
        self.inner.send(peer, frames)

    def bind(self): return self.inner.bind()
    def connect(self, address): return self.inner.connect(address)
    def recv(self): return self.inner.recv()
    def disconnect(self, peer): self.inner.disconnect(peer)
    def dropped(self): return self.inner.dropped()
    def close(self): self.inner.close()


def test_corrupt_payload_fails_both_while_other_transfer_completes(net):
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre), net("receiver", dec)
    tx.transport = Corrupting(tx.transport, "bad")
    handshake(tx, rx)
    pg, pbad = pre.reserve(12), pre.reserve(12)
    pre.fill_random(pg, 12, seed=7), pre.fill_random(pbad, 12, seed=8)
    dg, dbad = dec.reserve(12), dec.reserve(12)
    rx.expect("good", dg, 12), rx.expect("bad", dbad, 12)
    tx.begin("good", rx.address, 12), tx.begin("bad", rx.address, 12)
    for layer in range(LAYERS):
        send_layers(tx, pre, pbad, "bad", 0, 12, [layer])
        send_layers(tx, pre, pg, "good", 0, 12, [layer])
    pump(tx, rx, until=lambda: tx.poll("good") == D and tx.poll("bad") == F)
    assert rx.poll("bad") == F and rx.poll("good") == D
    assert "checksum" in rx.error("bad") and "checksum" in tx.error("bad")
    assert_same(pre, pg, dec, dg, 0, 12)
    for tid, state in rx.pop_finished():
        dec.bm.free(dg if tid == "good" else dbad)
    assert dec.bm.num_used_blocks == 0
