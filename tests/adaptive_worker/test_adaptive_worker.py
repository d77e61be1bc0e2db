"""The adaptive worker core on the real model over real transports: one engine that prefills
for another worker, decodes what another prefilled and runs a local request, all in the same
steps; greedy output identical to one engine; nothing leaked; its prefix cache serves it in
whichever role it plays next."""

from __future__ import annotations

import os
import time

import pytest

from adaptive_worker.worker import AdaptiveWorker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from kvtransfer.auth import PlaneAuth, new_secret
from kvtransfer.base import get_transport

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


def _worker(model_path, transport: str, auth: PlaneAuth) -> AdaptiveWorker:
    # A small token budget: prompts prefill in chunks beside the other requests' decode steps.
    engine = LLMEngine(EngineConfig(model=str(model_path), compile_decode_rows=1,
                                    cache=CacheConfig(block_size=4, memory_gb=0.05),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=8)), progress=False)
    return AdaptiveWorker(engine, get_transport(transport), get_transport(transport), auth=auth)


def _run(workers: list[AdaptiveWorker], want: int) -> dict[str, list[int]]:
    """Step every worker until ``want`` requests finished and no transfer is left."""
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    deadline = time.monotonic() + 180  # hang guard only
    while len(finished) < want or any(w.transfers for w in workers):
        assert time.monotonic() < deadline, "workers did not finish"
        for w in workers:
            decoded, prefilled, _ = w.step()
            for o in prefilled + decoded:
                tokens[o.request_id] = list(o.token_ids)
            finished |= {o.request_id for o in decoded if o.finished}
            assert not w.failed
    return tokens


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_one_engine_prefills_for_a_peer_decodes_for_it_and_runs_its_own(model_path, tokenizer, transport,
                                                                        connect_kv):
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = LLMEngine(EngineConfig(model=str(model_path), compile_decode=False), progress=False)
    want = [o.token_ids for o in ref.generate(ids, sp)]
    auth = PlaneAuth(new_secret())
    a, b = _worker(model_path, transport, auth), _worker(model_path, transport, auth)
    try:
        connect_kv(a.sender, b.receiver)
        connect_kv(b.sender, a.receiver)
        # r0: a prefills, b decodes. r1: b prefills, a decodes. r2: a alone (a local prefill).
        for rid, prefiller, decoder, prompt in (("r0", a, b, ids[0]), ("r1", b, a, ids[1])):
            got = decoder.reserve(rid, prompt, sp)
            prefiller.submit(rid, prompt, sp, decoder.address, got)
        a.engine.add_request(ids[2], sp, request_id="r2")
        tokens = _run([a, b], 3)
        assert [tokens[f"r{i}"] for i in range(3)] == want
        assert a.sender.stats.done == b.sender.stats.done == 1  # each side sent one and received one
        assert a.receiver.stats.done == b.receiver.stats.done == 1
        both = a.sender.stats + a.receiver.stats  # (what its status reports: every transfer it took part in)
        assert both.done == 2 and both.bytes == a.sender.stats.bytes + a.receiver.stats.bytes > 0
        for w in (a, b):
            assert w.engine.block_manager.num_used_blocks == 0 and not w.engine.has_unfinished()

        # What a prefilled for b stays in a's prefix cache: a request a decodes next (a's role
        # switched) finds it there, and only the rest of its KV comes from b.
        got = a.reserve("again", ids[0], sp)
        assert got.token_start == (len(ids[0]) - 1) // 4 * 4 > 0
        b.submit("again", ids[0], sp, a.address, got)
        assert _run([a, b], 1)["again"] == want[0]
        for w in (a, b):
            assert w.engine.block_manager.num_used_blocks == 0 and not w.engine.has_unfinished()
    finally:
        a.close()
        b.close()


def test_abort_frees_both_sides_whichever_role_holds_the_request(model_path, tokenizer, connect_kv):
    """An abort on the prefilling side fails the transfer: the decoding side frees its blocks
    at once; an abort of a request decoding here frees its own."""
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    auth = PlaneAuth(new_secret())
    a, b = _worker(model_path, "zmq", auth), _worker(model_path, "zmq", auth)
    try:
        connect_kv(a.sender, b.receiver)
        got = b.reserve("x", prompt, sp)
        a.submit("x", prompt, sp, b.address, got)
        a.engine.add_request(prompt, sp, request_id="y")
        a.step()  # one chunk of each computed (8 tokens of budget)
        assert a.transfers and b.engine.block_manager.num_used_blocks > 0
        a.abort("x")
        a.abort("y")
        deadline = time.monotonic() + 30  # hang guard only: the failure travels at once
        while "x" not in b.failed or a.transfers:
            assert time.monotonic() < deadline
            a.step()
            b.step()
        for w in (a, b):
            assert w.engine.block_manager.num_used_blocks == 0 and not w.engine.has_unfinished()
    finally:
        a.close()
        b.close()
