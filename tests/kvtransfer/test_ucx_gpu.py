"""UCX GPU path: device frames sent from and received into CUDA memory, and the CPU-side rules.

The tests marked ``needs_cuda`` move device frames (one process, two processes, and a KV
transfer into a CUDA cache); they are skipped where torch sees no GPU. The others run
everywhere: old (host-only) headers, device frames refused by a side without CUDA, and the
"checksum 0" rule of the wire format. The two-process test runs this file as a script (the
child half is at the end).
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

if __name__ != "__main__":  # the child process does not need pytest's skip
    pytest.importorskip("ucxx", reason="ucxx (pip ucxx-cu12) is not importable: no UCX transport here")
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import xxhash  # noqa: E402

from kvtransfer.ucx import device as ucx_device, transport as ucx, wire as ucx_wire  # noqa: E402
from kvtransfer.base import KVLayout, TransferState  # noqa: E402
from kvtransfer.format import FrameError, decode_frames, encode_frames, gather_layer  # noqa: E402
from kvtransfer.receiver import KVReceiver  # noqa: E402
from kvtransfer.sender import KVSender  # noqa: E402
from kvtransfer.ucx import UcxTransport  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (UCX cuda_ipc path)")
NUM_MSGS, MSG_BYTES = 6, 8 << 20


@pytest.fixture
def make() -> Iterator[Callable[..., UcxTransport]]:
    """Builds transports; closes them all after the test and checks no thread is left."""
    built: list[UcxTransport] = []

    def factory(**kwargs) -> UcxTransport:
        t = UcxTransport(**kwargs)
        built.append(t)
        return t

    yield factory
    for t in built:
        t.close()
    assert not [t for t in threading.enumerate() if t.name == "ucx-progress"]


def recv_wait(t: UcxTransport, timeout: float = 10.0) -> tuple[str, list]:
    end = time.monotonic() + timeout
    while (msg := t.recv()) is None:
        assert time.monotonic() < end, "no message arrived"
        time.sleep(0.0002)
    return msg


class _RawPeer:
    """A bare UCX worker that writes wire headers by hand (an old or a misbehaving peer)."""

    def __init__(self, address: str, uid: int) -> None:
        import ucxx._lib.libucxx as ucx_api

        self.api, self.uid = ucx_api, uid
        self.ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
        self.worker = ucx_api.UCXWorker(self.ctx)
        _, addr, _, _ = ucx_wire.parse_address(address)
        self.ep = self.worker.create_endpoint_from_worker_address(
            ucx_api.UCXAddress.create_from_buffer(addr), endpoint_error_handling=False)

    def send(self, header: list, frames: list[bytes] = ()) -> None:
        from ucxx._lib.arr import Array

        seq = header[1]
        bufs = [np.frombuffer(msgpack.packb(header), np.uint8)] + [np.frombuffer(f, np.uint8) for f in frames]
        kinds = [ucx_wire.HEADER] + [ucx_wire.DATA] * len(frames)
        reqs = [self.ep.tag_send(Array(b), self.api.UCXXTag(ucx_wire.tag(k, self.uid, seq)))
                for b, k in zip(bufs, kinds)]
        while not all(r.completed for r in reqs):
            self.worker.progress()
        for r in reqs:
            r.check_error()

    def close(self) -> None:
        self.ep.close()
        del self.ep, self.worker, self.ctx


# ---- CPU-runnable: wire compatibility and refusals ---------------------------------------
def test_header_from_an_old_peer_is_read_as_all_host(make):
    server = make()
    raw = _RawPeer(server.bind(), uid=0x0123ABCD)
    try:
        address_of_raw = raw.worker.address.tobytes()
        raw.send([1, 0, [5, 0, 3], address_of_raw], [b"hello", b"abc"])  # 4 fields: no kinds
        raw.send([1, 1, [2], None, "h"], [b"ok"])  # explicit kinds, all host
        for want in ([b"hello", b"", b"abc"], [b"ok"]):
            sender, frames = recv_wait(server)
            assert sender == "0123abcd"
            assert all(isinstance(f, memoryview) for f in frames)
            assert [bytes(f) for f in frames] == want
        assert server.refused_device == 0 and not server.receiver._banned
    finally:
        raw.close()


def test_host_only_messages_keep_the_old_four_field_header():
    assert msgpack.unpackb(ucx_wire.pack_header(3, [4, 0], "hh", None)) == [1, 3, [4, 0], None]
    assert msgpack.unpackb(ucx_wire.pack_header(3, [4, 8], "hd", None)) == [1, 3, [4, 8], None, "hd"]


def test_device_frames_at_a_side_without_cuda_are_dropped_and_counted(make, monkeypatch):
    server = make()
    server.device, server.device_frames = None, False  # as on a machine without CUDA
    def no_alloc(*args):
        raise AssertionError("allocated device buffers on a side without CUDA")
    monkeypatch.setattr(ucx_device, "alloc_frames", no_alloc)
    pool_before = server.receiver._pool.bytes
    raw = _RawPeer(server.bind(), uid=0x0D0D0D0D)
    try:
        # Announces 1 GiB of device memory (never sent): refused before anything is allocated.
        raw.send([1, 0, [16, 1 << 30], raw.worker.address.tobytes(), "hd"])
        raw.send([1, 1, [4], None], [b"next"])  # the peer is not banned: host traffic goes on
        sender, frames = recv_wait(server)
        assert sender == "0d0d0d0d" and [bytes(f) for f in frames] == [b"next"]
        assert server.refused_device == 1 and not server.receiver._banned
        assert server.receiver._pool.bytes == pool_before
        assert server.recv() is None
    finally:
        raw.close()


@pytest.mark.parametrize("kinds", ["x", "h", "hdd", 7])
def test_bad_memory_type_list_bans_the_peer(make, kinds):
    server, good = make(), make()
    raw = _RawPeer(server.bind(), uid=0x0BAD0BAD)
    try:
        raw.send([1, 0, [4, 4], raw.worker.address.tobytes(), kinds])
        good.send(good.connect(server.bind()), [b"fine"])
        _, frames = recv_wait(server)
        assert bytes(frames[0]) == b"fine"
        end = time.monotonic() + 5
        while 0x0BAD0BAD not in server.receiver._banned:
            assert time.monotonic() < end
            time.sleep(0.001)
    finally:
        raw.close()


def test_device_frame_refused_at_send_without_cuda(make):
    class FakeDeviceArray:  # looks like GPU memory to the transport
        __cuda_array_interface__ = {"shape": (8,), "typestr": "|u1", "data": (0, False), "version": 3}

    client = make()
    client.device, client.device_frames = None, False
    peer = client.connect(make().bind())
    with pytest.raises(ValueError, match="no CUDA"):
        client.send(peer, [b"hdr", FakeDeviceArray()])


def test_tls_without_cuda_disables_device_frames(make):
    assert not make(tls="tcp").device_frames
    assert ucx_device.tls_allows_cuda("all") and ucx_device.tls_allows_cuda("sm,cuda_copy,cuda_ipc")
    assert not ucx_device.tls_allows_cuda("^cuda_ipc") and ucx_device.tls_allows_cuda("^tcp")
    with pytest.raises(ValueError):
        make(device="cpu")


def test_checksum_zero_is_refused_for_host_payloads():
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    header, kb, vb = encode_frames("tx", "fp", 0, 0, k, v, num_kv_heads=2, keep_on_device=True)  # CPU: host path
    fields = msgpack.unpackb(header)
    assert fields[-1] != 0 and isinstance(kb, memoryview)
    fields[-1] = 0
    with pytest.raises(FrameError, match="only for payloads in GPU memory"):
        decode_frames([msgpack.packb(fields), kb, vb])


def test_device_payloads_skip_checksum_zero_and_decode_in_place():
    """The device branch of the format, on torch's "meta" device (no memory, no GPU)."""
    k = torch.empty(3, 2, 4, dtype=torch.bfloat16, device="meta")
    header, kb, vb = encode_frames("tx", "fp", 1, 5, k, k, num_kv_heads=2, keep_on_device=True)
    assert msgpack.unpackb(header)[-1] == 0  # "not checksummed"
    assert kb.device.type == "meta" and kb.dtype == torch.uint8 and kb.shape == (3 * 2 * 4 * 2,)
    h, dk, dv = decode_frames([header, kb, vb], fingerprint="fp")
    assert (h.layer, h.token_start, h.checksum) == (1, 5, 0)
    assert dk.device.type == "meta" and dk.dtype == torch.bfloat16 and dk.shape == (3, 2, 4)
    with pytest.raises(FrameError, match="bytes"):
        decode_frames([header, kb[1:], vb])
    with pytest.raises(FrameError, match="uint8"):
        decode_frames([header, k, vb])


# ---- CUDA: device frames end to end --------------------------------------------------------
@needs_cuda
def test_device_round_trip_in_one_process(make):
    server, client = make(), make()
    assert server.device_frames and client.device_frames
    peer = client.connect(server.bind())
    g = torch.Generator(device="cuda").manual_seed(0)
    sent = []
    for i in range(NUM_MSGS):
        blob = torch.randint(0, 256, (MSG_BYTES,), dtype=torch.uint8, device="cuda", generator=g)
        floats = torch.randn(1000 + i, device="cuda", generator=g)  # any dtype goes as its bytes
        msg = [msgpack.packb(i), blob, floats, b"", torch.empty(0, device="cuda")]
        sent.append(msg)
        client.send(peer, msg)
    for i, msg in enumerate(sent):
        sender, frames = recv_wait(server, timeout=30)
        assert sender == f"{client.uid:08x}" and len(frames) == 5
        assert msgpack.unpackb(bytes(frames[0])) == i and bytes(frames[3]) == b""
        for got, want in ((frames[1], msg[1]), (frames[2], msg[2]), (frames[4], msg[4])):
            assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8
            assert str(got.device) == server.device
            assert torch.equal(got, want.reshape(-1).view(torch.uint8).to(got.device))


@needs_cuda
def test_device_frames_to_another_process(make):
    """A child process receives device frames into its GPU and replies with their xxh3."""
    parent = make()
    child = subprocess.Popen([sys.executable, __file__, parent.bind()], stdout=subprocess.PIPE, text=True)
    try:
        child_id, _ = recv_wait(parent, timeout=60)
        g = torch.Generator(device="cuda").manual_seed(1)
        blobs = [torch.randint(0, 256, (MSG_BYTES,), dtype=torch.uint8, device="cuda", generator=g)
                 for _ in range(NUM_MSGS)]
        for i, blob in enumerate(blobs):
            parent.send(child_id, [msgpack.packb(i), blob[: MSG_BYTES // 2], blob[MSG_BYTES // 2:]])
        _, (digests,) = recv_wait(parent, timeout=60)
        assert msgpack.unpackb(digests) == [xxhash.xxh3_64_intdigest(b.cpu().numpy()) for b in blobs]
        parent.send(child_id, [b"bye"])
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@needs_cuda
def test_kv_transfer_from_cuda_cache_into_cuda_cache_is_bitwise(make):
    layers, heads, dim, bs, tokens = 3, 4, 16, 8, 29
    layout = KVLayout("fp-gpu", layers, heads, dim, block_size=bs, dtype="bfloat16")
    g = torch.Generator(device="cuda").manual_seed(2)
    src = [tuple(torch.randn(8 * bs, heads, dim, device="cuda", generator=g).bfloat16() for _ in "kv")
           for _ in range(layers)]
    dst = [tuple(torch.zeros(6 * bs, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
           for _ in range(layers)]
    src_blocks, dst_blocks = [5, 0, 7, 2], [1, 4, 0, 3]
    rx = KVReceiver(make(), layout, dst)
    tx = KVSender(make(), layout)
    try:
        done = threading.Event()

        def pump_rx() -> None:
            while not done.is_set():
                rx.progress()
                time.sleep(0.0005)

        pumper = threading.Thread(target=pump_rx, daemon=True)
        pumper.start()
        tx.connect(rx.address, timeout_s=30)
        done.set()
        pumper.join()
        rx.expect("t1", dst_blocks, tokens)
        tx.begin("t1", rx.address, tokens)
        for layer in range(layers):
            k, v = gather_layer(src[layer], src_blocks, bs, 0, tokens)
            assert tx.send_layer("t1", layer, k, v)
        end = time.monotonic() + 30
        while rx.poll("t1") is not TransferState.DONE or tx.poll("t1") is not TransferState.DONE:
            assert time.monotonic() < end, (rx.poll("t1"), rx.error("t1"), tx.poll("t1"))
            rx.progress()
            tx.progress()
            time.sleep(0.0005)
        for layer in range(layers):
            want = gather_layer(src[layer], src_blocks, bs, 0, tokens)
            got = gather_layer(dst[layer], dst_blocks, bs, 0, tokens)
            for a, b in zip(want, got):
                assert b.is_cuda and torch.equal(a.view(torch.int16), b.view(torch.int16))
    finally:
        tx.close()
        rx.close()


def _child(parent_address: str) -> None:
    t = UcxTransport()
    try:
        parent = t.connect(parent_address)
        t.send(parent, [t.bind().encode()])
        digests: list[int] = []
        while True:
            msg = t.recv()
            if msg is None:
                time.sleep(0.0002)
                continue
            frames = msg[1]
            if len(frames) == 1 and bytes(frames[0]) == b"bye":
                return
            assert all(isinstance(f, torch.Tensor) and f.is_cuda for f in frames[1:])
            h = xxhash.xxh3_64()
            for f in frames[1:]:
                h.update(f.cpu().numpy())
            digests.append(h.intdigest())
            if len(digests) == NUM_MSGS:
                t.send(parent, [msgpack.packb(digests)])
    finally:
        t.close()


if __name__ == "__main__":
    _child(sys.argv[1])
