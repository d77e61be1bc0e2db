"""The worker cores as real Ray actors (placed by the `prefill` / `decode` custom resources):
the test plays the router's part — reserve on decode, submit to prefill, collect per-step
typed records (the first token reaches decode with the KV) — and gets one engine's greedy
output, leak-free."""

from __future__ import annotations

import time

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.request import SamplingParams
from kvtransfer.auth import new_secret
from worker.protocol import Key, Tokens
from worker.step_loop import WorkerOptions

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


def test_prefill_and_decode_actors_serve_greedy_requests(ray_session, model_path, make_engine, tokenizer):
    ray = ray_session
    from decode_worker.actor import DecodeActor
    from prefill_worker.actor import PrefillActor
    sp = SamplingParams(max_tokens=16, temperature=0)
    want = {f"r{i}": o.token_ids for i, o in enumerate(make_engine().generate(PROMPTS, sp))}
    cfg = EngineConfig(model=str(model_path), cache=CacheConfig(memory_gb=0.05),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512))
    opts = WorkerOptions(transport="zmq", key=new_secret())  # the KV plane authenticated, as in a cluster
    decode = DecodeActor.options(resources={"decode": 1}, num_cpus=0).remote(cfg, opts)
    prefill = PrefillActor.options(resources={"prefill": 1}, num_cpus=0).remote(cfg, opts)
    try:
        address = ray.get(decode.address.remote())
        ray.get(prefill.connect.remote(address))
        for rid, text in zip(want, PROMPTS):
            ids = tokenizer(text)["input_ids"]
            key = Key(rid, attempt=1)
            secret = ray.get(decode.reserve.remote(key, ids, sp))
            assert secret
            prefill.submit.remote(key, ids, sp, address, secret)
        first: dict[str, list[int]] = {}
        rest: dict[str, list[int]] = {rid: [] for rid in want}
        done: set[str] = set()
        deadline = time.monotonic() + 120
        while len(done) < len(want):
            assert time.monotonic() < deadline, "actors did not finish"
            for r in ray.get(prefill.poll.remote()):
                assert isinstance(r, Tokens) and r.key.attempt == 1, r
                assert r.finish == "prefilled" and r.start == 0 and len(r.tokens) == 1, r
                first[r.key.request_id] = r.tokens
            for r in ray.get(decode.poll.remote()):
                assert isinstance(r, Tokens) and r.key.attempt == 1, r
                assert r.start == 1 + len(rest[r.key.request_id])  # decode goes on after the first token
                rest[r.key.request_id] += r.tokens
                if r.finish:
                    done.add(r.key.request_id)
            time.sleep(0.01)
        assert {rid: first[rid] + rest[rid] for rid in want} == want
        end = time.monotonic() + 60  # hang guard only
        while ray.get(prefill.status.remote()).kv_blocks_used:  # acks may still be in flight
            assert time.monotonic() < end, "prefill blocks not released"
            time.sleep(0.05)
        assert ray.get(decode.status.remote()).kv_blocks_used == 0
    finally:
        for a in (prefill, decode):
            ray.get(a.shutdown.remote())
            ray.kill(a)
