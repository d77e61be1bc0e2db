"""The worker cores as real Ray actors (placed by the `prefill` / `decode` custom resources):
the test plays the router's part — reserve on decode, submit to prefill, relay the first
token, collect per-step token batches — and gets one engine's greedy output, leak-free."""

from __future__ import annotations

import time

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.request import SamplingParams
from engine.step_loop import WorkerOptions

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


def test_prefill_and_decode_actors_serve_greedy_requests(ray_session, model_path, make_engine, tokenizer):
    ray = ray_session
    from decode_worker.actor import DecodeActor
    from prefill_worker.actor import PrefillActor
    sp = SamplingParams(max_tokens=16, temperature=0)
    want = {f"r{i}": o.token_ids for i, o in enumerate(make_engine().generate(PROMPTS, sp))}
    cfg = EngineConfig(model=str(model_path), cache=CacheConfig(memory_gb=0.05),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512))
    decode = DecodeActor.options(resources={"decode": 1}, num_cpus=0).remote(cfg, WorkerOptions(transport="zmq"))
    prefill = PrefillActor.options(resources={"prefill": 1}, num_cpus=0).remote(cfg, WorkerOptions(transport="zmq"))
    try:
        address = ray.get(decode.address.remote())
        ray.get(prefill.connect.remote(address))
        for rid, text in zip(want, PROMPTS):
            ids = tokenizer(text)["input_ids"]
            assert ray.get(decode.reserve.remote(rid, ids, sp))
            prefill.submit.remote(rid, ids, sp, address)
        tokens: dict[str, list[int]] = {}
        done: set[str] = set()
        deadline = time.monotonic() + 120
        while len(done) < len(want):
            assert time.monotonic() < deadline, "actors did not finish"
            for r in ray.get(prefill.poll.remote()):
                assert r["finish"] == "prefilled" and len(r["tokens"]) == 1, r
                tokens[r["id"]] = list(r["tokens"])
                decode.first_token.remote(r["id"], r["tokens"][0])
            for r in ray.get(decode.poll.remote()):
                assert r["finish"] != "error", r
                tokens[r["id"]] += r["tokens"]
                if r["finish"]:
                    done.add(r["id"])
            time.sleep(0.01)
        assert tokens == want
        end = time.monotonic() + 60  # hang guard only
        while ray.get(prefill.status.remote())["kv_blocks_used"]:  # acks may still be in flight
            assert time.monotonic() < end, "prefill blocks not released"
            time.sleep(0.05)
        assert ray.get(decode.status.remote())["kv_blocks_used"] == 0
    finally:
        for a in (prefill, decode):
            ray.get(a.shutdown.remote())
            ray.kill(a)
