"""Colocated mode end to end (decode workers also prefill), and admission: a full cluster
queues requests in a bounded queue and answers RESOURCE_EXHAUSTED beyond it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.client import collect, connect, make_request


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
        assert out["usage"]["prefill_placement"] == "colocated"
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


def test_prompts_sharing_a_prefix_go_where_it_is_cached(stub, cluster, hf_model, tokenizer, wait_idle):
    """Prefix-aware placement (router.prefix_aware, the default): with the worker that holds a
    long system prompt busy, a prefix-blind router sends the next prompt with that system
    prompt to the idle worker (more headroom); the aware one sends it where all but its
    question is cached, and the answer is still HF's."""
    import torch
    system = "You are a careful assistant who answers briefly and never makes things up. " * 16
    long_run = make_request(system + "Write a long story about the sea.", request_id="holder",
                            max_tokens=150, ignore_eos=True, temperature=0)
    hits_before = cluster.router.metrics.prefix_hit_tokens._value.get()
    holder = stub.Generate(long_run)
    next(holder)  # it runs (and holds the system prompt's blocks) while the question comes
    holder_worker = cluster.router.jobs["holder"].decode.worker_id
    question = system + "Question: what is the capital of France? Answer:"
    out = collect(stub.Generate(make_request(question, max_tokens=12, temperature=0)))
    ids = torch.tensor([tokenizer(question)["input_ids"]])
    with torch.inference_mode():
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert out["token_ids"] == ref[0, ids.shape[1]:].tolist()
    holder.cancel()
    u = out["usage"]
    # Computed the question only (and the system prompt's last, partial block)
    uncached = u["prompt_tokens"] - u["cached_prompt_tokens"]
    assert u["prefill_worker"] == holder_worker and uncached <= len(tokenizer(question[len(system):])["input_ids"]) + 16, u
    # the router's estimate for this request was the worker's actual hit (no other request ran meanwhile)
    assert cluster.router.metrics.prefix_hit_tokens._value.get() - hits_before == u["cached_prompt_tokens"]
    wait_idle(stub, cluster)


def test_a_stream_its_client_stops_reading_is_parked_and_resumes_identical_once_read(stub, cluster, wait_idle):
    """router.parking on a real worker: a gRPC stream whose client reads nothing after its first
    message (a 1 KiB window: the router's writes block) is aborted on its worker after
    ``front_door.park_unread_s`` (2 s) and placed nowhere while unread; read again, it goes on
    from where it was and ends with the undisturbed run's tokens, nothing held after."""
    req = dict(max_tokens=160, temperature=0, ignore_eos=True, logprobs=5)  # (~100 bytes a token)
    want = collect(stub.Generate(make_request("Once upon a time", **req)))["token_ids"]
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.port}", options=[("grpc.http2.lookahead_bytes", 1024),
                                                                          ("grpc.http2.bdp_probe", 0)])
    try:
        call = pb_grpc.GenerationStub(channel).Generate(make_request("Once upon a time", request_id="unread", **req))
        first = next(call)
        jobs = cluster.router.jobs
        deadline = time.monotonic() + 60  # a hang guard (parked 2 s after the writes block)
        while not (job := next(iter(jobs.values()), None)) or not (job.parks and job.decode is None):
            assert time.monotonic() < deadline, "never parked"
            time.sleep(0.05)
        streamed = len(job.generated)
        time.sleep(1.0)
        assert job.decode is None and len(job.generated) == streamed  # placed nowhere while unread
        got = list(first.token_ids) + collect(call)["token_ids"]
    finally:
        channel.close()
    assert got == want and job.parks >= 1 and job.failures == 0
    wait_idle(stub, cluster)
