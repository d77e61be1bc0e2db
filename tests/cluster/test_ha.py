"""ha.enabled end to end (router.ha, worker.fence): workers outlive their router; the next
router adopts the same processes (no model reload) and serves the same greedy answers; the
router before is fenced off; a worker left without a router frees everything after its grace
period; streams in flight through a lost router complete on the next, token-identical
(router.resume). Real Ray actors, real gRPC, KV over UCX; one Ray for the module (the session's), which
the ``pdserve serve`` processes of the SIGKILL test join.

In-process, a router "dies" by abandonment (``abandon``): its event loop halts with every task
and server on it, nothing cleaned up, so it calls no worker again, aborts nothing and ends none
(as a SIGKILLed or SIGSTOPped process would).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.admin import scoped_id
from router.client import collect, connect, make_request, stream
from tests.cluster.conftest import CONFIG

GRACE_S = 2.0  # the grace period the fencing test's second router sets (the default here: longer than a router's start)
PROMPTS = ["The capital of France is", "Q: What is 17 times 3?\nA:"]
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"  # (the resume test's tokens file)
RESUME_S, RESUME_TOKENS = 5.0, 64  # its routers' ha.resume_s; its streams' length


def abandon(c) -> None:
    """Halt the router's loop mid-flight, leaving its (detached) workers running."""
    c.loop.call_soon_threadsafe(c.loop.stop)
    c.thread.join(timeout=10)
    c.stopped = True  # (nothing left to stop: its workers belong to the next router)


@pytest.fixture(scope="module")
def cluster_name(ray_session):
    """The module's HA cluster (each test's routers adopt the workers the test before left, or
    start them); every worker of it is ended after the module."""
    from router import ha, leader
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    for handle in ha.find_workers(name).values():  # (any left by an abandoned last router)
        ray_session.kill(handle, no_restart=True)
    with contextlib.suppress(ValueError):  # the leader lease of the ``pdserve serve`` processes (router.leader)
        ray_session.kill(ray_session.get_actor(leader.lease_name(name), namespace=ha.NAMESPACE), no_restart=True)


@pytest.fixture(scope="module")
def ha_cluster(cluster_name):
    """``start()``: an in-process router of the module's HA cluster, as many as asked."""
    from router.app import BackgroundCluster
    from router.config import load_config
    name = cluster_name

    def start(grace_s: float = 60.0, port: int = 0, http_port: int | None = None, **config):
        """``config``: more config keys (``{"ha.resume_s": 5}``); ``http_port``: 0 a free one, None off."""
        cfg = load_config(CONFIG, {"mode": "disaggregated", "prefill.replicas": 1, "decode.replicas": 1,
                                   "decode.kv_cache_gb": 0.05, "prefill.kv_cache_gb": 0.05, "metrics.port": 0,
                                   "router.http_port": None, "ha.enabled": True, "ha.cluster_name": name,
                                   "ha.grace_s": grace_s, **config})
        return BackgroundCluster(cfg, port=port, http_port=http_port)

    start.cluster_name = name
    return start


def _greedy(stub) -> list[list[int]]:
    return [collect(stub.Generate(make_request(p, max_tokens=16, temperature=0)))["token_ids"] for p in PROMPTS]


def _hold(stub, rid: str, max_tokens: int | None = None):
    """A generation far longer than the tests (unless ``max_tokens``), running (its first tokens
    came): the worker holds its blocks."""
    ctx = stub.GetModelInfo(pb.GetModelInfoRequest()).context_length
    call = stub.Generate(make_request("Count to a million:", request_id=rid, max_tokens=max_tokens or ctx - 16,
                                      ignore_eos=True))
    next(call)
    return call


def test_epochs_are_taken_once_each_and_only_grow_and_the_key_is_the_first_routers(ray_session):
    from concurrent.futures import ThreadPoolExecutor

    from router import ha
    name = f"epochs-{uuid.uuid4().hex[:8]}"
    assert ha.current_epoch(name) == 0
    with ThreadPoolExecutor(4) as pool:  # routers starting at once
        taken = list(pool.map(lambda _: ha.next_epoch(name), range(12)))
    assert sorted(taken) == list(range(1, 13)) and ha.current_epoch(name) == 12
    assert ha.next_epoch(name) == 13
    key = ha.cluster_key(name)
    assert len(key) >= 16 and ha.cluster_key(name) == key
    assert ha.may_kill(name, 13) and not ha.may_kill(name, 12)


def test_an_older_router_is_fenced_off_and_a_worker_alone_frees_everything_after_the_grace_period(ha_cluster):
    import ray
    from ray.exceptions import RayTaskError

    from router import ha
    from worker.fence import FencedError
    from worker.protocol import RouterLink
    a = ha_cluster()
    abandon(a)
    b = ha_cluster(grace_s=GRACE_S)  # the same cluster name: it adopts A's workers
    assert b.router.pools.epoch > a.router.pools.epoch
    stub = connect(f"127.0.0.1:{b.port}")

    # Router A is fenced off: its calls and its adoption are refused (a typed error), it kills nothing.
    old = a.router.pools.workers["decode-0"].actor
    for ref in (old.status.remote(), old.adopt(RouterLink("tcp://127.0.0.1:9", "decode-0"), 60.0)):
        with pytest.raises(RayTaskError) as e:
            ray.get(ref, timeout=30)
        assert isinstance(e.value.cause, FencedError) and e.value.cause.current == b.router.pools.epoch
    assert not a.router.pools.liveness.may_kill()

    # B dies while a request runs; no router calls for GRACE_S: the workers drop everything.
    held = _hold(stub, "held-by-b")
    abandon(b)
    held.cancel()
    name = ha_cluster.cluster_name
    workers = ha.find_workers(name)
    assert sorted(workers) == ["decode-0", "prefill-0"]  # no router, and still running: waiting to be adopted
    time.sleep(GRACE_S + 2)
    # A later router's adoption shows what each holds: nothing (not even the running request).
    epoch = ha.next_epoch(name)
    for wid, handle in workers.items():
        got = ray.get(handle.adopt.remote(epoch, RouterLink("tcp://127.0.0.1:9", wid), 60.0), timeout=30)
        assert (got.requests, got.kv_blocks_used) == ({}, 0), wid


def test_streams_survive_their_router_resumed_token_identical(ha_cluster, tmp_path):
    """Streams that resume (router.resume): the router is lost while greedy streams run (its
    clients reach it through proxies that drop every connection at once, as a SIGKILL would);
    the next router adopts the workers, keeps what they decode, and every stream completes
    token-identical to its undisturbed run: gRPC through the client library's Resume (or, for
    one not handed over, its Generate again less what it delivered), HTTP by a retry with the
    same Idempotency-Key. Another token's Resume finds nothing; a request no client resumes is
    aborted after ha.resume_s, and no block is left held."""
    from tests.cluster.resume_clients import Proxy, free_port, http_retrying, http_stream
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
    config = {"security.tokens_file": str(tokens), "ha.resume_s": RESUME_S}
    a = ha_cluster(http_port=0, **config)  # (adopts the workers the test before left: no model load)
    # gRPC streams (the last with logprobs: not handed over, so the client sends it again and
    # drops what it delivered), then an HTTP stream and a whole HTTP answer
    reqs = [make_request(p, request_id=f"stream-{i}", max_tokens=RESUME_TOKENS, temperature=0, ignore_eos=True,
                         logprobs=1 if i == len(PROMPTS) else None) for i, p in enumerate([*PROMPTS, PROMPTS[1]])]
    n = len(reqs)
    plain, want = connect(f"127.0.0.1:{a.port}", token=ALICE), {}
    runs = [threading.Thread(target=lambda i=i: want.__setitem__(i, collect(plain.Generate(reqs[i]))))
            for i in range(n)]
    for k, streamed in ((n, True), (n + 1, False)):  # (HTTP: a stream, and a whole answer)
        runs.append(threading.Thread(target=lambda k=k, streamed=streamed: want.__setitem__(k, http_stream(
            a.http_port, ALICE, PROMPTS[0], RESUME_TOKENS, key=f"undisturbed-{k}", stream=streamed))))
    _all(runs)  # (undisturbed)

    grpc_proxy, http_proxy = Proxy(a.port), Proxy(a.http_port)
    port_b, http_b = free_port(), free_port()
    stub = connect(f"127.0.0.1:{grpc_proxy.port},127.0.0.1:{port_b}", token=ALICE)
    seen, got = [0] * (n + 1), {}  # responses each stream delivered; what each delivered in all

    def count(i: int):
        return lambda *_: seen.__setitem__(i, seen[i] + 1)
    runs = [threading.Thread(target=lambda i=i: got.__setitem__(i, collect(stream(stub, reqs[i]), count(i))))
            for i in range(n)]
    for k, streamed in ((n, True), (n + 1, False)):
        runs.append(threading.Thread(target=lambda k=k, streamed=streamed: got.__setitem__(k, http_retrying(
            [http_proxy.port, http_b], ALICE, PROMPTS[0], RESUME_TOKENS, key=f"retry-{k}", stream=streamed,
            on_chunk=count(n)))))
    for t in runs:
        t.start()
    held = _hold(stub, "held", max_tokens=RESUME_TOKENS * 4)  # its client gives up with the router
    # a later message too: its first token can be the prefill's, with its KV still in transit, and
    # such a request is not handed over (router.resume); under make test's load the router was once
    # lost just then and the new one found nothing
    next(held)
    deadline = time.monotonic() + 60
    def whole_has_tokens() -> bool:  # (the whole answer shows nothing before its end: ask the router)
        job = a.router.job("alice", f"cmpl-retry-{n + 1}-0")
        return job is not None and len(job.generated) >= 2
    while min(seen) < 2 or not whole_has_tokens():  # every one has tokens: the router is lost mid-stream
        assert time.monotonic() < deadline and all(t.is_alive() for t in runs), (seen, got)
        time.sleep(0.01)
    abandon(a)
    grpc_proxy.close()
    http_proxy.close()
    held.cancel()
    b = ha_cluster(port=port_b, http_port=http_b, **config)
    try:
        resumable = b.router.resumable
        assert resumable.find(scoped_id("alice", "held")) is not None
        with pytest.raises(grpc.RpcError) as e:  # Bob asks for Alice's by its id: as absent as one never seen
            next(connect(f"127.0.0.1:{port_b}", token=BOB).Resume(pb.ResumeRequest(request_id="held")))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        _all(runs, start=False)
        for i in range(n):  # token-identical, text too
            assert (got[i]["token_ids"], got[i]["text"], got[i]["finish_reason"], got[i]["request_id"]) == \
                (want[i]["token_ids"], want[i]["text"], "length", f"stream-{i}"), i
        assert len(want[0]["token_ids"]) == RESUME_TOKENS and (got[n], got[n + 1]) == (want[n], want[n + 1])
        assert want[n] == want[n + 1]  # (HTTP: the same completion, streamed or whole)
        # every other stream attached to the job rebuilt from its worker (none ran again from its prompt)
        # (less those rebuilt after they ended on their worker lately: the undisturbed runs')
        assert (resumable.rebuilt - resumable.ended, resumable.attached) == (n + 2, n + 1), vars(resumable)
        deadline = time.monotonic() + RESUME_S + 10  # the unclaimed one is aborted: no block held anywhere
        while any(w.status.kv_blocks_used for w in b.router.pools.workers.values()):
            assert time.monotonic() < deadline, "the request nobody resumed still holds blocks"
            time.sleep(0.1)
        assert resumable.expired == 1 and not any(b.call(b.router.sweeper.stranded).values())
    finally:
        abandon(b)  # (its workers are left to the next test's routers: no model load there)


def _all(threads: list[threading.Thread], start: bool = True) -> None:
    for t in threads if start else ():
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stream did not end"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(config, gcs: str, log):
    """``pdserve serve`` in its own process joined to this module's Ray; returns (process, stub) once it serves."""
    import subprocess
    import sys

    import grpc
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", "serve", "--config",
                             str(config), "--address", gcs, "--port", str(port)], stdout=log, stderr=log)
    stub = connect(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "pdserve serve exited"
        try:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=1)
            return proc, stub
        except grpc.RpcError:
            assert time.monotonic() < deadline, "pdserve serve did not start in 180 s"
            time.sleep(0.5)


def _worker_pids(name: str) -> dict[str, int]:
    """The pids of the cluster's named workers (asked as the newest router: its epoch)."""
    import ray

    from router import ha
    epoch = ha.current_epoch(name)
    return {wid: ray.get(h.call.remote(epoch, "status"), timeout=30).pid for wid, h in ha.find_workers(name).items()}


def test_sigkill_of_pdserve_serve_then_a_second_one_adopts_the_same_processes(ray_session, cluster_name, tmp_path):
    """The real thing: ``pdserve serve`` processes (the first adopts what the test before left,
    or starts the workers). It is SIGKILLed while a request runs; the second (same cluster
    name) adopts the same worker processes and answers the same; its clean stop (SIGTERM) ends
    the workers."""
    import signal

    import yaml

    from router import ha
    name = cluster_name
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "disaggregated", "prefill": {"replicas": 1, "kv_cache_gb": 0.05},
        "decode": {"replicas": 1, "kv_cache_gb": 0.05}, "router": {"http_port": None},
        # (resume_s 0: the first router's request is aborted at adoption, as a router does that
        # resumes nothing; tests/cluster/test_resume.py resumes them)
        "metrics": {"port": 0}, "ha": {"enabled": True, "cluster_name": name, "grace_s": 60.0, "resume_s": 0}}))
    gcs = ray_session.get_runtime_context().gcs_address
    with open(tmp_path / "serve.log", "w") as log:
        first, stub = _serve(config, gcs, log)
        try:
            before, pids = _greedy(stub), _worker_pids(name)
            held = _hold(stub, "held-by-first")
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
            held.cancel()
            second, stub = _serve(config, gcs, log)
        finally:
            first.kill()
        try:
            assert _worker_pids(name) == pids and len(pids) == 2  # the same processes, no model reloaded
            assert _greedy(stub) == before
            deadline = time.monotonic() + 60
            while any(w.kv_blocks_used for w in stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers):
                assert time.monotonic() < deadline, "the first router's request still holds blocks"
                time.sleep(0.1)
            second.send_signal(signal.SIGTERM)  # a clean stop ends the (detached) workers
            assert second.wait(timeout=120) == 0
            assert ha.find_workers(name) == {}
        finally:
            second.kill()
            for handle in ha.find_workers(name).values():
                ray_session.kill(handle, no_restart=True)
    assert "holding 1 requests of the router before" in (tmp_path / "serve.log").read_text()
