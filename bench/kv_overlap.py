"""How much KV transfer time layer streaming hides behind prefill compute.

A real prefill of the bundled model runs here (the prefill side); a receiver in a child
process (the decode side) holds a paged cache of the same shape and timestamps KV-complete.
Two runs per transport, same prompt length:

- streaming: ``send_layer(i)`` from the engine's ``layer_done`` hook, while layers i+1.. compute;
- after: the whole forward first, then every layer is sent.

Per run: T = prefill start -> KV complete on the receiver, and the *exposed* transfer time =
KV complete minus the end of that run's forward. Medians over the repetitions give

    hidden_fraction         = (T_after - T_stream) / exposed_after      (end to end, strict)
    exposed_hidden_fraction = 1 - exposed_stream / exposed_after       (after the forward only)

The strict one counts what streaming costs the prefill itself (gathering and sending layer i
runs on the prefill's cores while layer i+1 computes); on a CPU-only box that cost is of the
same order as the transfer, so the two can differ a lot. 1.0: entirely hidden; 0: no gain.
Used by bench/kv_transfer.py; runnable alone: ``python bench/kv_overlap.py --help``.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _receiver_main(conn, transport: str, layout, num_blocks: int) -> None:
    import torch

    from engine.kv_cache import BlockManager, allocate_kv_tensors
    from kvtransfer.base import TransferState, get_transport
    from kvtransfer.receiver import KVReceiver
    torch.set_num_threads(1)
    kv = allocate_kv_tensors(layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads,
                             layout.head_dim, getattr(torch, layout.dtype))
    bm = BlockManager(num_blocks, layout.block_size, enable_prefix_caching=False)
    rx = KVReceiver(get_transport(transport), layout, kv, lease_s=60.0)
    conn.send(rx.address)
    while True:
        while not conn.poll(0):
            rx.progress()  # answer the sender's handshake while idle
            time.sleep(0.0002)
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, tid, n = msg
        blocks: list[int] = []
        assert bm.allocate(blocks, n)
        rx.expect(tid, blocks, n)
        conn.send("ready")
        while rx.poll(tid) not in (TransferState.DONE, TransferState.FAILED):
            rx.progress()
            time.sleep(0.0001)  # like a decode loop between steps: do not steal the prefill's core
        done = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable across processes
        state = rx.poll(tid)
        rx.pop_finished()
        bm.free(blocks)
        conn.send((done, state.value))
    rx.close()


def measure_overlap(transport: str, prompt_len: int = 2048, reps: int = 2, progress=print) -> dict:
    """Run the streaming vs send-after comparison; returns times (s) and the hidden fraction."""
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams
    from engine.scheduler import ScheduledRequest, StepPlan
    from kvtransfer.base import KVLayout, TransferState, get_transport
    from kvtransfer.format import gather_layer
    from kvtransfer.sender import KVSender

    eng = LLMEngine(EngineConfig(cache=CacheConfig(memory_gb=0.5, enable_prefix_caching=False),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=prompt_len)), progress=False)
    mc, bs = eng.model_config, eng.block_manager.block_size
    layout = KVLayout.of_engine(eng)
    # The decode side uses other blocks than prefill: the transfer must not care.
    rx_layout = dataclasses.replace(layout, block_size=32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, transport, rx_layout, prompt_len // 32 + 8),
                       daemon=True)
    proc.start()
    try:
        address = parent.recv()
        tx = KVSender(get_transport(transport), layout, lease_s=60.0)
        tx.connect(address)
        rng = random.Random(0)
        runs: dict[str, list[tuple[float, float]]] = {"stream": [], "after": []}  # (compute, exposed)
        for rep in range(reps + 1):  # the first round warms up both sides
            for mode in ("stream", "after"):
                tid = f"{mode}-{rep}"
                req = Request(tid, [rng.randrange(100, 40000) for _ in range(prompt_len)],
                              SamplingParams(max_tokens=1))
                assert eng.block_manager.allocate(req.block_ids, prompt_len)
                parent.send(("expect", tid, prompt_len))
                assert parent.recv() == "ready"
                plan = StepPlan([ScheduledRequest(req, prompt_len)])

                def send(i: int) -> None:
                    k, v = gather_layer(eng.runner.kv_caches[i], req.block_ids, bs, 0, prompt_len)
                    tx.send_layer(tid, i, k, v)
                    tx.progress()

                t0 = time.monotonic()
                tx.begin(tid, address, prompt_len)
                eng.runner.execute(plan, layer_done=send if mode == "stream" else None)
                t_end = time.monotonic()
                if mode == "after":
                    for i in range(mc.num_layers):
                        send(i)
                while tx.poll(tid) not in (TransferState.DONE, TransferState.FAILED):
                    tx.progress()
                done, state = parent.recv()
                tx.pop_finished()
                eng.block_manager.free(req.block_ids)
                if state != "done":
                    raise RuntimeError(f"transfer {tid} ended {state}")
                progress(f"  {transport} {mode:6s} rep {rep}: prefill {t_end - t0:.3f}s, "
                         f"KV complete {done - t_end:+.3f}s after it")
                if rep > 0:
                    runs[mode].append((t_end - t0, max(0.0, done - t_end)))
        parent.send(("stop",))
        tx.close()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    med = {m: (statistics.median(c for c, _ in r), statistics.median(e for _, e in r),
               statistics.median(c + e for c, e in r)) for m, r in runs.items()}
    exposed_after = med["after"][1]

    def clip(x: float | None) -> float | None:
        return None if x is None else max(0.0, min(1.0, x))

    strict = (med["after"][2] - med["stream"][2]) / exposed_after if exposed_after > 0 else None
    exposed_only = 1.0 - med["stream"][1] / exposed_after if exposed_after > 0 else None
    return {"prompt_len": prompt_len, "compute_s": med["after"][0], "stream_compute_s": med["stream"][0],
            "total_stream_s": med["stream"][2], "total_after_s": med["after"][2],
            "exposed_stream_s": med["stream"][1], "exposed_after_s": exposed_after,
            "hidden_fraction": clip(strict), "exposed_hidden_fraction": clip(exposed_only)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Measure how much of the KV transfer layer-by-layer streaming "
                                            "hides behind prefill compute (real model, receiver in a child process).")
    p.add_argument("--transport", default="ucx", choices=["ucx", "zmq"])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the prefill side (default: torch's, every core). Fewer than "
                        "the cores leaves some to the receiver, as when the decode side has cores of its own; "
                        "on one 2-core box with both sides sharing every core, streaming cannot hide anything")
    args = p.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    res = measure_overlap(args.transport, args.prompt_len, args.reps,
                          progress=lambda m: print(m, file=sys.stderr, flush=True))
    import torch
    print(json.dumps({"transport": args.transport, "prefill_threads": torch.get_num_threads(), **res}))
    return res


if __name__ == "__main__":
    main()
