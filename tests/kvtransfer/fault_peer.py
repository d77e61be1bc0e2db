"""Child-process KV peer for tests/kvtransfer/test_faults.py (the test kills it mid-transfer).

    fault_peer.py sender TRANSPORT RECEIVER_ADDRESS LEASE_S
    fault_peer.py receiver TRANSPORT LEASE_S

Commands arrive on stdin, one per line; events go to stdout, one per line:

    sender:   (prints CONNECTED after the handshake)
              SEND tid num_tokens seed num_layers -> begin, push that many layers: SENT tid
    receiver: (prints ADDR address once bound)
              EXPECT tid num_tokens seed        -> reserve blocks, expect: EXPECTING tid
                                                   first frame in: STATE tid transferring
    both:     a transfer ends: FINISHED tid done|failed [ok|mismatch] (receiver checks the data)
              EXIT                              -> close and exit 0
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch  # noqa: E402

from engine.kv_cache import BlockManager, allocate_kv_tensors  # noqa: E402
from kvtransfer.base import KVLayout, TransferState, get_transport  # noqa: E402
from kvtransfer.format import gather_layer  # noqa: E402
from kvtransfer.receiver import KVReceiver  # noqa: E402
from kvtransfer.sender import KVSender  # noqa: E402

LAYERS, HEADS, DIM, FINGERPRINT = 4, 2, 8, "fault-test"


def make_layout(block_size: int) -> KVLayout:
    return KVLayout(FINGERPRINT, LAYERS, HEADS, DIM, block_size, "float32")


def make_kv(seed: int, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per-layer (K, V), each [num_tokens, HEADS, DIM]: both processes agree."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_tokens, HEADS, DIM, generator=g), torch.randn(num_tokens, HEADS, DIM, generator=g))
            for _ in range(LAYERS)]


def say(*words: object) -> None:
    print(*words, flush=True)


def _stdin_lines() -> queue.Queue[str]:
    q: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            q.put(line.strip())
        q.put("EXIT")  # parent went away

    threading.Thread(target=read, daemon=True).start()
    return q


def run_sender(transport: str, address: str, lease_s: float) -> None:
    tx = KVSender(get_transport(transport), make_layout(4), lease_s=lease_s)
    tx.connect(address, timeout_s=20)
    say("CONNECTED")
    commands = _stdin_lines()
    while True:
        try:
            cmd = commands.get_nowait().split()
        except queue.Empty:
            cmd = []
        if cmd[:1] == ["EXIT"]:
            tx.close()
            return
        if cmd[:1] == ["SEND"]:
            tid, n, seed, layers = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
            tx.begin(tid, address, n)
            for layer, (k, v) in enumerate(make_kv(seed, n)[:layers]):
                tx.send_layer(tid, layer, k, v)
            say("SENT", tid)
        tx.progress()
        for tid, state in tx.pop_finished():
            say("FINISHED", tid, state.value)
        time.sleep(0.001)


def run_receiver(transport: str, lease_s: float) -> None:
    lay = make_layout(8)
    bm = BlockManager(64, lay.block_size, enable_prefix_caching=False)
    kv = allocate_kv_tensors(LAYERS, 64, lay.block_size, HEADS, DIM, torch.float32)
    rx = KVReceiver(get_transport(transport), lay, kv, lease_s=lease_s)
    say("ADDR", rx.address)
    commands = _stdin_lines()
    live: dict[str, tuple[list[int], int, int]] = {}  # tid -> blocks, num_tokens, seed
    reported: set[str] = set()
    while True:
        try:
            cmd = commands.get_nowait().split()
        except queue.Empty:
            cmd = []
        if cmd[:1] == ["EXIT"]:
            rx.close()
            return
        if cmd[:1] == ["EXPECT"]:
            tid, n, seed = cmd[1], int(cmd[2]), int(cmd[3])
            blocks: list[int] = []
            assert bm.allocate(blocks, n)
            live[tid] = (blocks, n, seed)
            rx.expect(tid, blocks, n)
            say("EXPECTING", tid)
        rx.progress()
        for tid in live:
            if tid not in reported and rx.poll(tid) is TransferState.TRANSFERRING:
                reported.add(tid)
                say("STATE", tid, "transferring")
        for tid, state in rx.pop_finished():
            blocks, n, seed = live.pop(tid)
            verdict = ""
            if state is TransferState.DONE:
                same = all(torch.equal(a, b) for layer, want in enumerate(make_kv(seed, n))
                           for a, b in zip(gather_layer(kv[layer], blocks, lay.block_size, 0, n), want))
                verdict = "ok" if same else "mismatch"
            bm.free(blocks)
            say("FINISHED", tid, state.value, verdict)
        time.sleep(0.001)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "sender":
        run_sender(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        run_receiver(sys.argv[2], float(sys.argv[3]))
