"""The worker cores as real Ray actors (placed by the `prefill` / `decode` custom resources):
the test plays the router's part — reserve on decode, submit to prefill, collect per-step
typed records (the first token reaches decode with the KV) — and gets one engine's greedy
output, leak-free."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.request import SamplingParams
from kvtransfer.auth import new_secret
from worker.protocol import Key, Tokens
from worker.step_loop import WorkerOptions

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.mark.parametrize("transport,transfer_cpus", [("zmq", False), ("ucx", True)])
def test_prefill_and_decode_actors_serve_greedy_requests(ray_session, model_path, make_engine, tokenizer,
                                                         transport, transfer_cpus):
    """Real actors, KV authenticated as in a cluster; over UCX with ``prefill.transfer_cpus``
    (the last core): the prefill's forward threads keep off it, its transfer thread and UCX
    progress thread run on it, and the output is the same."""
    ray = ray_session
    from decode_worker.actor import DecodeActor
    from prefill_worker.actor import PrefillActor
    sp = SamplingParams(max_tokens=16, temperature=0)
    want = {f"r{i}": o.token_ids for i, o in enumerate(make_engine().generate(PROMPTS, sp))}
    cfg = EngineConfig(model=str(model_path), cache=CacheConfig(memory_gb=0.05),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512))
    opts = WorkerOptions(transport=transport, key=new_secret())  # the KV plane authenticated, as in a cluster
    last = max(os.sched_getaffinity(0))
    popts = dataclasses.replace(opts, transfer_cpus=(last,) if transfer_cpus else ())
    decode = DecodeActor.options(resources={"decode": 1}, num_cpus=0).remote(cfg, opts)
    prefill = PrefillActor.options(resources={"prefill": 1}, num_cpus=0).remote(cfg, popts)
    try:
        if transfer_cpus:
            def threads(self) -> dict[str, set[int]]:  # runs in the actor: its threads' cores
                import threading
                return {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                        if t.name in ("step-loop", "kv-stream", "ucx-progress")}
            cores = ray.get(prefill.__ray_call__.remote(threads))
            assert cores["kv-stream"] == cores["ucx-progress"] == {last}
            assert last not in cores["step-loop"] and cores["step-loop"]
        def onednn(self) -> list[str]:  # runs in the actor: its oneDNN cache sizes
            return [os.environ.get(v) for v in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")]
        from engine import ONEDNN_CACHE_ENTRIES, PREFILL_ONEDNN_CACHE_ENTRIES
        # The actors inherit this process's environment, engine defaults included: the prefill
        # actor's row counts are prompt lengths, so it runs with the small size (engine/__init__.py).
        assert ray.get(prefill.__ray_call__.remote(onednn)) == [str(PREFILL_ONEDNN_CACHE_ENTRIES)] * 2
        assert ray.get(decode.__ray_call__.remote(onednn)) == [str(ONEDNN_CACHE_ENTRIES)] * 2
        address = ray.get(decode.address.remote())
        ray.get(prefill.connect.remote(address))
        for rid, text in zip(want, PROMPTS):
            ids = tokenizer(text)["input_ids"]
            key = Key(rid, attempt=1)
            got = ray.get(decode.reserve.remote(key, ids, sp))
            assert got.secret  # (the KV plane is authenticated)
            prefill.prefill.remote(key, ids, sp, address, got)
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


def _wait(fn, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout  # hang guard only
    while not fn():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def test_the_clients_deadline_drops_a_request_on_the_worker_without_the_router(ray_session, model_path):
    """A reservation made with the client's deadline (timeout_s) is dropped by the worker when
    it passes, even though no abort ever comes (the router died, or its abort was lost); one
    without a deadline stays until released; release() answers how many blocks freed; and a
    worker whose cluster did not enable fault injection refuses inject()."""
    ray = ray_session
    from decode_worker.actor import DecodeActor
    cfg = EngineConfig(model=str(model_path), cache=CacheConfig(memory_gb=0.05),
                       scheduler=SchedulerConfig(max_num_batched_tokens=512))
    decode = DecodeActor.options(resources={"decode": 1}, num_cpus=0).remote(cfg, WorkerOptions(transport="zmq"))
    try:
        sp = SamplingParams(max_tokens=8)
        ids = list(range(100, 140))
        assert ray.get(decode.reserve.remote(Key("soon"), ids, sp, 0.3)) is not None
        assert ray.get(decode.reserve.remote(Key("never"), ids, sp)) is not None
        held = ray.get(decode.held.remote())
        assert set(held) == {Key("soon").engine_id, Key("never").engine_id}
        _wait(lambda: set(ray.get(decode.held.remote())) == {Key("never").engine_id}, "deadline not applied")
        time.sleep(0.5)  # the other one has no deadline: it stays
        assert set(ray.get(decode.held.remote())) == {Key("never").engine_id}
        assert ray.get(decode.release.remote([Key("never").engine_id, "unknown#0"])) == held[Key("never").engine_id]
        assert ray.get(decode.held.remote()) == {} and ray.get(decode.status.remote()).kv_blocks_used == 0
        # A prompt the router sends here to prefill because it believes the prefix is cached
        # (max_uncached): taken only if it is; refused, nothing is held.
        fresh = list(range(200, 260))  # 60 tokens: 3 full blocks of 16 before its last
        assert ray.get(decode.submit.remote(Key("miss"), fresh, sp, None, 16)) is False
        assert ray.get(decode.held.remote()) == {}
        assert ray.get(decode.submit.remote(Key("cold"), fresh, sp, None, len(fresh))) is True
        _wait(lambda: not ray.get(decode.held.remote()), "the local request did not finish")
        assert ray.get(decode.submit.remote(Key("hit"), fresh, sp, None, 16)) is True  # 12 uncached now
        _wait(lambda: not ray.get(decode.held.remote()), "the local request did not finish")
        with pytest.raises(ray.exceptions.RayTaskError, match="fault injection is off"):
            ray.get(decode.inject.remote("drop"))
    finally:
        ray.get(decode.shutdown.remote())
        ray.kill(decode)
