"""Preemption on a real cluster (router.preempt): one colocated worker whose KV one long
low-priority request fills; a high-priority request then preempts it, is served, and the
low-priority stream completes token-identical to an undisturbed greedy run, with no block held."""

from __future__ import annotations

import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.client import collect, connect, make_request

TOKENS = {"admin": "admin-" + "a" * 26, "batch": "batch-" + "b" * 26, "alice": "alice-" + "c" * 26}
POLICY = "tokens:\n  alice: {priority: high}\n  batch: {priority: low}\n"
PROMPT = "Count slowly from one to one hundred, one number per line:"


@pytest.fixture(scope="module")
def cluster(make_cluster, tmp_path_factory):
    d = tmp_path_factory.mktemp("door")
    (d / "tokens").write_text("".join(f"{t} {name}\n" for name, t in TOKENS.items()))
    (d / "policy.yaml").write_text(POLICY)
    # 0.01 GiB: a few hundred tokens of KV (and of context): one long request fills it
    return make_cluster(mode="colocated", decode__replicas=1, decode__kv_cache_gb=0.01,
                        security__tokens_file=str(d / "tokens"), security__policy_file=str(d / "policy.yaml"))


def _stub(cluster, name: str):
    return connect(f"127.0.0.1:{cluster.port}", token=TOKENS[name])


def test_a_high_request_preempts_a_low_decode_that_resumes_token_identical(cluster, tokenizer, wait_idle):
    admin, batch, alice = (_stub(cluster, n) for n in ("admin", "batch", "alice"))
    ids = tokenizer(PROMPT)["input_ids"]
    ctx = admin.GetModelInfo(pb.GetModelInfoRequest()).context_length
    # prompt + max_tokens is all of the worker's KV but a few tokens: nothing else fits beside it
    low = dict(token_ids=ids, max_tokens=ctx - len(ids) - 4, temperature=0, ignore_eos=True)
    reference = collect(batch.Generate(make_request(request_id="undisturbed", **low)))
    wait_idle(admin, cluster)

    call = batch.Generate(make_request(request_id="low", **low))
    first = [next(call) for _ in range(4)]  # it decodes, holding (and promised) the whole cache
    high = collect(alice.Generate(make_request("Hi", request_id="high", max_tokens=8, temperature=0)))
    assert high["finish_reason"] == "length" and len(high["token_ids"]) == 8  # served
    rest = collect(call)
    got = [t for r in first for t in r.token_ids] + rest["token_ids"]
    assert got == reference["token_ids"]  # one stream: nothing repeated, nothing lost, same tokens
    assert "".join(r.text for r in first) + rest["text"] == reference["text"]
    assert rest["finish_reason"] == "length"
    stats = cluster.router.admission.stats()
    assert stats["batch"].preempted == 1 and stats["alice"].preempted == 0
    wait_idle(admin, cluster)  # no block held anywhere, no request left
