"""A peer process dies mid-transfer: the transfer ends, blocks are freed, others go on. Over zmq
the survivor sees the connection close and fails it at once; UCX (no endpoint error handling)
cannot tell, so the lease ends it.

Real processes (``fault_peer.py`` children) over real sockets on loopback; the test process is
the surviving side, holding a BlockManager that must end with no block used.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before any ucx import (see MACHINE.md)

import importlib.util
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.kv_cache import BlockManager, allocate_kv_tensors
from kvtransfer.base import TRANSPORTS, TransferState, _load_builtin, get_transport
from kvtransfer.format import gather_layer
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender

PEER = Path(__file__).with_name("fault_peer.py")
ROOT = PEER.parents[2]
_spec = importlib.util.spec_from_file_location("fault_peer", PEER)
peer_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_mod)

_load_builtin()
MULTI_PROCESS = [n for n in ("zmq", "ucx") if n in TRANSPORTS]  # inproc cannot cross processes
LEASE_S = 1.5
D, F = TransferState.DONE, TransferState.FAILED


class Child:
    """A fault_peer.py process; its stdout lines are collected by a thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(PEER), *args], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, prefix: str, pump: Callable[[], None] = lambda: None, timeout: float = 120.0) -> list[str]:
        """Run ``pump`` until the child prints a line starting with ``prefix``; its words. The
        timeout guards a hang only: a child importing torch on a loaded 2-core box takes a while."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pump()
            try:
                line = self.lines.get(timeout=0.001)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line.split()
        raise AssertionError(f"child never printed {prefix!r}; output so far:\n" + "\n".join(self.seen))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # stdin of a killed child: broken pipe on flush
                pass


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    """Starts children; kills whatever is left after the test and checks none survive."""
    children: list[Child] = []

    def start(*args: str) -> Child:
        children.append(Child(*args))
        return children[-1]

    yield start
    for c in children:
        c.kill()
    assert all(c.proc.returncode is not None for c in children)


@pytest.mark.parametrize("transport", MULTI_PROCESS)
def test_sender_killed_receiver_fails_within_lease_and_frees(spawn, transport):
    lay = peer_mod.make_layout(8)
    bm = BlockManager(64, lay.block_size, enable_prefix_caching=False)
    kv = allocate_kv_tensors(lay.num_layers, 64, lay.block_size, lay.num_kv_heads, lay.head_dim, torch.float32)
    rx = KVReceiver(get_transport(transport), lay, kv, lease_s=LEASE_S)
    try:
        doomed = spawn("sender", transport, rx.address, str(LEASE_S))
        survivor = spawn("sender", transport, rx.address, str(LEASE_S))
        for c in (doomed, survivor):  # our loop answers their handshakes
            c.wait_for("CONNECTED", rx.progress)
        blocks = {"t1": [], "t2": []}
        assert bm.allocate(blocks["t1"], 13)
        expected_at = time.monotonic()  # just before: the lease starts inside expect()
        rx.expect("t1", blocks["t1"], 13)
        doomed.tell("SEND t1 13 1 2")  # 2 of 4 layers, then it is killed
        doomed.wait_for("SENT t1", rx.progress)
        end = time.monotonic() + 60  # hang guard only
        while rx.poll("t1") is not TransferState.TRANSFERRING:
            rx.progress()
            assert time.monotonic() < end, "no frame of t1 arrived"
        doomed.kill()
        killed_at = time.monotonic()

        assert bm.allocate(blocks["t2"], 13)
        rx.expect("t2", blocks["t2"], 13)
        survivor.tell("SEND t2 13 2 4")
        results: dict[str, tuple[TransferState, float]] = {}
        end = time.monotonic() + LEASE_S + 10
        while len(results) < 2:
            rx.progress()
            for tid, state in rx.pop_finished():
                results[tid] = (state, time.monotonic())
                if state is D:  # check before freeing: the blocks hold exactly what was sent
                    for layer, want in enumerate(peer_mod.make_kv(2, 13)):
                        got = gather_layer(kv[layer], blocks[tid], lay.block_size, 0, 13)
                        assert all(torch.equal(a, b) for a, b in zip(got, want))
                bm.free(blocks[tid])
            assert time.monotonic() < end, f"transfers did not end: {results}"
            time.sleep(0.001)
        assert results["t2"][0] is D and results["t1"][0] is F
        if transport == "zmq":  # the dead sender's connection closed: no wait for the lease
            assert "connection to KV sender dropped" in rx.error("t1")
            assert results["t1"][1] - killed_at < LEASE_S
        else:  # never before its lease (exactly when, with an injected clock: test_lifecycle.py)
            assert "lease" in rx.error("t1")
            assert results["t1"][1] - expected_at >= LEASE_S
        assert bm.num_used_blocks == 0
        survivor.wait_for("FINISHED t2 done", rx.progress)
        survivor.tell("EXIT")
        assert survivor.proc.wait(timeout=10) == 0
    finally:
        rx.close()


@pytest.mark.parametrize("transport", MULTI_PROCESS)
def test_receiver_killed_sender_fails_after_lease_and_frees(spawn, transport):
    lay = peer_mod.make_layout(4)
    bm = BlockManager(64, lay.block_size, enable_prefix_caching=False)
    kv = allocate_kv_tensors(lay.num_layers, 64, lay.block_size, lay.num_kv_heads, lay.head_dim, torch.float32)
    tx = KVSender(get_transport(transport), lay, lease_s=LEASE_S, margin_s=0.5)
    try:
        doomed = spawn("receiver", transport, str(LEASE_S))
        survivor = spawn("receiver", transport, "30")
        addr = {c: c.wait_for("ADDR")[1] for c in (doomed, survivor)}
        for c in (doomed, survivor):
            tx.connect(addr[c], timeout_s=20)
        blocks: dict[str, list[int]] = {}
        for tid, seed in (("t1", 1), ("t2", 2)):  # prefill computed both: its blocks hold the KV
            blocks[tid] = []
            assert bm.allocate(blocks[tid], 13)
            slots = torch.tensor([blocks[tid][p // 4] * 4 + p % 4 for p in range(13)])
            for (kc, vc), (k, v) in zip(kv, peer_mod.make_kv(seed, 13)):
                kc[slots], vc[slots] = k, v

        def push(tid: str, layers: range) -> None:
            for layer in layers:
                assert tx.send_layer(tid, layer, *gather_layer(kv[layer], blocks[tid], 4, 0, 13))

        doomed.tell("EXPECT t1 13 1")
        doomed.wait_for("EXPECTING t1", tx.progress)
        begun_at = time.monotonic()  # just before: the deadline is set inside begin()
        tx.begin("t1", addr[doomed], 13)
        push("t1", range(2))
        doomed.wait_for("STATE t1 transferring", tx.progress)
        doomed.kill()
        killed_at = time.monotonic()

        survivor.tell("EXPECT t2 13 2")
        survivor.wait_for("EXPECTING t2", tx.progress)
        tx.begin("t2", addr[survivor], 13)
        push("t2", range(4))
        results: dict[str, tuple[TransferState, float]] = {}
        end = time.monotonic() + LEASE_S + 10
        while len(results) < 2:
            tx.progress()
            for tid, state in tx.pop_finished():
                results[tid] = (state, time.monotonic())
                bm.free(blocks[tid])  # prefill frees its copy once acked or surely failed
            assert time.monotonic() < end, f"transfers did not end: {results}"
            time.sleep(0.001)
        assert results["t2"][0] is D and results["t1"][0] is F
        if transport == "zmq":  # the dead receiver's connection closed: no wait for the lease
            assert "connection to KV receiver" in tx.error("t1") and "dropped" in tx.error("t1")
            assert results["t1"][1] - killed_at < LEASE_S
        else:  # never before lease + margin (exactly when, with an injected clock: test_lifecycle.py)
            assert "no ack" in tx.error("t1")
            assert results["t1"][1] - begun_at >= LEASE_S + 0.5
        assert bm.num_used_blocks == 0
        survivor.wait_for("FINISHED t2 done ok", tx.progress)
        survivor.tell("EXIT")
        assert survivor.proc.wait(timeout=10) == 0
    finally:
        tx.close()


def test_a_hung_receiver_is_cut_by_heartbeats_long_before_the_lease(spawn, monkeypatch):
    """zmq: a receiver process that stops (no crash, no close: SIGSTOP) stops answering
    heartbeats, so its connection is cut and the transfer on it fails, not 30 s later."""
    import signal

    from kvtransfer import zmq_transport
    monkeypatch.setattr(zmq_transport, "HEARTBEAT_IVL_MS", 100)
    monkeypatch.setattr(zmq_transport, "HEARTBEAT_TIMEOUT_MS", 500)
    lay = peer_mod.make_layout(4)
    tx = KVSender(get_transport("zmq"), lay, lease_s=30.0)
    try:
        hung = spawn("receiver", "zmq", "30")
        address = hung.wait_for("ADDR")[1]
        tx.connect(address, timeout_s=20)
        hung.tell("EXPECT t1 13 1")
        hung.wait_for("EXPECTING t1", tx.progress)
        tx.begin("t1", address, 13)
        for layer, (k, v) in enumerate(peer_mod.make_kv(1, 13)[:2]):
            assert tx.send_layer("t1", layer, k, v)
        hung.wait_for("STATE t1 transferring", tx.progress)
        os.kill(hung.proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while tx.poll("t1") is not F:
            tx.progress()
            assert time.monotonic() - stopped_at < 10, "the hung receiver was never noticed"
            time.sleep(0.001)
        assert "dropped" in tx.error("t1") and "heartbeat" in tx.error("t1")
    finally:
        tx.close()
