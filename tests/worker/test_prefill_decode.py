"""Prefill and decode worker cores on the real model over real transports: KV streamed per
layer and per prompt chunk (prefix-cache hits included), greedy output identical to one engine,
nothing leaked. Driven in one thread the way the Ray actors' loops will drive them."""

from __future__ import annotations

import os
import time

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from kvtransfer.auth import PlaneAuth, new_secret
from kvtransfer.base import TransferState, get_transport
from prefill_worker.worker import PrefillWorker

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "The capital of France is a city that"]  # shares a prefix with the first


def _engine(model_path, block_size: int, budget: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_path), cache=CacheConfig(block_size=block_size, memory_gb=0.05),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)), progress=False)


@pytest.mark.parametrize("transport,transfer_thread", [("zmq", False), ("ucx", False), ("ucx", True)])
def test_workers_stream_kv_and_match_one_engine(model_path, tokenizer, transport, transfer_thread, connect_kv):
    sp = SamplingParams(max_tokens=20, temperature=0)
    ref_engine = _engine(model_path, 16, 2048)
    want = [o.token_ids for o in ref_engine.generate(PROMPTS, sp)]
    # Small prefill budget: prompts prefill in several chunks, each streamed as it is computed.
    # Authenticated as in the cluster: every message MAC'd, data with each transfer's secret.
    auth = PlaneAuth(new_secret())
    # With the transfer thread (on the last core, with UCX's progress thread: as
    # prefill.transfer_cpus runs it), layers are gathered and sent beside the forward.
    last = {max(os.sched_getaffinity(0))} if transfer_thread else None
    pw = PrefillWorker(_engine(model_path, 4, 6),
                       get_transport(transport, **({"progress_cpus": last} if last else {})), auth=auth,
                       transfer_thread=transfer_thread, transfer_cpus=last)
    dw = DecodeWorker(_engine(model_path, 16, 2048), get_transport(transport), auth=auth)
    try:
        connect_kv(pw.sender, dw.receiver)
        ids = {f"r{i}": tokenizer(p)["input_ids"] for i, p in enumerate(PROMPTS)}
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        for rid, prompt in ids.items():
            got = dw.reserve(rid, prompt, sp)
            assert got.secret  # (authenticated)
            pw.submit(rid, prompt, sp, dw.address, got)
            if rid == "r0":  # finish r0 first so r3's shared prefix hits the prefill cache
                while "r0" not in tokens:  # the first token reaches decode as the transfer's trailer
                    for o in pw.step()[0]:
                        tokens[o.request_id] = list(o.token_ids)
        deadline = time.monotonic() + 120
        while len(finished) < len(ids):
            assert time.monotonic() < deadline, "workers did not finish"
            outs, _ = pw.step()
            for o in outs:
                tokens[o.request_id] = list(o.token_ids)
            for o in dw.step():
                tokens[o.request_id] = list(o.token_ids)
                if o.finished:
                    finished.add(o.request_id)
        while pw.transfers:  # acks still in flight
            pw.step()
            assert time.monotonic() < deadline
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == want
        assert pw.engine.block_manager.prefix_hits > 0
        assert pw.engine.block_manager.num_used_blocks == 0
        assert dw.engine.block_manager.num_used_blocks == 0
        assert not dw.failed
        assert pw.sender.stats.forged == dw.receiver.stats.forged == 0
    finally:
        pw.close()
        dw.close()


@pytest.mark.parametrize("transfer_thread", [False, True])
def test_a_prefix_the_decode_worker_caches_is_not_sent_again(model_path, tokenizer, connect_kv, transfer_thread):
    """Decode-side prefix reuse: the second time a long prompt comes, the decode worker shares
    its cached leading blocks and the prefill worker (its own cache emptied, so it computes
    all of it, in chunks of 6 tokens) sends only the positions after them: chunks wholly
    inside that prefix send nothing. Output identical, fewer bytes, nothing leaked."""
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 4 + "How many foxes?")["input_ids"]
    want = _engine(model_path, 16, 2048).generate([prompt], sp)[0].token_ids
    pw = PrefillWorker(_engine(model_path, 4, 6), get_transport("zmq"), transfer_thread=transfer_thread)
    dw = DecodeWorker(_engine(model_path, 16, 2048), get_transport("zmq"))
    try:
        connect_kv(pw.sender, dw.receiver)
        starts, sent = [], []
        for rid in ("first", "again"):
            bytes_before = dw.receiver.stats.bytes
            got = dw.reserve(rid, prompt, sp)
            starts.append(got.token_start)
            pw.submit(rid, prompt, sp, dw.address, got)
            tokens: list[int] = []
            deadline = time.monotonic() + 120  # hang guard only
            while rid not in dw.failed and not (tokens and len(tokens) == len(want)) or pw.transfers:
                assert time.monotonic() < deadline, "workers did not finish"
                for o in pw.step()[0]:
                    tokens = list(o.token_ids)
                for o in dw.step():
                    tokens = list(o.token_ids)
            assert not dw.failed and tokens == want
            sent.append(dw.receiver.stats.bytes - bytes_before)
            pw.engine.block_manager.reset_prefix_cache()  # the prefill side computes it all again
        bs = dw.engine.block_manager.block_size
        assert starts == [0, (len(prompt) - 1) // bs * bs] and starts[1] >= 2 * bs
        assert 0 < sent[1] < sent[0]
        assert pw.engine.block_manager.num_used_blocks == dw.engine.block_manager.num_used_blocks == 0
    finally:
        pw.close()
        dw.close()


def test_decode_worker_frees_blocks_when_the_transfer_fails(model_path):
    dw = DecodeWorker(_engine(model_path, 16, 2048), get_transport("zmq"), lease_s=0.2)
    try:
        assert dw.reserve("x", [5, 6, 7, 8], SamplingParams(max_tokens=4)) is not None
        assert dw.engine.block_manager.num_used_blocks > 0
        end = time.monotonic() + 60  # hang guard only: the lease is 0.2 s
        while "x" not in dw.failed:  # no prefill worker ever sends: the lease expires
            dw.step()
            assert time.monotonic() < end
        assert dw.engine.block_manager.num_used_blocks == 0 and not dw.engine.has_unfinished()
        assert dw.reserve("y", [5, 6], SamplingParams(max_tokens=4)) is not None
        dw.abort("y")
        assert dw.engine.block_manager.num_used_blocks == 0
    finally:
        dw.close()


def test_a_request_reserved_again_right_after_its_abort_is_a_new_one(model_path):
    """The router undoes a placement whose prefill worker was lost while decode answered
    (abort), then reserves the same attempt again, before the decode loop has stepped: the
    new reservation is taken (it was refused as 'already expected', an internal error seen in
    a soak), and the old transfer's failure is never reported against it."""
    dw = DecodeWorker(_engine(model_path, 16, 2048), get_transport("zmq"), lease_s=30.0)
    try:
        sp = SamplingParams(max_tokens=4)
        assert dw.reserve("k#0", [5, 6, 7, 8], sp) is not None
        dw.abort("k#0")
        assert dw.reserve("k#0", [5, 6, 7, 8], sp) is not None
        for _ in range(3):
            dw.step()
        assert "k#0" not in dw.failed and dw.receiver.poll("k#0") is TransferState.WAITING
        assert dw.engine.block_manager.num_used_blocks > 0  # the new reservation's blocks
        dw.abort("k#0")
        assert dw.engine.block_manager.num_used_blocks == 0 and not dw.engine.has_unfinished()
    finally:
        dw.close()


@pytest.mark.parametrize("transfer_thread", [False, True])
def test_a_transfer_that_cannot_be_sent_fails_its_request_only(model_path, tokenizer, connect_kv, transfer_thread):
    """An id too long for a KV frame header (the router refuses such ids; a worker must still
    not trust it): that request's transfer fails and its blocks are freed on both sides at
    once, the worker goes on, and a request beside it completes. On the transfer thread too:
    its error comes back to the step, which fails that request only."""
    sp = SamplingParams(max_tokens=4, temperature=0)
    pw = PrefillWorker(_engine(model_path, 16, 2048), get_transport("zmq"), transfer_thread=transfer_thread)
    dw = DecodeWorker(_engine(model_path, 16, 2048), get_transport("zmq"))
    try:
        connect_kv(pw.sender, dw.receiver)
        ids = tokenizer(PROMPTS[0])["input_ids"]
        bad, good = "r" * 300, "ok"
        for rid in (bad, good):
            assert (got := dw.reserve(rid, ids, sp)) is not None
            pw.submit(rid, ids, sp, dw.address, got)
        ended: dict[str, object] = {}
        done = False
        deadline = time.monotonic() + 120  # hang guard only
        while not (done and bad in dw.failed and not pw.transfers):
            assert time.monotonic() < deadline
            _, e = pw.step()
            ended.update(e)
            done = done or any(o.request_id == good and o.finished for o in dw.step())
        assert (ended[bad], ended[good]) == (TransferState.FAILED, TransferState.DONE)
        assert pw.engine.block_manager.num_used_blocks == 0 and not pw.engine.has_unfinished()
        assert dw.engine.block_manager.num_used_blocks == 0 and not dw.engine.has_unfinished()
    finally:
        pw.close()
        dw.close()


def test_steps_call_beat_between_layers_so_a_long_step_still_reports(model_path, tokenizer, connect_kv):
    """Each worker core calls the step loop's ``beat`` once per layer of every forward (a prompt
    chunk streaming its KV, a decode step), so a step of minutes still reports
    (worker/step_loop.py MID_STEP_BEAT_S) and the router's stall_s judges a silent worker only."""
    sp = SamplingParams(max_tokens=3, temperature=0)
    pw = PrefillWorker(_engine(model_path, 4, 6), get_transport("zmq"))
    dw = DecodeWorker(_engine(model_path, 16, 2048), get_transport("zmq"))
    layers = pw.engine.model_config.num_layers
    beats = {"prefill": 0, "decode": 0}
    try:
        connect_kv(pw.sender, dw.receiver)
        prompt = tokenizer(PROMPTS[1])["input_ids"]
        pw.submit("r0", prompt, sp, dw.address, dw.reserve("r0", prompt, sp))
        deadline = time.monotonic() + 60
        done = False
        while not done:
            assert time.monotonic() < deadline, "workers did not finish"
            pw.step(lambda: beats.__setitem__("prefill", beats["prefill"] + 1))
            done = any(o.finished for o in dw.step(lambda: beats.__setitem__("decode", beats["decode"] + 1)))
        # whole forwards only: the prompt in chunks of a 6-token budget, then 2 decode steps
        # (the first token came with the KV)
        assert beats["prefill"] % layers == 0 and beats["prefill"] // layers == -(-len(prompt) // 6)
        assert beats["decode"] == 2 * layers
    finally:
        pw.close()
        dw.close()
