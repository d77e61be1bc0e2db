"""Size limits on the KV sockets before anything is allocated (issue 42): an oversized frame
or announcement is refused, unallocated, and the receiver goes on serving other peers; a
keyed UCX transport takes only sealed headers; a peer's messages in flight are capped."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import

import time
from collections import deque
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch
import zmq

from kvtransfer.base import KVLayout
from kvtransfer.receiver import KVReceiver, max_frame_bytes
from kvtransfer.zmq_transport import ZmqTransport


def _recv(t, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while (msg := t.recv()) is None:
        assert time.monotonic() < end, "no message arrived"
        time.sleep(0.001)
    return msg


def test_zmq_refuses_a_frame_above_its_limit_and_serves_the_others():
    server, good = ZmqTransport(), ZmqTransport()
    server.limit_frames(1024)
    address = server.bind()
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        rogue.connect(address)
        rogue.send_multipart([b"h", b"\0" * 4096])  # refused as its length arrives: connection cut
        good.send(good.connect(address), [b"h", b"\1" * 1024])
        peer, frames = _recv(server)
        assert [bytes(f) for f in frames] == [b"h", b"\1" * 1024]
        time.sleep(0.1)
        assert server.recv() is None  # the oversized one never arrives
    finally:
        rogue.close()
        good.close()
        server.close()


def test_a_receiver_limits_its_transport_to_what_its_cache_holds():
    layout = KVLayout("f", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    caches = [(torch.zeros(32, 2, 4), torch.zeros(32, 2, 4)) for _ in range(2)]
    t = ZmqTransport()
    rx = KVReceiver(t, layout, caches)
    try:
        assert t.max_frame_bytes == max_frame_bytes(layout, caches) == 32 * 2 * 4 * 4
    finally:
        rx.close()


# ---- UCX ---------------------------------------------------------------------------------
def test_ucx_admits_a_peers_frames_only_within_its_in_flight_budget():
    """The receive side's bookkeeping alone (no UCX): messages wait, unallocated, in order, until
    the peer's messages on their way leave room; a larger one goes alone."""
    pytest.importorskip("ucxx")
    from kvtransfer.ucx.recv import ReceiveSide, _Incoming
    side = ReceiveSide(list, None, None, 0, lambda m: None, lambda uid, why: None)
    side.peer_inflight_bytes = 100
    posted = []
    side._post_frames = lambda uid, m: (posted.append(m.nbytes), setattr(m, "pending", None),
                                        setattr(m, "posted", True))
    queue = deque(_Incoming(None, None, frames=[], nbytes=n, pending=("tag", [n], "h")) for n in (60, 30, 50, 500))
    side._admit(1, queue)
    assert posted == [60, 30]  # 50 more would pass 100: it waits, and so does what follows
    queue.popleft()  # the first delivered
    side._admit(1, queue)
    assert posted == [60, 30, 50]
    queue.popleft(), queue.popleft()
    side._admit(1, queue)
    assert posted == [60, 30, 50, 500]  # larger than the budget: alone


def _raw_sender(address: str):
    import ucxx._lib.libucxx as ucx_api

    from kvtransfer.ucx import wire as ucx_wire
    ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
    worker = ucx_api.UCXWorker(ctx)
    _, addr, _, _ = ucx_wire.parse_address(address)
    ep = worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(addr),
                                                    endpoint_error_handling=False)
    return SimpleNamespace(ctx=ctx, worker=worker, ep=ep)


def _send_header(raw, uid: int, header: bytes) -> None:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    from kvtransfer.ucx import wire as ucx_wire
    buf = np.frombuffer(header, np.uint8)
    req = raw.ep.tag_send(Array(buf), ucx_api.UCXXTag(ucx_wire.tag(ucx_wire.HEADER, uid, 0)))
    while not req.completed:
        raw.worker.progress()
    req.check_error()


@pytest.mark.parametrize("case", ["unsealed", "wrong-key", "over-limit"])
def test_ucx_refuses_a_bad_or_oversized_header_before_allocating(case):
    pytest.importorskip("ucxx")
    from kvtransfer.ucx import wire as ucx_wire
    from kvtransfer.ucx import UcxTransport
    key = b"k" * 32
    server, good = UcxTransport(key=key), UcxTransport(key=key)
    server.limit_frames(1 << 20)
    address = server.bind()
    raw = _raw_sender(address)
    try:
        bogus = 0x0BAD0BAD
        lengths = [2 << 20] if case == "over-limit" else [1 << 20]
        header = msgpack.packb([1, 0, lengths, raw.worker.address.tobytes()])
        sealed = {"unsealed": header, "wrong-key": ucx_wire.seal_header(b"x" * 32, bogus, header),
                  "over-limit": ucx_wire.seal_header(key, bogus, header)}[case]
        pool_before = server.receiver._pool.bytes
        _send_header(raw, bogus, sealed)
        good.send(good.connect(address), [b"fine"])
        sender, frames = _recv(server)
        assert sender == f"{good.uid:08x}" and bytes(frames[0]) == b"fine"
        time.sleep(0.05)
        assert server.recv() is None
        assert bogus in server.receiver._banned and server.refused == 1 and server.receiver._pool.bytes == pool_before
    finally:
        raw.ep.close()
        good.close()
        server.close()


def test_ucx_keyed_peers_move_messages_through_a_small_budget_in_order():
    pytest.importorskip("ucxx")
    from kvtransfer.ucx import UcxTransport
    key = b"k" * 32
    server, client = UcxTransport(key=key), UcxTransport(key=key)
    server.peer_inflight_bytes = 256 << 10
    try:
        peer = client.connect(server.bind())
        sent = [bytes([i]) * (200 << 10) for i in range(8)]
        for m in sent:
            client.send(peer, [m])
        got = [bytes(_recv(server)[1][0]) for _ in sent]
        assert got == sent and server.refused == 0
    finally:
        client.close()
        server.close()
