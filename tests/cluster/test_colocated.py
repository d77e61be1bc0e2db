"""Colocated mode end to end (decode workers also prefill), and admission: a full cluster
queues requests in a bounded queue and answers RESOURCE_EXHAUSTED beyond it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cli.client import collect, connect, make_request
from pdserve.v1 import pdserve_pb2 as pb


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(mode="colocated", decode__replicas=2, decode__kv_cache_gb=0.05,
                        decode__max_batched_tokens=256, router__max_queue=1)


@pytest.fixture(scope="module")
def stub(cluster):
    return connect(f"127.0.0.1:{cluster.port}")


def test_colocated_greedy_requests_match_hf(stub, cluster, greedy_reference, wait_idle):
    with ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(lambda p: collect(stub.Generate(make_request(p, max_tokens=64, temperature=0))),
                             [p for p, _ in greedy_reference]))
    for out, (_, ref) in zip(outs, greedy_reference):
        assert out["token_ids"] == ref
        assert out["usage"]["prefill_worker"] == out["usage"]["decode_worker"]  # one worker did both
    roles = {w.role for w in stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers}
    assert roles == {"colocated"}
    wait_idle(stub, cluster)


def test_full_cluster_queues_then_refuses_with_resource_exhausted(stub, cluster, wait_idle):
    ctx = stub.GetModelInfo(pb.GetModelInfoRequest()).context_length
    # Each of these reserves (almost) a whole worker's KV: two fill the cluster.
    big = dict(max_tokens=ctx - 16, ignore_eos=True)
    calls = [stub.Generate(make_request("Count to a million:", request_id=f"big{i}", **big)) for i in range(2)]
    for c in calls:
        next(c)
    queued = stub.Generate(make_request("Hello", max_tokens=4, request_id="queued"))
    # A guard against a hang, not a speed claim: the router admits it within one event-loop turn,
    # but both workers decode flat out on a 2-core box, and a slow one starved the loop past 10 s.
    deadline = time.monotonic() + 120
    while cluster.router.queued < 1:  # it waits in the admission queue (its one slot)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as e:
        collect(stub.Generate(make_request("Hello", max_tokens=4)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.value.details()
    calls[0].cancel()  # room again: the queued request runs to completion
    assert collect(queued)["finish_reason"] == "length"
    calls[1].cancel()
    wait_idle(stub, cluster)
