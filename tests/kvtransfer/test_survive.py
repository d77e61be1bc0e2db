"""Surviving faults without waiting for the lease, over every transport: corrupt frames from a
transfer's own peer fail it at once (from a stranger they change nothing), frames lost in
transit fail it when its end shows the gap, a disconnected or severed receiver fails what was
in flight on it at once, and the next begin reconnects. Every test freezes the lease clock,
so no failure here can come from a lease."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.auth import PlaneAuth, new_secret
from kvtransfer.format import encode_frames
from kvtransfer.links import RECONNECT_TIMEOUT_S
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import CHAOS_FAULTS, KVSender
from kvtransfer.zmq_transport import ZmqTransport
from tests.kvtransfer.test_lifecycle import (  # noqa: F401  (net is a fixture)
    DIM, HEADS, LAYERS, D, F, T, W, FakeClock, Side, assert_same, handshake, layout, net, pump, send_layers)

KEY = new_secret()
AUTH = {"none": None, "header": PlaneAuth(KEY, "header"), "full": PlaneAuth(KEY, "full")}


def pair(net, auth: str = "none", trailer_side: bool = True):
    """A connected sender and receiver on frozen clocks, with their caches."""
    clock = FakeClock()
    pre, dec = Side(layout(4)), Side(layout(8))
    tx = net("sender", pre, clock=clock, auth=AUTH[auth])
    rx = net("receiver", dec, clock=clock, auth=AUTH[auth])
    handshake(tx, rx)
    return tx, rx, pre, dec


def start(tx: KVSender, rx: KVReceiver, pre: Side, dec: Side, tid: str, n: int = 8, seed: int = 1):
    """Reserve and fill blocks, expect (with a trailer) and begin ``tid``."""
    pb, db = pre.reserve(n), dec.reserve(n)
    pre.fill_random(pb, n, seed=seed)
    secret = rx.expect(tid, db, n, trailer=True)
    tx.begin(tid, rx.address, n, secret=secret)
    return pb, db


# ---- rule 1: corrupt or lost KV fails the transfer at once --------------------------------
@pytest.mark.parametrize("auth", list(AUTH))
def test_a_corrupt_frame_from_the_transfers_sender_fails_it_at_once(net, auth):
    tx, rx, pre, dec = pair(net, auth)
    pbad, dbad = start(tx, rx, pre, dec, "bad", seed=1)
    pgood, dgood = start(tx, rx, pre, dec, "good", seed=2)
    send_layers(tx, pre, pbad, "bad", 0, 8, [0])
    tx.inject("corrupt")  # the next data message goes out with its header cut short
    send_layers(tx, pre, pbad, "bad", 0, 8, [1])
    send_layers(tx, pre, pgood, "good", 0, 8)
    assert tx.end("good", {"first_token": 7})
    pump(tx, rx, until=lambda: tx.poll("bad") == F and rx.poll("bad") == F and tx.poll("good") == D)
    assert rx.error("bad").startswith("corrupt KV frame") and "corrupt KV frame" in tx.error("bad")
    assert rx.poll("good") == D and rx.take_trailer("good") == {"first_token": 7}
    assert_same(pre, pgood, dec, dgood, 0, 8)


class Flipping:
    """Wraps a transport; flips one K byte of the next data message, after its MAC was made."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, False

    def send(self, peer, frames):
        if self.armed and len(frames) == 4:
            self.armed = False
            k = bytearray(frames[1])
            k[0] ^= 0x01
            frames = [frames[0], k, *frames[2:]]
        self.inner.send(peer, frames)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_frame_whose_mac_fails_fails_the_transfer_at_once(net):
    tx, rx, pre, dec = pair(net, "full")  # "full": the MAC covers K and V
    tx.transport = Flipping(tx.transport)
    pb, db = start(tx, rx, pre, dec, "t")
    send_layers(tx, pre, pb, "t", 0, 8, [0])
    tx.transport.armed = True
    send_layers(tx, pre, pb, "t", 0, 8, [1])
    pump(tx, rx, until=lambda: tx.poll("t") == F and rx.poll("t") == F)
    assert rx.error("t") == "corrupt KV frame: its MAC does not match"
    assert rx.stats.forged == 0  # it came from the transfer's own sender: not a forgery


@pytest.mark.parametrize("auth", ["none", "header"])
def test_corrupt_frames_from_a_stranger_are_counted_and_change_nothing(net, auth):
    tx, rx, pre, dec = pair(net, auth)
    pb, db = start(tx, rx, pre, dec, "t")
    send_layers(tx, pre, pb, "t", 0, 8, [0])
    pump(tx, rx, until=lambda: rx.poll("t") == T)
    evil = net("sender", pre).transport  # reaches the receiver, never began "t"
    peer = evil.connect(rx.address)
    zeros = torch.zeros(8, HEADS, DIM)
    data = encode_frames("t", "fp-1", 1, 0, zeros, zeros, HEADS)
    cut = [bytes(data[0])[:-1], *data[1:]]  # names "t", does not decode
    mac = [b"m" * 16] if AUTH[auth] is not None else []
    evil.send(peer, [*cut, *mac])
    if AUTH[auth] is not None:
        evil.send(peer, [*data, b"m" * 16])  # decodes, MAC wrong
    pump(rx, until=lambda: rx.dropped_frames + rx.stats.forged == 1 + (AUTH[auth] is not None))
    assert rx.dropped_frames == 1 and rx.stats.forged == (AUTH[auth] is not None)
    assert rx.poll("t") == T
    send_layers(tx, pre, pb, "t", 0, 8, range(1, LAYERS))
    assert tx.end("t", {"first_token": 1})
    pump(tx, rx, until=lambda: tx.poll("t") == D and rx.poll("t") == D)
    assert_same(pre, pb, dec, db, 0, 8)


def test_a_frame_lost_in_transit_fails_the_transfer_when_its_end_arrives(net):
    tx, rx, pre, dec = pair(net)
    pb, db = start(tx, rx, pre, dec, "t")
    send_layers(tx, pre, pb, "t", 0, 8, [0])
    tx.inject("drop")  # layer 1 never leaves
    send_layers(tx, pre, pb, "t", 0, 8, range(1, LAYERS))
    pump(tx, rx, until=lambda: rx._transfers["t"].missing == HEADS)
    assert rx.poll("t") == T  # in order per peer: nothing can be said before the end
    assert tx.end("t", {"first_token": 1})
    pump(tx, rx, until=lambda: tx.poll("t") == F and rx.poll("t") == F)
    assert rx.error("t").startswith(f"{HEADS} KV cells never arrived")
    assert "never arrived" in tx.error("t")


def test_an_end_before_another_shard_began_is_no_loss(net):
    """Head shards: one sender's end judges only its own heads, not those of a sender that
    has not begun yet."""
    clock, dec = FakeClock(), Side(layout(8))
    s0, s1, full = Side(layout(4, heads=(0, 1))), Side(layout(2, heads=(1, 2))), Side(layout(4))
    t0, t1 = net("sender", s0, clock=clock), net("sender", s1, clock=clock)
    rx = net("receiver", dec, clock=clock)
    handshake(t0, rx), handshake(t1, rx)
    fb, b0, b1 = full.reserve(11), s0.reserve(11), s1.reserve(11)
    for side, blocks in ((full, fb), (s0, b0), (s1, b1)):
        side.fill_random(blocks, 11, seed=4)
    db = dec.reserve(11)
    rx.expect("x", db, 11, trailer=True)
    t0.begin("x", rx.address, 11)
    send_layers(t0, s0, b0, "x", 0, 11)
    assert t0.end("x", {"first_token": 3})
    pump(t0, rx, until=lambda: rx._transfers["x"].ended)
    assert rx.poll("x") == T  # head 1 is missing, but its sender has not begun
    t1.begin("x", rx.address, 11)
    send_layers(t1, s1, b1, "x", 0, 11)
    pump(t0, t1, rx, until=lambda: t0.poll("x") == D and t1.poll("x") == D and rx.poll("x") == D)
    assert_same(full, fb, dec, db, 0, 11)


def test_inject_lists_the_valid_faults(net):
    tx = net("sender", Side(layout(4)))
    with pytest.raises(ValueError, match="unknown KV fault 'melt'; valid: corrupt, drop, sever"):
        tx.inject("melt")
    assert CHAOS_FAULTS == ("corrupt", "drop", "sever")


# ---- rule 2: disconnect ----------------------------------------------------------------
def transport_tables_empty(tx: KVSender) -> bool:
    """No per-peer entry left in the sender's transport (the UCX thread catches up meanwhile)."""
    t = tx.transport
    if t.name == "zmq":
        return not t._dealers and not t._replies
    if t.name == "ucx":
        return len(t._peers) == 0 and not t.receiver._receiving
    return True


def test_disconnect_fails_live_transfers_at_once_and_forgets_the_receiver(net):
    tx, rx, pre, dec = pair(net)
    pb, db = start(tx, rx, pre, dec, "t")
    send_layers(tx, pre, pb, "t", 0, 8, [0])
    pump(tx, rx, until=lambda: rx.poll("t") == T)
    tx.disconnect(rx.address)
    assert tx.poll("t") == F and "disconnected" in tx.error("t")
    assert tx.links.get(rx.address) is None and not tx.links._hello
    pump(tx, rx, until=lambda: rx.poll("t") == F and transport_tables_empty(tx))  # told, or saw it close
    with pytest.raises(ValueError, match="connect"):
        tx.begin("u", rx.address, 4)
    tx.disconnect(rx.address)  # unknown now: a no-op
    handshake(tx, rx)  # a fresh connection and handshake
    pb, db = start(tx, rx, pre, dec, "u", seed=3)
    send_layers(tx, pre, pb, "u", 0, 8)
    assert tx.end("u", {"first_token": 1})
    pump(tx, rx, until=lambda: tx.poll("u") == D and rx.poll("u") == D)
    assert_same(pre, pb, dec, db, 0, 8)


def test_tables_stay_bounded_while_receivers_and_senders_come_and_go(net):
    pre = Side(layout(4), num_blocks=64)
    hub_side = Side(layout(8), num_blocks=64)
    tx, hub = net("sender", pre), net("receiver", hub_side)
    for i in range(6):
        dec = Side(layout(8))
        rx = net("receiver", dec)  # a decode worker that comes, serves one transfer, and goes
        handshake(tx, rx)
        pb, db = start(tx, rx, pre, dec, f"r{i}", seed=i)
        send_layers(tx, pre, pb, f"r{i}", 0, 8)
        assert tx.end(f"r{i}", {"first_token": i})
        pump(tx, rx, until=lambda: tx.poll(f"r{i}") == D)
        tx.disconnect(rx.address)  # the router retires it everywhere
        rx.close()
        pre.bm.free(pb)
        other = net("sender", Side(layout(4)))  # a prefill worker that comes and goes
        handshake(other, hub)
        other.close()
    pump(tx, hub, until=lambda: transport_tables_empty(tx))
    assert not tx.links._links and not tx.links._hello
    if hub.transport.name == "zmq":  # every sender's connection closed: nothing kept for them
        pump(hub, until=lambda: not hub.transport._fd_peer and not hub.transport._peer_fd)
        assert not hub.transport._replies
    if hub.transport.name == "ucx":
        assert not hub.transport.receiver._receiving  # heard peers are forgotten when idle: test_ucx_peers.py


def test_a_handshake_leaves_no_hello_entry_behind(net):
    tx, rx = net("sender", Side(layout(4))), net("receiver", Side(layout(8)))
    handshake(tx, rx)
    assert not tx.links._hello
    silent = net("receiver", Side(layout(8)))  # never progressed: no answer
    with pytest.raises(TimeoutError):
        tx.connect(silent.address, timeout_s=0.2)
    assert not tx.links._hello and tx.links.get(silent.address) is None


# ---- rule 3: a dropped connection fails what is in flight; the next begin reconnects ------
def test_a_severed_connection_fails_in_flight_transfers_and_begin_reconnects(net):
    tx, rx, pre, dec = pair(net)
    p1, d1 = start(tx, rx, pre, dec, "t1", seed=1)
    send_layers(tx, pre, p1, "t1", 0, 8, [0])
    pump(tx, rx, until=lambda: rx.poll("t1") == T)
    tx.inject("sever")
    assert not tx.send_layer("t1", 1, *pre.read(p1, 0, 8, 1))  # cut, as a reset would
    assert tx.poll("t1") == F and "severed" in tx.error("t1")
    assert tx.links.get(rx.address).state == "dropped"
    p2, d2 = start(tx, rx, pre, dec, "t2", seed=2)  # dials again; does not wait for the answer
    assert tx.links.get(rx.address).state == "connecting"
    send_layers(tx, pre, p2, "t2", 0, 8)
    assert tx.end("t2", {"first_token": 2})
    pump(tx, rx, until=lambda: tx.poll("t2") == D and rx.poll("t2") == D and rx.poll("t1") == F)
    # zmq and inproc saw the connection close; UCX is told on the next connection
    assert "dropped" in rx.error("t1")
    assert tx.links.get(rx.address).state == "ready"
    assert_same(pre, p2, dec, d2, 0, 8)


def test_connect_after_a_drop_handshakes_again(net):
    tx, rx, pre, dec = pair(net)
    p1, _ = start(tx, rx, pre, dec, "t1")
    tx.inject("sever")
    assert not tx.send_layer("t1", 0, *pre.read(p1, 0, 8, 0))
    assert handshake(tx, rx) == dec.layout  # blocks for the fresh handshake
    assert tx.links.get(rx.address).state == "ready" and not tx.links._hello
    p2, d2 = start(tx, rx, pre, dec, "t2", seed=5)
    send_layers(tx, pre, p2, "t2", 0, 8)
    assert tx.end("t2", {"first_token": 2})
    pump(tx, rx, until=lambda: tx.poll("t2") == D)
    assert_same(pre, p2, dec, d2, 0, 8)


def test_a_redial_that_nobody_answers_fails_at_the_reconnect_timeout(net):
    clock, pre, dec = FakeClock(), Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre, clock=clock), net("receiver", dec)
    handshake(tx, rx)
    p0, _ = start(tx, rx, pre, dec, "t0")
    tx.inject("sever")
    tx.send_layer("t0", 0, *pre.read(p0, 0, 8, 0))
    address = rx.address
    rx.close()  # the receiver goes away for good
    try:
        tx.begin("t1", address, 8)
    except ValueError as e:  # inproc knows at once that nothing is there any more
        assert "connect() again" in str(e)
        return
    clock.now = RECONNECT_TIMEOUT_S - 0.01
    tx.progress()
    assert tx.poll("t1") in (W, F)  # UCX may already know its endpoint cannot be made
    clock.now = RECONNECT_TIMEOUT_S
    pump(tx, until=lambda: tx.poll("t1") == F)
    assert "re-handshake" in tx.error("t1") or "dropped" in tx.error("t1")
    assert tx.links.get(address).state == "dropped" and not tx.links._hello


def test_receiver_restarted_on_the_same_address_fails_in_flight_and_is_reached_again():
    """zmq over tcp on a fixed port (a UCX address names one process: it cannot come back)."""
    clock, pre = FakeClock(), Side(layout(4))
    first_side, second_side = Side(layout(8)), Side(layout(8))
    tx = KVSender(ZmqTransport(), pre.layout, clock=clock)
    first = KVReceiver(ZmqTransport(), first_side.layout, first_side.kv, clock=clock)
    second = None
    try:
        handshake(tx, first)
        p1, _ = start(tx, first, pre, first_side, "t1")
        send_layers(tx, pre, p1, "t1", 0, 8, [0])
        pump(tx, first, until=lambda: first.poll("t1") == T)
        first.close()  # the decode worker dies...
        pump(tx, until=lambda: tx.poll("t1") == F)
        assert "dropped" in tx.error("t1")
        port = int(first.address.rsplit(":", 1)[1])
        second = KVReceiver(ZmqTransport(port=port), second_side.layout, second_side.kv, clock=clock)
        assert second.address == first.address  # ...and comes back where it was
        p2, d2 = start(tx, second, pre, second_side, "t2", seed=9)
        send_layers(tx, pre, p2, "t2", 0, 8)
        assert tx.end("t2", {"first_token": 9})
        pump(tx, second, until=lambda: tx.poll("t2") == D and second.poll("t2") == D)
        assert_same(pre, p2, second_side, d2, 0, 8)
    finally:
        for side in (tx, first, second):
            if side is not None:
                side.close()


def test_a_receiver_back_with_another_model_is_refused_when_begin_dials_again():
    clock, pre = FakeClock(), Side(layout(4))
    first_side, other_side = Side(layout(8)), Side(layout(8, fp="another-model"))
    tx = KVSender(ZmqTransport(), pre.layout, clock=clock)
    first = KVReceiver(ZmqTransport(), first_side.layout, first_side.kv, clock=clock)
    other = None
    try:
        handshake(tx, first)
        first.close()
        pump(tx, until=lambda: tx.links.get(first.address).state == "dropped")
        port = int(first.address.rsplit(":", 1)[1])
        other = KVReceiver(ZmqTransport(port=port), other_side.layout, other_side.kv, clock=clock)
        other.expect("t", other_side.reserve(8), 8)
        tx.begin("t", first.address, 8)  # dials again and sends at once...
        pump(tx, other, until=lambda: tx.poll("t") == F)  # ...and the answer shows another model
        assert "different model" in tx.error("t")
        assert tx.links.get(first.address) is None and not tx.links._hello
        pump(tx, other, until=lambda: other.poll("t") == F)  # the connection it closed tells the receiver
    finally:
        for side in (tx, first, other):
            if side is not None:
                side.close()
