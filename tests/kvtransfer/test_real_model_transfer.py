"""The real model's KV through every transport: prefill engine (block 16) -> decode engine
(block 32) over KVSender/KVReceiver. The received cache equals a local prefill bitwise, and a
disaggregated greedy run gives the same tokens as one engine."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledRequest, StepPlan
from kvtransfer.base import TRANSPORTS, KVLayout, TransferState, _load_builtin, get_transport
from kvtransfer.format import gather_layer
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
_load_builtin()
NAMES = sorted(TRANSPORTS)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "Q: What is 17 times 3?\nA:", "A list of colours: red, green,"]
LONG = "The quick brown fox jumps over the lazy dog. " * 8 + "Count the foxes:"  # ~90 tokens: 2 full blocks of 32


def _engine(model_path, block_size: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_path), cache=CacheConfig(block_size=block_size, memory_gb=0.1),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=2048)), progress=False)


@pytest.fixture(scope="module")
def engines(model_path):
    p, d = _engine(model_path, 16), _engine(model_path, 32)
    yield p, d
    for e in (p, d):
        assert e.block_manager.num_used_blocks == 0


def _prefill_keep(eng: LLMEngine, ids: list[int]) -> Request:
    req = Request(f"keep-{len(ids)}", ids, SamplingParams(max_tokens=1))
    assert eng.block_manager.allocate(req.block_ids, len(ids))
    eng.runner.all_logits(StepPlan([ScheduledRequest(req, len(ids))]))
    return req


def _read(eng: LLMEngine, blocks: list[int], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [gather_layer(kv, blocks, eng.block_manager.block_size, 0, n) for kv in eng.runner.kv_caches]


def _pump(tx: KVSender, rx: KVReceiver, tid: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not (tx.poll(tid).is_final and rx.poll(tid).is_final):
        tx.progress()
        rx.progress()
        assert time.monotonic() < end, f"transfer {tid} did not finish"
        time.sleep(0.0001)
    assert tx.poll(tid) == rx.poll(tid) == TransferState.DONE, (tx.error(tid), rx.error(tid))
    tx.pop_finished()
    rx.pop_finished()


def _send_all(tx: KVSender, eng: LLMEngine, tid: str, address: str, blocks: list[int], n: int,
              start: int = 0) -> None:
    """Send tokens [start, n) of every layer."""
    tx.begin(tid, address, n - start, token_start=start)
    for i, kv in enumerate(eng.runner.kv_caches):
        k, v = gather_layer(kv, blocks, eng.block_manager.block_size, start, n)
        tx.send_layer(tid, i, k, v)


@pytest.fixture(scope="module")
def links(engines, connect_kv):
    """One connected sender/receiver pair per transport, on the two engines' caches."""
    p, d = engines
    made = {}
    for name in NAMES:
        tx = KVSender(get_transport(name), KVLayout.of_engine(p))
        rx = KVReceiver(get_transport(name), KVLayout.of_engine(d), d.runner.kv_caches)
        connect_kv(tx, rx)
        made[name] = (tx, rx)
    yield made
    for tx, rx in made.values():
        tx.close()
        rx.close()


@pytest.mark.parametrize("n", [1, 17, 2000])
def test_received_kv_equals_local_prefill(engines, links, n):
    p, d = engines
    ids = [random.Random(n).randrange(100, 40000) for _ in range(n)]
    src = _prefill_keep(p, ids)
    ref = _prefill_keep(d, ids)
    want = _read(d, ref.block_ids, n)
    d.block_manager.free(ref.block_ids)
    try:
        for name, (tx, rx) in links.items():
            blocks: list[int] = []
            assert d.block_manager.allocate(blocks, n)
            for k, v in d.runner.kv_caches:  # poison the reserved slots: every byte must be written
                for c in (k, v):
                    c[torch.tensor(blocks)[:, None] * 32 + torch.arange(32)] = float("nan")
            tid = f"{name}-{n}"
            rx.expect(tid, blocks, n)
            _send_all(tx, p, tid, rx.address, src.block_ids, n)
            _pump(tx, rx, tid)
            got = _read(d, blocks, n)
            d.block_manager.free(blocks)
            for (gk, gv), (wk, wv) in zip(got, want):
                assert torch.equal(gk, wk) and torch.equal(gv, wv), f"{name}: KV differs"
    finally:
        p.block_manager.free(src.block_ids)


@pytest.mark.parametrize("name", NAMES)
def test_disaggregated_greedy_matches_one_engine(engines, links, name):
    p, d = engines
    tx, rx = links[name]
    sp = SamplingParams(max_tokens=24, temperature=0)
    hits = 0
    # (LONG on its own: the same batches on both sides, so the same kernels decode them)
    for group, prompts in enumerate([PROMPTS, [LONG]]):
        want = {o.request_id: o.token_ids for o in (d.generate(prompts, sp))}
        want = dict(zip([f"{name}-{group}-{i}" for i in range(len(prompts))], want.values()))
        rids = [p.add_request(pr, sp, request_id=rid, prefill_only=True) for rid, pr in zip(want, prompts)]
        first = {o.request_id: o.token_ids[0] for o in p.stream() if o.finished}
        for rid in rids:
            req = p.scheduler.requests[rid]
            # d just ran these prompts: the full blocks before each one's last token are in its
            # prefix cache, so only the rest crosses (decode-side prefix reuse).
            slot = d.add_remote(req.prompt_token_ids, sp, request_id=rid)
            bs = d.block_manager.block_size
            assert slot.token_start == (req.num_prompt_tokens - 1) // bs * bs
            hits += slot.token_start
            rx.expect(rid, slot.block_ids, req.num_prompt_tokens - slot.token_start, token_start=slot.token_start)
            _send_all(tx, p, rid, rx.address, req.block_ids, req.num_prompt_tokens, slot.token_start)
            _pump(tx, rx, rid)
            assert p.release(rid)
            d.kv_arrived(rid, first_token=first[rid])
        got = {o.request_id: o.token_ids for o in d.stream() if o.finished}
        assert got == want
    assert hits >= 2 * d.block_manager.block_size  # LONG's leading blocks were not sent again
