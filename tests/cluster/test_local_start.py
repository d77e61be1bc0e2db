"""Starting on a private local Ray (router.app.start_local_ray, as `pdserve serve` without
--address does): the per-node model check (router.nodes.check_model, a Ray task in a new
process) is skipped, as the one node is this machine in this environment; on a Ray this process
did not start, it runs (tests/test_multinode.py: a node missing the model is named)."""

from __future__ import annotations

import os

from pdserve.v1 import pdserve_pb2 as pb


def test_a_local_start_runs_no_node_check_and_a_joined_ray_would(make_cluster, monkeypatch):
    import router.app as app
    from router.client import collect, connect, make_request
    calls = []

    def check_model(model, digest):
        calls.append(model)
        return []
    monkeypatch.setattr(app, "check_model", check_model)
    cluster = make_cluster(mode="colocated", decode__replicas=1, decode__kv_cache_gb=0.01)
    try:
        stub = connect(f"127.0.0.1:{cluster.port}")
        assert len(collect(stub.Generate(make_request("Hello", max_tokens=2, temperature=0)))["token_ids"]) == 2
        assert [w.state for w in stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers] == ["ready"]
    finally:
        cluster.stop()
    assert calls == []
    # The same Ray, had this process joined it by address: every node is checked.
    monkeypatch.setattr(app, "_own_ray", set())
    assert app._check_nodes()


def test_ray_workers_run_at_the_drivers_priority_not_rays_nice_15(ray_session):
    # (router.app.ACTOR_ENV: a worker process at nice 15 loses every core to the router and clients)
    @ray_session.remote(num_cpus=0)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)
    assert ray_session.get(niceness.remote(), timeout=120) == os.getpriority(os.PRIO_PROCESS, 0)
