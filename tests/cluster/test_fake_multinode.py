"""Autoscaling on Ray's fake multi-node cluster: pool actors ask for `prefill`/`decode`
resources that only worker node types advertise, so Ray's autoscaler adds and removes nodes of
the right type as the pool controller grows and drains the pools.

`AutoscalingCluster.start()`/`shutdown()` run `ray stop --force`, which stops every Ray process
on the machine: these tests carry the `ray_stop` marker and `make test` runs them in a pytest
process of their own, after the rest of the suite (see the Makefile).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.request import SamplingParams

pytestmark = pytest.mark.ray_stop

NODE_TYPES = {
    "prefill_node": {"resources": {"CPU": 1, "prefill": 1, "object_store_memory": 200 * 2**20},
                     "node_config": {}, "min_workers": 0, "max_workers": 2},
    "decode_node": {"resources": {"CPU": 1, "decode": 1, "object_store_memory": 200 * 2**20},
                    "node_config": {}, "min_workers": 0, "max_workers": 2},
}


def _fake_provider_config(head_resources: dict, worker_node_types: dict) -> dict:
    """The base config the installed Ray wheel would read from its missing example file."""
    types = dict(worker_node_types)
    types["ray.head.default"] = {"resources": head_resources, "node_config": {}, "max_workers": 0}
    return {"cluster_name": "pdserve-fake", "max_workers": 4, "upscaling_speed": 4.0,
            "idle_timeout_minutes": 0.05,  # 3 s: drained workers' nodes go away quickly
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "available_node_types": types, "head_node_type": "ray.head.default", "auth": {}, "docker": {},
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": []}


@pytest.fixture(scope="module")
def fake_cluster():
    from ray.cluster_utils import AutoscalingCluster

    class Cluster(AutoscalingCluster):
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **kw):
            return {**_fake_provider_config(head_resources, worker_node_types), **kw}

    bindir = os.path.dirname(sys.executable)  # the `ray` CLI of this venv
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    assert shutil.which("ray"), "the ray CLI is not installed next to this Python"
    deadline = time.monotonic() + 60  # Ray clusters of earlier test runs may still be exiting
    while (others := subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True).stdout.split()) \
            and time.monotonic() < deadline:
        time.sleep(1)
    if others:
        pytest.fail(f"other Ray processes are running ({len(others)}): this test would stop them "
                    "(`ray stop --force`); run it alone, as `make test` does")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(head_resources={"CPU": 2}, worker_node_types=NODE_TYPES)
    cluster.start(override_env={"RAY_AUTH_MODE": "disabled", "UCX_WARN_UNUSED_ENV_VARS": "n"})
    import ray
    ray.init("auto", log_to_driver=False)
    yield ray
    ray.shutdown()
    cluster.shutdown()


def node_counts(ray) -> dict[str, int]:
    alive = [n for n in ray.nodes() if n["Alive"]]
    return {r: sum(1 for n in alive if n["Resources"].get(r)) for r in ("prefill", "decode")}


SCENARIOS = {
    # Long prompts, short answers: prefill pressure (queued prompt tokens).
    "prompt-burst": dict(grows="prefill", prompt_tokens=400, n=6, max_tokens=4,
                         config={"decode.kv_cache_gb": 0.2, "autoscale.prefill.target_queued_tokens": 500}),
    # Short prompts, long answers on a small decode KV cache: decode pressure (admission waits).
    "long-answers": dict(grows="decode", prompt_tokens=12, n=4, max_tokens=120, config={"decode.kv_cache_gb": 0.01}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_pools_grow_new_nodes_of_their_type_and_give_them_back(fake_cluster, make_engine, scenario):
    ray = fake_cluster
    from pathlib import Path

    from router.client import collect, connect, make_request
    from router.app import BackgroundCluster
    from router.config import load_config
    sc = SCENARIOS[scenario]
    grows, stays = sc["grows"], "decode" if sc["grows"] == "prefill" else "prefill"
    cfg = load_config(Path(__file__).resolve().parents[2] / "deploy" / "local.yaml", {
        "metrics.port": 0, "prefill.kv_cache_gb": 0.1,
        "autoscale.enabled": True, "autoscale.interval_s": 0.3, "autoscale.window_s": 5.0,
        "autoscale.prefill.max_replicas": 2, "autoscale.prefill.up_delay_s": 1.0,
        "autoscale.prefill.down_delay_s": 3.0, "autoscale.prefill.target_ttft_ms": 1e7,
        "autoscale.decode.max_replicas": 2, "autoscale.decode.up_delay_s": 1.0,
        "autoscale.decode.down_delay_s": 3.0, "autoscale.decode.target_tpot_ms": 1e7, **sc["config"]})
    cluster = BackgroundCluster(cfg)  # its first actors make Ray add one node of each type
    try:
        # Only the head has no prefill/decode resource: each pool runs on a node of its type.
        assert node_counts(ray) == {"prefill": 1, "decode": 1}
        rng = random.Random(11)
        prompts = [[rng.randrange(100, 49000) for _ in range(sc["prompt_tokens"])] for _ in range(sc["n"])]
        sp = SamplingParams(max_tokens=sc["max_tokens"], temperature=0, ignore_eos=True)
        want = [o.token_ids for o in make_engine().generate(prompts, sp)]
        stub = connect(f"127.0.0.1:{cluster.port}")
        seen = {"prefill": 1, "decode": 1}
        done = []

        def watch_nodes():
            while not done:
                for r, k in node_counts(ray).items():
                    seen[r] = max(seen[r], k)
                time.sleep(0.5)
        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            watcher = pool.submit(watch_nodes)
            outs = list(pool.map(lambda ids: collect(stub.Generate(make_request(
                token_ids=ids, max_tokens=sp.max_tokens, temperature=0, ignore_eos=True))), prompts))
            deadline = time.monotonic() + 120  # the new worker's node may still be coming up
            while seen[grows] < 2:
                assert time.monotonic() < deadline, list(cluster.router.autoscaler.events)
                time.sleep(0.5)
            done.append(True)
            watcher.result()
        assert [o["token_ids"] for o in outs] == want
        assert seen[stays] == 1, list(cluster.router.autoscaler.events)
        # Load gone: the pool drains to its minimum and Ray removes the idle node.
        deadline = time.monotonic() + 180
        while node_counts(ray) != {"prefill": 1, "decode": 1} or len(cluster.router.pools.workers) != 2:
            assert time.monotonic() < deadline, (node_counts(ray), list(cluster.router.autoscaler.events))
            time.sleep(1)
        out = collect(stub.Generate(make_request(token_ids=prompts[0], max_tokens=sp.max_tokens, temperature=0,
                                                 ignore_eos=True)))
        assert out["token_ids"] == want[0]
    finally:
        cluster.stop()
    deadline = time.monotonic() + 120  # the next scenario starts from the head alone
    while node_counts(ray) != {"prefill": 0, "decode": 0}:
        assert time.monotonic() < deadline, node_counts(ray)
        time.sleep(1)
