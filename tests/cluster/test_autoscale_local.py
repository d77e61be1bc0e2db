"""Autoscaling on one machine (actors only): each pool grows by its own signal, shrinks back
by draining once the load stops, and every request completes with the same greedy output."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor


from engine.request import SamplingParams
from pdserve.v1 import pdserve_pb2 as pb
from router.client import collect, connect, make_request

FAST = {"autoscale__enabled": True, "autoscale__interval_s": 0.3, "autoscale__window_s": 5.0,
        "autoscale__prefill__max_replicas": 2, "autoscale__prefill__up_delay_s": 1.0,
        "autoscale__prefill__down_delay_s": 3.0, "autoscale__prefill__target_ttft_ms": 1e7,
        "autoscale__decode__max_replicas": 2, "autoscale__decode__up_delay_s": 1.0,
        "autoscale__decode__down_delay_s": 3.0, "autoscale__decode__target_tpot_ms": 1e7,
        "prefill__kv_cache_gb": 0.1, "kv_transfer__transport": "ucx"}


class PoolWatch:
    """Largest pool sizes seen (ready or starting workers per role) while the load runs."""

    def __init__(self, stub):
        self.stub, self.max = stub, {"prefill": 0, "decode": 0}
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def sizes(self):
        ws = self.stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers
        return {r: sum(1 for w in ws if w.role == r and w.state in ("ready", "starting")) for r in self.max}

    def _run(self):
        while self.running:
            for r, n in self.sizes().items():
                self.max[r] = max(self.max[r], n)
            time.sleep(0.1)

    def stop(self):
        self.running = False
        self.thread.join()


def wait_for_min(stub, cluster, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        ws = stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers
        if len(ws) == 2 and all(w.state == "ready" and w.kv_blocks_used == 0 for w in ws) and not cluster.router.jobs:
            return ws
        assert time.monotonic() < deadline, f"pools did not return to their minimum: {ws}"
        time.sleep(0.2)


def scale_and_check(cluster, prompts, params: SamplingParams, want, grows: str, stays: str) -> None:
    """Run ``prompts`` at once; outputs must equal ``want``; pool ``grows`` reaches 2 workers
    while ``stays`` keeps 1; afterwards both drain back to 1, with no leaked block."""
    stub = connect(f"127.0.0.1:{cluster.port}")
    watch = PoolWatch(stub)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: collect(stub.Generate(make_request(
            token_ids=ids, max_tokens=params.max_tokens, temperature=0, ignore_eos=params.ignore_eos))), prompts))
    watch.stop()
    assert [o["token_ids"] for o in outs] == want
    assert watch.max == {grows: 2, stays: 1}, cluster.router.autoscaler.events
    wait_for_min(stub, cluster)
    events = list(stub.GetClusterStatus(pb.GetClusterStatusRequest()).autoscale_events)
    assert any(f"{grows} +1" in e for e in events) and any(f"{grows} -1" in e for e in events)
    assert not any(e.split()[1] == stays for e in events), events
    cluster.stop()


def test_long_prompts_grow_prefill_not_decode_then_both_shrink(make_cluster, make_engine):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49000) for _ in range(400)] for _ in range(6)]
    sp = SamplingParams(max_tokens=4, temperature=0)
    want = [o.token_ids for o in make_engine().generate(prompts, sp)]
    cluster = make_cluster(**FAST, decode__kv_cache_gb=0.2, autoscale__prefill__target_queued_tokens=500)
    scale_and_check(cluster, prompts, sp, want, grows="prefill", stays="decode")


def test_long_answers_grow_decode_not_prefill_then_both_shrink(make_cluster, make_engine):
    rng = random.Random(8)
    prompts = [[rng.randrange(100, 49000) for _ in range(12)] for _ in range(4)]
    sp = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in make_engine().generate(prompts, sp)]
    # A tiny decode KV cache (about 224 tokens): one such request fills a decode worker.
    cluster = make_cluster(**FAST, decode__kv_cache_gb=0.01)
    scale_and_check(cluster, prompts, sp, want, grows="decode", stays="prefill")
