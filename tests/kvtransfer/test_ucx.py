"""UCX transport: messages intact and in order, replies, buffer reuse, bad peers, two processes.

Loopback only. Every transport is closed after its test, and no "ucx-progress" thread may be
left running. The two-process test runs this file as a script (the child half is at the end).
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

if __name__ != "__main__":  # the child process does not need pytest's skip
    pytest.importorskip("ucxx", reason="ucxx (pip ucxx-cu12) is not importable: no UCX transport here")
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import xxhash  # noqa: E402

from kvtransfer.ucx import transport as ucx, wire as ucx_wire  # noqa: E402
from kvtransfer.base import TRANSPORTS, _load_builtin  # noqa: E402
from kvtransfer.ucx import UcxTransport  # noqa: E402

MSG_BYTES, NUM_MSGS = 32 << 20, 8  # the two-process test moves 256 MiB


def progress_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ucx-progress"]


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
    left = progress_threads()
    frames = sys._current_frames()
    assert not left, "a ucx progress thread outlived close(); where each is:\n" + "\n".join(
        "".join(traceback.format_stack(frames[t.ident])) for t in left if t.ident in frames)


def recv_wait(t: UcxTransport, timeout: float = 10.0) -> tuple[str, list[memoryview]]:
    end = time.monotonic() + timeout
    while (msg := t.recv()) is None:
        assert time.monotonic() < end, "no message arrived"
        time.sleep(0.0002)
    return msg


DROP_UNKNOWN = "not a known peer: never connected, disconnected, or forgotten when idle"


def wait_dropped(t: UcxTransport, timeout: float = 10.0) -> list[tuple[str, str]]:
    """The next drop reports of ``t`` (its recv turns drop marks into them)."""
    end = time.monotonic() + timeout
    while True:
        assert t.recv() is None, "a message where a drop was expected"
        if got := t.dropped():
            return got
        assert time.monotonic() < end, "no drop reported"
        time.sleep(0.0005)


def test_registered_as_ucx():
    _load_builtin()
    assert TRANSPORTS["ucx"] is UcxTransport


def test_round_trip_multi_buffer_in_order(make):
    server, client = make(), make()
    address = server.bind()
    assert address.startswith("ucx://") and server.bind() == address
    peer = client.connect(address)
    big = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    floats = np.arange(1000, dtype=np.float32)  # a non-byte buffer format goes as its bytes
    sent = [
        [b"first", bytearray(b"\x00\x01"), b""],
        [b"big", memoryview(big), memoryview(floats)],
        *([i.to_bytes(4, "little"), os.urandom(100_000 + i)] for i in range(20)),
    ]
    for frames in sent:
        client.send(peer, frames)
    for frames in sent:
        sender, got = recv_wait(server, timeout=15)
        assert sender == f"{client.uid:08x}"
        assert all(isinstance(f, memoryview) and f.format == "B" and not f.readonly for f in got)
        assert [bytes(f) for f in got] == [bytes(memoryview(f).cast("B")) for f in frames]
    assert server.recv() is None


def test_replies_reach_the_right_peer(make):
    server, a, b = make(), make(), make()
    address = server.bind()
    pa, pb = a.connect(address), b.connect(address)
    assert pa == pb  # both name the server by its uid
    for i in range(10):  # interleaved, so replies must be routed by peer, not by order
        a.send(pa, [b"a", bytes([i])])
        b.send(pb, [b"b", bytes([i])])
    seen: dict[bytes, list[int]] = {b"a": [], b"b": []}
    ids: dict[bytes, str] = {}
    for _ in range(20):
        sender, frames = recv_wait(server)
        name = bytes(frames[0])
        seen[name].append(frames[1][0])
        assert ids.setdefault(name, sender) == sender
    assert seen == {b"a": list(range(10)), b"b": list(range(10))}
    assert ids[b"a"] != ids[b"b"]
    assert ids[b"a"] == f"{a.uid:08x}" and ids[b"b"] == f"{b.uid:08x}"
    server.send(ids[b"b"], [b"to-b", b"x" * 200_000])
    server.send(ids[b"a"], [b"to-a"])
    sender, frames = recv_wait(a)
    assert (sender, [bytes(f) for f in frames]) == (pa, [b"to-a"])
    sender, frames = recv_wait(b)
    assert (sender, [bytes(f) for f in frames]) == (pb, [b"to-b", b"x" * 200_000])
    time.sleep(0.05)
    assert a.recv() is None and b.recv() is None


def test_recv_none_when_empty(make):
    server, client = make(), make()
    assert server.recv() is None and client.recv() is None
    peer = client.connect(server.bind())
    time.sleep(0.02)
    assert server.recv() is None
    client.send(peer, [b"one"])
    recv_wait(server)
    assert server.recv() is None and client.recv() is None


def test_close_twice_is_safe_and_stops_the_thread(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    client.send(peer, [b"x" * 1_000_000])
    recv_wait(server)
    for t in (server, client):
        t.close()
        t.close()
        assert not t._thread.is_alive()
        assert t.recv() is None
    with pytest.raises(RuntimeError, match="closed"):
        client.send(peer, [b"late"])
    with pytest.raises(RuntimeError, match="closed"):
        client.bind()


def test_bad_input_is_rejected(make):
    t = make()
    for bad in ("tcp://127.0.0.1:5555", "ucx://zz/AAAA", "ucx://1234", "ucx://1234/"):
        with pytest.raises(ValueError, match="not a ucx address"):
            t.connect(bad)
    with pytest.raises(ValueError, match="unknown ucx peer"):
        t.send("not-hex", [b"x"])
    t.send("deadbeef", [b"x"])  # well formed but never connected: dropped and reported, no error
    assert wait_dropped(t) == [("deadbeef", DROP_UNKNOWN)] and t.unroutable == 1
    peer = t.connect(make().bind())
    strided = memoryview(bytearray(100))[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        t.send(peer, [strided])
    with pytest.raises(ValueError, match="host buffers"):
        t.send(peer, [12345])


def test_received_buffers_are_reused_only_once_released(make):
    server, client = make(), make()
    peer = client.connect(server.bind())
    n = 1 << 20
    client.send(peer, [b"\x01" * n])
    _, (held,) = recv_wait(server)
    client.send(peer, [b"\x02" * n])
    _, (second,) = recv_wait(server)
    held_addr = np.frombuffer(held, np.uint8).ctypes.data
    assert np.frombuffer(second, np.uint8).ctypes.data != held_addr  # `held` is still in use
    del second
    client.send(peer, [b"\x03" * n])
    _, (third,) = recv_wait(server)
    assert bytes(held) == b"\x01" * n and bytes(third) == b"\x03" * n
    del held
    client.send(peer, [b"\x04" * n])
    _, (fourth,) = recv_wait(server)
    assert bytes(fourth) == b"\x04" * n and bytes(third) == b"\x03" * n
    assert np.frombuffer(fourth, np.uint8).ctypes.data == held_addr  # released: reused


@pytest.mark.parametrize("lengths", [[ucx_wire.MAX_FRAME_BYTES + 1], [ucx_wire.MAX_FRAME_BYTES] * 1024],
                         ids=["one-huge-frame", "huge-in-all"])
def test_oversized_announcement_is_refused(make, lengths):
    """A peer announcing a frame above MAX_FRAME_BYTES, or more than MAX_MESSAGE_BYTES in all,
    is ignored before anything is allocated; others are unaffected."""
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    server, good = make(), make()
    address = server.bind()
    ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG,))
    worker = ucx_api.UCXWorker(ctx)
    uid, addr, _, _ = ucx_wire.parse_address(address)
    ep = worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(addr),
                                                    endpoint_error_handling=False)
    bogus_uid = 0x0BAD0BAD
    header = np.frombuffer(msgpack.packb([1, 0, lengths, worker.address.tobytes()]), np.uint8)
    req = ep.tag_send(Array(header), ucx_api.UCXXTag(ucx_wire.tag(ucx_wire.HEADER, bogus_uid, 0)))
    while not req.completed:
        worker.progress()
    req.check_error()
    good.send(good.connect(address), [b"fine"])
    sender, frames = recv_wait(server)
    assert sender == f"{good.uid:08x}" and bytes(frames[0]) == b"fine"
    time.sleep(0.05)
    assert server.recv() is None
    assert bogus_uid in server.receiver._banned
    ep.close()
    del ep, worker, ctx


def test_tls_option_is_passed_to_ucx(make):
    server, client = make(tls="tcp"), make(tls="tcp")
    assert client._gen.ctx.config["TLS"] == "tcp"
    payload = os.urandom(4 << 20)
    client.send(client.connect(server.bind()), [payload])
    _, frames = recv_wait(server, timeout=15)
    assert bytes(frames[0]) == payload


def test_progress_thread_runs_on_the_cores_it_is_given(make):
    """progress_cpus pins the progress thread (it copies every message: a CPU prefill worker
    gives it a core off the forward's) and only it; messages still flow. Cores the machine
    lacks, or none, are refused at construction."""
    last = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    server, client = make(), make(progress_cpus={last})
    payload = os.urandom(1 << 20)
    client.send(client.connect(server.bind()), [payload])
    assert bytes(recv_wait(server)[1][0]) == payload
    assert os.sched_getaffinity(client._thread.native_id) == {last}
    assert os.sched_getaffinity(server._thread.native_id) == before  # unpinned: its creator's
    assert os.sched_getaffinity(0) == before  # the caller's thread is untouched
    for bad in (set(), {os.cpu_count() + 7}):
        with pytest.raises(ValueError, match="progress_cpus"):
            UcxTransport(progress_cpus=bad)


def test_two_processes_move_256_mib_intact(make):
    """A child process receives 8 x 32 MiB, replies with each message's xxh3; then exits."""
    parent = make()
    child = subprocess.Popen([sys.executable, __file__, parent.bind()], stdout=subprocess.PIPE, text=True)
    try:
        child_id, hello = recv_wait(parent, timeout=30)
        child_address = bytes(hello[0]).decode()
        rng = np.random.default_rng(1)
        blobs = [rng.integers(0, 256, MSG_BYTES, dtype=np.uint8) for _ in range(NUM_MSGS)]
        t0 = time.perf_counter()
        for i, blob in enumerate(blobs):  # two frames per message: halves of the blob
            parent.send(child_id, [msgpack.packb(i), memoryview(blob[: MSG_BYTES // 2]),
                                   memoryview(blob[MSG_BYTES // 2:])])
        _, (digests,) = recv_wait(parent, timeout=60)
        seconds = time.perf_counter() - t0
        assert msgpack.unpackb(digests) == [xxhash.xxh3_64_intdigest(b) for b in blobs]
        print(f"256 MiB to a child process in {seconds:.2f} s ({NUM_MSGS * MSG_BYTES / seconds / 1e9:.2f} GB/s)")
        parent.send(child_id, [b"bye"])
        assert child.wait(timeout=20) == 0
        # The child is gone: a new endpoint to it cannot be made; the message is dropped.
        late = make()
        late.send(late.connect(child_address), [b"anyone?"])
        end = time.monotonic() + 60  # hang guard only: exits as soon as it is counted
        while late.unroutable == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert late.unroutable == 1
        ((peer, why),) = wait_dropped(late)  # and the caller learns the connection is gone
        assert peer == child_id and why.startswith("unreachable")
        # The parent keeps its endpoint to the child for later connections, but not once the
        # child's process has exited (its address says which): a new connection tells the same.
        parent.disconnect(child_id)
        parent.send(parent.connect(child_address), [b"anyone?"])
        while parent.unroutable == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert parent.unroutable == 1
        ((peer, why),) = wait_dropped(parent)
        assert peer == child_id and why.startswith("unreachable")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


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
            if bytes(frames[0]) == b"bye":
                return
            h = xxhash.xxh3_64()
            for f in frames[1:]:
                h.update(f)
            digests.append(h.intdigest())
            if len(digests) == NUM_MSGS:
                t.send(parent, [msgpack.packb(digests)])
    finally:
        t.close()


if __name__ == "__main__":
    _child(sys.argv[1])
