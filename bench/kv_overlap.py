"""How much KV transfer time layer streaming hides behind prefill compute.

A real prefill of the bundled model runs here (the prefill side); a receiver in a child
process (the decode side) holds a paged cache of the same shape and timestamps KV-complete.
Two runs per repetition, in alternating order, same prompt length:

- streaming: ``send_layer(i)`` from the engine's ``layer_done`` hook, while layers i+1.. compute;
- after: the whole forward first, then every layer is sent.

Per run: T = prefill start -> KV complete on the receiver, and the *exposed* transfer time =
KV complete minus the end of that run's forward. Over the repetitions:

    hidden_fraction         = median(T_after - T_stream) / median(exposed_after)  (end to end, strict;
                              the difference paired per repetition: the prefill's own spread
                              between runs is of the order of the transfer it should hide)
    exposed_hidden_fraction = 1 - median(exposed_stream) / median(exposed_after)  (after the forward only)

1.0: entirely hidden; 0: no gain. Where the two sides run (``cores``):

- ``split`` (default with 2+ cores): the prefill's forward (every torch thread) on all cores
  but the last; the sender's UCX progress thread (``UcxTransport(progress_cpus=...)``) and the
  receiver on the last one: a prefill worker that gives its transport a core of its own, next
  to a decode worker on other cores (a deployment). Streaming then hides the transfer:
  gathering and encoding a layer on the forward's thread costs ~0.2% of the forward (measured).
- ``shared``: both sides on every core (both workers of a one-machine cluster, unpinned). The
  UCX progress threads (they copy every message and spin while one is in flight) and the
  receiver's decoding are scheduled onto the forward's cores and preempt it: what streaming
  would hide, the forward loses (0.0 measured on 2 cores). The same happens with the progress
  thread pinned beside the forward.

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


def _receiver_main(conn, transport: str, layout, num_blocks: int, cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)  # before any thread starts: they all inherit it
    # (heavy: torch and the engine; imported after the affinity above, which torch's threads inherit)
    import torch

    # (heavy: as above)
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


MODES = ("inline", "thread", "after")


def split_cores() -> tuple[set[int], set[int]] | None:
    """(prefill's cores, the receiver's core) for ``cores="split"``; None with one core."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores[:-1]), {cores[-1]}) if len(cores) > 1 else None


def measure_overlap(transport: str, prompt_len: int = 2048, reps: int = 2, progress=print,
                    cores: str = "split", threads: int | None = None) -> dict:
    """Run the streaming vs send-after comparison with the two sides' ``cores`` (module doc)
    and ``threads`` torch threads on the prefill side (default: one per core it has);
    returns times (s) and the hidden fractions."""
    split = split_cores() if cores == "split" else None
    if cores == "split" and split is None:
        raise ValueError("cores='split' needs 2 or more cores")
    rx_cpus, all_cpus = None, os.sched_getaffinity(0)
    if split is not None:  # before the engine and the transport start threads: they inherit it
        os.sched_setaffinity(0, split[0])
        rx_cpus = split[1]
    try:
        return _measure(transport, prompt_len, reps, progress, cores, threads, rx_cpus)
    finally:
        os.sched_setaffinity(0, all_cpus)  # (this thread's: what a caller runs next gets every core)


def _measure(transport, prompt_len, reps, progress, cores, threads, rx_cpus) -> dict:
    # (heavy: torch and the engine, loaded only by what uses them)
    import torch
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))

    # (heavy: as above)
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams
    from engine.scheduler import ScheduledRequest, StepPlan
    from kvtransfer.base import KVLayout, TransferState, get_transport
    from kvtransfer.format import gather_layer
    from kvtransfer.sender import KVSender
    from prefill_worker.kv_stream import LayerJob, LayerStreamer

    eng = LLMEngine(EngineConfig(cache=CacheConfig(memory_gb=0.5, enable_prefix_caching=False),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=prompt_len)), progress=False)
    mc, bs = eng.model_config, eng.block_manager.block_size
    layout = KVLayout.of_engine(eng)
    # The decode side uses other blocks than prefill: the transfer must not care.
    rx_layout = dataclasses.replace(layout, block_size=32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, transport, rx_layout, prompt_len // 32 + 8, rx_cpus),
                       daemon=True)
    proc.start()
    try:
        address = parent.recv()
        # split: the sender's transport thread (it copies and spins while a message is in
        # flight) on the receiver's core, off the forward's.
        where = {"progress_cpus": rx_cpus} if rx_cpus and transport == "ucx" else {}
        tx = KVSender(get_transport(transport, **where), layout, lease_s=60.0)
        tx.connect(address)
        streamer = LayerStreamer(tx, eng.runner.kv_caches, bs, cpus=rx_cpus)
        rng = random.Random(0)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}  # (compute, exposed)
        for rep in range(reps + 1):  # the first round warms up both sides
            for mode in MODES[rep % 3:] + MODES[:rep % 3]:  # rotated: no order favoured
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

                def queue(i: int) -> None:
                    streamer.put(LayerJob(tid, i, tuple(req.block_ids), 0, prompt_len))

                t0 = time.monotonic()
                tx.begin(tid, address, prompt_len)
                eng.runner.execute(plan, layer_done={"inline": send, "thread": queue, "after": None}[mode])
                if mode == "thread" and streamer.flush():  # as the prefill worker's step does
                    raise RuntimeError("the transfer thread failed a send")
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
        streamer.close()
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

    out = {"prompt_len": prompt_len, "cores": cores, "prefill_threads": torch.get_num_threads(),
           "prefill_cpus": len(os.sched_getaffinity(0)), "compute_s": med["after"][0],
           "total_after_s": med["after"][2], "exposed_after_s": exposed_after}
    for m in ("inline", "thread"):
        # Paired per repetition (its runs are seconds apart), then the median.
        gain = statistics.median(ca + ea - (cm + em) for (ca, ea), (cm, em) in zip(runs["after"], runs[m]))
        out.update({f"compute_s_{m}": med[m][0], f"total_s_{m}": med[m][2], f"exposed_s_{m}": med[m][1],
                    f"hidden_fraction_{m}": clip(gain / exposed_after if exposed_after > 0 else None),
                    f"exposed_hidden_fraction_{m}": clip(1.0 - med[m][1] / exposed_after
                                                         if exposed_after > 0 else None)})
    # What a prefill worker of this configuration runs: the transfer thread when it has a core
    # of its own (split), else inline (on the forward's cores a thread only preempts it).
    out["send"] = "thread" if rx_cpus else "inline"
    out["hidden_fraction"] = out[f"hidden_fraction_{out['send']}"]
    out["exposed_hidden_fraction"] = out[f"exposed_hidden_fraction_{out['send']}"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Measure how much of the KV transfer layer-by-layer streaming "
                                            "hides behind prefill compute (real model, receiver in a child process).")
    p.add_argument("--transport", default="ucx", choices=["ucx", "zmq"])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--cores", default="split" if split_cores() else "shared", choices=["split", "shared"],
                   help="split: the receiver on the last core, the prefill on the others (a deployment, "
                        "where decode has cores of its own; the default with 2+ cores); shared: both "
                        "sides on every core")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the prefill side (default: one per core it runs on)")
    args = p.parse_args(argv)
    res = measure_overlap(args.transport, args.prompt_len, args.reps,
                          progress=lambda m: print(m, file=sys.stderr, flush=True), cores=args.cores,
                          threads=args.threads)
    print(json.dumps({"transport": args.transport, **res}))
    return res


if __name__ == "__main__":
    main()
