"""mode: adaptive end to end: two adaptive Ray actors (one begins as prefill, one as decode),
KV over UCX, gRPC on a real socket, the real model. Their roles are switched while requests
run, through the router's own switch path (the controller's policy is tested on synthetic
traces in tests/router/test_roles.py), and once by the controller itself while a stream runs:
greedy outputs equal HF's before, during and after, the same processes serve in their new
roles, what a worker's prefix cache held serves it in the new role, and no block is left
anywhere: none held once idle, and none freed by the leak sweep (a leak it cleaned up within
``wait_idle``'s time would otherwise pass)."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.client import collect, connect, make_request


@pytest.fixture(scope="module")
def cluster(make_cluster):
    # The controller never acts on its own here (switch_delay_s): the test switches.
    return make_cluster(mode="adaptive", prefill__replicas=1, decode__replicas=1, decode__kv_cache_gb=0.1,
                        kv_transfer__transport="ucx", kv_transfer__lease_s=10.0, router__stall_s=15.0,
                        roles__switch_delay_s=3600.0)


@pytest.fixture(scope="module")
def stub(cluster):
    return connect(f"127.0.0.1:{cluster.port}")


def _roles(stub) -> dict[str, tuple[str, str, int]]:
    return {w.worker_id: (w.role, w.state, w.restarts)
            for w in stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers}


def _switch(cluster, worker_id: str, old: str, new: str) -> None:
    async def switch():
        assert cluster.router.roles_controller.switch(old, new, "test", worker_id) is not None
    cluster.call(switch)


def _no_block_swept(cluster) -> None:
    """The leak sweep (router.sweep) freed nothing: every block was freed by its own path."""
    assert cluster.router.metrics.swept_blocks._value.get() == 0


def _wait_role(stub, worker_id: str, role: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # hang guard only: it returns once switched
    while _roles(stub)[worker_id][:2] != (role, "ready"):
        assert time.monotonic() < deadline, _roles(stub)
        time.sleep(0.05)


def test_roles_switch_under_load_without_a_restart_and_outputs_match_hf(stub, cluster, greedy_reference,
                                                                        wait_idle, tokenizer):
    assert {r[:2] for r in _roles(stub).values()} == {("prefill", "ready"), ("decode", "ready")}
    first = {r[0]: wid for wid, r in _roles(stub).items()}  # role -> worker
    prompt, ref = max(greedy_reference, key=lambda pr: len(tokenizer(pr[0])["input_ids"]))
    out = collect(stub.Generate(make_request(prompt, max_tokens=64, temperature=0)))
    assert out["token_ids"] == ref
    assert (out["usage"]["prefill_worker"], out["usage"]["decode_worker"]) == (first["prefill"], first["decode"])
    switches = cluster.router.metrics.role_switches

    requests = [make_request(p, max_tokens=64, temperature=0) for p, _ in greedy_reference] * 2
    with ThreadPoolExecutor(len(requests)) as pool:
        running = [pool.submit(lambda r=r: collect(stub.Generate(r))) for r in requests]
        time.sleep(1.0)  # some are decoding, some prefilling, some wait
        # The decode worker becomes a prefill worker: it takes no new stream and finishes its
        # own first; meanwhile nobody decodes and new requests wait for admission.
        _switch(cluster, first["decode"], "decode", "prefill")
        _wait_role(stub, first["decode"], "prefill")
        _switch(cluster, first["prefill"], "prefill", "decode")
        outs = [f.result(timeout=600) for f in running]
    for out, (_, ref_i) in zip(outs, greedy_reference * 2):
        assert out["token_ids"] == ref_i
    _wait_role(stub, first["prefill"], "decode")
    assert switches.labels("prefill")._value.get() == switches.labels("decode")._value.get() == 1
    assert all(r[2] == 0 for r in _roles(stub).values())  # the same processes: no restart

    # In the new roles KV goes the other way; the new decode worker prefilled this prompt
    # before: its cache still holds it, so only the part after it is transferred.
    counted = cluster.router.metrics.decode_prefix_tokens
    before = counted._value.get()
    out = collect(stub.Generate(make_request(prompt, max_tokens=64, temperature=0)))
    assert out["token_ids"] == ref
    assert (out["usage"]["prefill_worker"], out["usage"]["decode_worker"]) == (first["decode"], first["prefill"])
    n, bs = len(tokenizer(prompt)["input_ids"]), 16  # (the engine's default block size)
    assert counted._value.get() - before == (n - 1) // bs * bs > 0
    wait_idle(stub, cluster)
    _no_block_swept(cluster)


def test_with_no_prefill_worker_left_decode_workers_prefill_their_own(stub, cluster, greedy_reference, wait_idle):
    """roles.min_prefill 0 lets the last prefill worker decode: every prompt is then
    prefilled by its own decode worker (``local:no_pool``) until one switches back."""
    prefill = next(wid for wid, r in _roles(stub).items() if r[0] == "prefill")
    _switch(cluster, prefill, "prefill", "decode")
    _wait_role(stub, prefill, "decode")
    requests = [make_request(p, max_tokens=64, temperature=0) for p, _ in greedy_reference]
    with ThreadPoolExecutor(len(requests)) as pool:
        outs = list(pool.map(lambda r: collect(stub.Generate(r)), requests))
    for out, (_, ref) in zip(outs, greedy_reference):
        assert out["token_ids"] == ref
        assert out["usage"]["prefill_placement"] == "local:no_pool"
        assert out["usage"]["prefill_worker"] == out["usage"]["decode_worker"]
    assert len({o["usage"]["decode_worker"] for o in outs}) == 2  # both decode now
    _switch(cluster, prefill, "decode", "prefill")
    _wait_role(stub, prefill, "prefill")
    out = collect(stub.Generate(make_request(greedy_reference[0][0], max_tokens=64, temperature=0)))
    assert out["token_ids"] == greedy_reference[0][1] and out["usage"]["prefill_worker"] == prefill
    wait_idle(stub, cluster)
    _no_block_swept(cluster)


def test_a_stream_spans_a_switch_the_controller_makes(stub, cluster, greedy_reference, wait_idle):
    """The controller, not the test, switches: decode's TPOT over its target while a prefill
    pool takes the prompts (router.roles) moves the prefill worker to decode while a stream
    runs on the decode worker; the stream goes on through the switch, equal to HF's."""
    ctl = cluster.router.roles_controller
    cfg, targets = ctl.cfg, ctl.autoscale
    prefill = next(wid for wid, r in _roles(stub).items() if r[0] == "prefill")
    prompt, ref = next((p, r) for p, r in greedy_reference if len(r) == 64)  # (no EOS in it)

    def configure(roles, autoscale):
        async def set_them():
            ctl.cfg, ctl.autoscale = roles, autoscale
        cluster.call(set_them)
    # Any stream's pace is over a 1 us target; the 1 s window drops the earlier tests' latencies,
    # so the want is this stream's (from its 16th token: router.autoscale.LIVE_MIN_TOKENS)
    configure(dataclasses.replace(cfg, interval_s=0.1, switch_delay_s=0.3, min_prefill=0),
              dataclasses.replace(targets, window_s=1.0,
                                  decode=dataclasses.replace(targets.decode, target_tpot_ms=0.001)))
    try:
        with ThreadPoolExecutor(1) as pool:
            began = time.time()
            running = pool.submit(lambda: collect(stub.Generate(
                make_request(prompt, max_tokens=256, ignore_eos=True, temperature=0))))
            _wait_role(stub, prefill, "decode")  # the controller's switch, done
            assert not running.done()  # ... while the stream still ran
            out = running.result(timeout=300)
    finally:
        configure(cfg, targets)
    when, wid, old, new, why = ctl.switches[-1]
    assert (wid, old, new) == (prefill, "prefill", "decode") and why.startswith("decode: TPOT p90")
    assert began < when and out["usage"]["decode_worker"] != prefill
    assert out["token_ids"][:64] == ref and len(out["token_ids"]) == 256
    _switch(cluster, prefill, "decode", "prefill")  # (back, for whatever runs next)
    _wait_role(stub, prefill, "prefill")
    wait_idle(stub, cluster)
    _no_block_swept(cluster)
