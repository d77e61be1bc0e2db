"""The KV plane authenticated (kvtransfer.auth), over every transport: forged, replayed and
garbage messages from a stranger on the network are dropped and counted, change nothing and
get no answer, while a real transfer beside them completes bitwise-identical."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.auth import MAC_BYTES, PlaneAuth, mac, new_secret
from kvtransfer.format import FORMAT_VERSION, MAX_FRAME_TOKENS, FrameHeader, encode_frames
from kvtransfer.receiver import encode_control
from tests.kvtransfer.test_lifecycle import (  # noqa: F401  (net is a fixture)
    DIM, HEADS, LAYERS, D, F, Side, assert_same, handshake, layout, net, pump, send_layers)

KEY = new_secret()


@pytest.mark.parametrize("integrity", ["full", "header"])
def test_forged_messages_change_nothing_while_a_real_transfer_completes(net, integrity):
    auth = PlaneAuth(KEY, integrity)
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre, auth=auth), net("receiver", dec, auth=auth)
    evil = net("sender", pre).transport  # a stranger who reaches the receiver's endpoint
    handshake(tx, rx)
    pb, db = pre.reserve(8), dec.reserve(8)
    pre.fill_random(pb, 8, seed=11)
    secret = rx.expect("t", db, 8, trailer=True)
    assert secret and len(secret) == 32
    tx.begin("t", rx.address, 8, secret=secret)
    send_layers(tx, pre, pb, "t", 0, 8, [0, 1])
    pump(tx, rx, until=lambda: rx.stats.bytes > 0)

    peer = evil.connect(rx.address)
    zeros = torch.zeros(8, HEADS, DIM)
    data = encode_frames("t", "fp-1", 2, 0, zeros, zeros, HEADS)  # would zero layer 2
    other = PlaneAuth(new_secret(), integrity)  # another cluster's key
    huge = FrameHeader(FORMAT_VERSION, "t", "fp-1", 2, 0, MAX_FRAME_TOKENS, "float32", HEADS, 0, HEADS, DIM,
                       0).encode()
    attacks = [
        data,  # no MAC at all
        other.seal(data, new_secret()),  # a MAC under keys of no use here
        auth.seal(data),  # the cluster key alone does not write data: the transfer's secret does
        auth.seal(data, new_secret()),  # replayed from an earlier transfer of the same id
        [*data, _flipped(auth.seal(data, secret)[-1])],  # the right tag, one bit off
        encode_control("fail", id="t", reason="forged"),
        other.seal(encode_control("renew", id="t")),
        encode_control("hello", layout={}),
        auth.seal(encode_control("end", id="t", trailer={"first_token": 666})),  # end needs the secret
        [b"\x93garbage control"],
        [huge, b"", b"", b"x" * MAC_BYTES],  # refused before its size means anything
    ]
    for a in attacks:
        evil.send(peer, a)
    pump(rx, until=lambda: rx.stats.forged == len(attacks))
    send_layers(tx, pre, pb, "t", 0, 8, [2, 3])
    assert tx.end("t", {"first_token": 42})
    pump(tx, rx, until=lambda: tx.poll("t") == D and rx.poll("t") == D)
    assert rx.take_trailer("t") == {"first_token": 42}
    assert_same(pre, pb, dec, db, 0, 8)  # layer 2 is the sender's, not zeros
    assert rx.stats.forged == len(attacks) and tx.stats.forged == 0
    assert evil.recv() is None  # no hello_ok, no fail: a stranger learns nothing


def _flipped(tag: bytes) -> bytes:
    return tag[:-1] + bytes([tag[-1] ^ 1])


def test_a_sender_without_the_key_cannot_even_handshake(net):
    pre, dec = Side(layout(4)), Side(layout(8))
    rx = net("receiver", dec, auth=PlaneAuth(KEY))
    stranger = net("sender", pre, auth=PlaneAuth(new_secret()))
    with pytest.raises(TimeoutError):
        handshake(stranger, rx, timeout_s=0.5)
    plain = net("sender", pre)
    with pytest.raises(TimeoutError):
        handshake(plain, rx, timeout_s=0.5)
    assert rx.stats.forged >= 2


def test_an_authenticated_sender_needs_the_transfer_secret(net):
    pre, dec = Side(layout(4)), Side(layout(8))
    tx, rx = net("sender", pre, auth=PlaneAuth(KEY)), net("receiver", dec, auth=PlaneAuth(KEY))
    handshake(tx, rx)
    rx.expect("t", dec.reserve(4), 4)
    with pytest.raises(ValueError, match="needs the transfer's secret"):
        tx.begin("t", rx.address, 4)
    tx.begin("t", rx.address, 4, secret=new_secret())  # a wrong one: its frames are refused
    pb = pre.reserve(4)
    send_layers(tx, pre, pb, "t", 0, 4)
    # Nothing is written. The begin (cluster key) made it a peer of the transfer, so its bad MAC
    # fails the transfer at once rather than at the lease: a worker of the cluster can fail a
    # transfer anyway (a fail message needs only the cluster key), a stranger cannot.
    pump(tx, rx, until=lambda: rx.poll("t") == F and tx.poll("t") == F)
    assert rx.stats.bytes == 0 and "corrupt KV frame: its MAC does not match" in rx.error("t")
    assert "corrupt KV frame" in tx.error("t")


def test_mac_frames_follow_the_integrity_setting():
    frames = [b"header", b"K" * 64, b"V" * 64]
    full, header = PlaneAuth(KEY, "full"), PlaneAuth(KEY, "header")
    assert full.seal(frames)[-1] == mac(KEY, frames)
    assert header.seal(frames)[-1] == mac(KEY, frames[:1])
    tampered = [frames[0], b"X" + frames[1][1:], frames[2]]
    tag = full.seal(frames)[-1]
    assert full.valid(frames, tag) and not full.valid(tampered, tag)
    assert header.valid(tampered, header.seal(frames)[-1])  # header integrity: bytes trusted to the transport
    with pytest.raises(ValueError):
        PlaneAuth(b"short")
    with pytest.raises(ValueError):
        PlaneAuth(KEY, "none")
