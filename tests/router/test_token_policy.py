"""Per-token policy at the real front door (issue 42): over a token's limit, HTTP answers 429
with ``Retry-After`` in OpenAI's error JSON and gRPC RESOURCE_EXHAUSTED with ``retry-after``
trailing metadata; other tokens go on; ``/metrics`` names tokens, never shows one; SIGHUP
reloads tokens and policy (a revoked token is refused, its running request finishes).

The router is the real ``Router.generate``/``Generate`` (validation, the admission hook) with no
workers behind it: its ``_run`` answers one token, then a second once ``hold`` is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from types import SimpleNamespace

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.admission import Admission
from router.app import install_signals, reload_security
from router.auth import Auth, FrontDoor, load_tokens
from router.config import load_config
from router.cluster_view import ClusterView
from router.holdings import Holdings
from router.metrics import RouterMetrics
from router.place import Placer
from router.policy import load_policy
from router.requests import Limits
from router.server import Router
from router.worker_state import Worker
from tests.router.front_door_fakes import COMPLETION, until

ALICE, BOB, CAROL = "alice-" + "a" * 26, "bob-" + "b" * 28, "carol-" + "c" * 26
POLICY = """
tokens:
  alice: {max_concurrent: 1, priority: high, weight: 3}
  bob: {tokens_per_minute: 6}
"""


def _router(monkeypatch, cfg, door: FrontDoor) -> Router:
    import router.server as server
    monkeypatch.setattr(server, "prompt_ids", lambda req, tok, limits: [1, 2, 3])
    r = object.__new__(Router)
    r.cfg, r.door, r.tokenizer, r._tokenizing, r._tool_token = cfg, door, None, None, False
    r.jobs, r.placer = {}, SimpleNamespace(queued=0, live=Holdings())
    r.admission = Admission(door.policy)
    r.limits = Limits(context_length=128, vocab_size=1000, default_max_tokens=8, input=cfg.limits)
    r.metrics = SimpleNamespace(prompt_tokens=SimpleNamespace(inc=lambda n: None), parked=SimpleNamespace(inc=int))
    r.served_model_name, r.roles, r.token_text = "m", ("colocated",), str
    r.pools = SimpleNamespace(any_alive=lambda role: True, workers={}, bad_reports=0, abort=lambda w, key: None)
    r.http = r.http_port = None
    r._release = r._observe = lambda *a: None
    r.hold = asyncio.Event()
    r.hold.set()
    r.finished = 0

    async def run(job):
        job.generated.append(7)
        yield pb.GenerateResponse(token_ids=[7], text="a")
        await r.hold.wait()
        job.generated.append(8)
        r.finished += 1
        yield pb.GenerateResponse(token_ids=[8], text="b", finish_reason=pb.FINISH_REASON_LENGTH,
                                  usage=pb.Usage(prompt_tokens=3, completion_tokens=2))

    r._run = run
    return r


class Served:
    """That router behind the real gRPC and HTTP servers, on a loop in a thread."""

    def __init__(self, monkeypatch, tmp_path) -> None:
        from router.openai_http import start_http
        from router.server import start_server
        self.tokens_file = tmp_path / "tokens"
        self.tokens_file.write_text(f"{ALICE} alice\n{BOB} bob\n{CAROL} carol\n")
        self.policy_file = tmp_path / "policy.yaml"
        self.policy_file.write_text(POLICY)
        self.cfg = load_config(None, {"security.tokens_file": str(self.tokens_file),
                                      "security.policy_file": str(self.policy_file)})
        door = FrontDoor(auth=Auth(load_tokens(str(self.tokens_file), {})),
                         policy=load_policy(str(self.policy_file)))
        self.router = _router(monkeypatch, self.cfg, door)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            self.grpc, self.port = await start_server(self.router, "127.0.0.1", 0)
            self.router.http, self.http_port = await start_http(self.router, "127.0.0.1", 0, self.cfg.security)

        self.call(start)

    def call(self, coro_fn, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def holding(self, on: bool) -> None:
        self.loop.call_soon_threadsafe(self.router.hold.clear if on else self.router.hold.set)

    def stop(self) -> None:
        from router.app import stop_cluster

        async def router_stop():
            pass
        self.router.stop = router_stop
        self.call(lambda: stop_cluster(self.router, self.grpc))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def post(self, token: str, body=COMPLETION) -> tuple[int, dict, dict]:
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"content-type": "application/json", "host": f"127.0.0.1:{self.http_port}",
                   "authorization": f"Bearer {token}"})
        r = c.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"{}")
        c.close()
        return out

    def stub(self):
        return pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{self.port}"))


@pytest.fixture
def served(monkeypatch, tmp_path):
    s = Served(monkeypatch, tmp_path)
    yield s
    s.holding(False)
    s.stop()


def _in_flight(served, name: str) -> int:
    return served.call(lambda: _async(lambda: served.router.admission.stats_of(name).in_flight))


async def _async(fn):
    return fn()


def test_over_max_concurrent_is_429_with_retry_after_and_grpc_resource_exhausted(served):
    from concurrent.futures import ThreadPoolExecutor
    served.holding(True)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(served.post, ALICE)  # holds alice's one slot
        until(lambda: _in_flight(served, "alice") == 1)
        status, headers, body = served.post(ALICE)
        assert status == 429 and headers["retry-after"] == "1"
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
        assert "max_concurrent" in body["error"]["message"]
        meta = [("authorization", f"Bearer {ALICE}")]
        with pytest.raises(grpc.RpcError) as e:
            list(served.stub().Generate(pb.GenerateRequest(request_id="g1", prompt="hi"), metadata=meta, timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "1") in tuple(e.value.trailing_metadata())
        served.holding(False)
        assert served.post(CAROL)[0] == 200  # another token is not held by alice's cap
        assert first.result(30)[0] == 200
    assert served.post(ALICE)[0] == 200  # her slot is free again
    stats = served.router.admission.stats()
    assert stats["alice"].refused == {"max_concurrent": 2} and stats["alice"].in_flight == 0


def test_over_tokens_per_minute_is_429_with_how_long_to_wait(served):
    assert served.post(BOB)[0] == 200  # 3 prompt + 2 generated of bob's 6 a minute
    assert served.post(BOB)[0] == 200  # 1 left: admitted, into debt (3 + 2 more)
    status, headers, body = served.post(BOB)
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert "tokens per minute" in body["error"]["message"]
    assert 35 <= int(headers["retry-after"]) <= 41  # 4 tokens of debt at 6 a minute: ~40 s
    with pytest.raises(grpc.RpcError) as e:
        list(served.stub().Generate(pb.GenerateRequest(request_id="g2", prompt="hi"),
                                    metadata=[("authorization", f"Bearer {BOB}")], timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 35 <= int(dict(e.value.trailing_metadata())["retry-after"]) <= 41
    assert served.post(CAROL)[0] == 200
    assert served.router.admission.stats()["bob"].tokens == 10


def test_metrics_name_tokens_never_show_them(served):
    served.post(CAROL)
    for _ in range(3):
        served.post(BOB)
    from prometheus_client import generate_latest
    # the router's /metrics (its per-token families: no worker here)
    text = generate_latest(RouterMetrics(ClusterView, served.router.admission.stats).registry).decode()
    assert 'pdserve_token_requests_admitted_total{token="carol"} 1.0' in text
    assert 'pdserve_token_requests_admitted_total{token="bob"} 2.0' in text
    assert 'pdserve_token_requests_refused_total{limit="tokens_per_minute",token="bob"} 1.0' in text
    assert 'pdserve_token_tokens_total{token="carol"} 5.0' in text
    assert 'pdserve_token_requests_in_flight{token="carol"} 0.0' in text
    for secret in (ALICE, BOB, CAROL):
        assert secret not in text


def test_reload_revokes_a_token_and_changes_limits_running_requests_finish(served, caplog):
    from concurrent.futures import ThreadPoolExecutor
    served.holding(True)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(served.post, CAROL)
        until(lambda: _in_flight(served, "carol") == 1)
        served.tokens_file.write_text(f"{ALICE} alice\n{BOB} bob\n")  # carol revoked
        served.policy_file.write_text("tokens:\n  alice: {max_concurrent: 1}\n  bob: {}\n")
        assert served.call(lambda: _async(lambda: reload_security(served.router, served.cfg.security, {})))
        assert served.post(CAROL)[0] == 401
        with pytest.raises(grpc.RpcError) as e:
            list(served.stub().Generate(pb.GenerateRequest(request_id="g3", prompt="hi"),
                                        metadata=[("authorization", f"Bearer {CAROL}")], timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        served.holding(False)
        assert running.result(30)[0] == 200  # the revoked token's running request finished
    for _ in range(4):  # bob has no tokens-per-minute limit now
        assert served.post(BOB)[0] == 200
    # A bad file changes nothing: bob's limit stays off, carol stays out
    served.policy_file.write_text("tokens:\n  bob: {tokens_per_minute: 0}\n")
    served.tokens_file.write_text(f"{ALICE} alice\n{BOB} bob\n{CAROL} carol\n")
    assert not served.call(lambda: _async(lambda: reload_security(served.router, served.cfg.security, {})))
    assert served.post(CAROL)[0] == 401 and served.post(BOB)[0] == 200
    served.tokens_file.write_text("")  # no token left: refused, tokens stay on
    served.policy_file.write_text("")
    assert not served.call(lambda: _async(lambda: reload_security(served.router, served.cfg.security, {})))
    assert served.post(ALICE)[0] == 200 and served.post("x" * 32)[0] == 401


def test_sighup_reloads(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE} alice\n")
    sec = load_config(None, {"security.tokens_file": str(tokens)}).security
    router = SimpleNamespace(door=FrontDoor(auth=Auth(load_tokens(str(tokens), {}))), admission=Admission())
    tokens.write_text(f"{BOB} bob\n")

    async def main():
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        install_signals(loop, router, sec, stop)  # as `pdserve serve` does
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(500):
                if set(router.door.auth.tokens.values()) == {"bob"}:
                    break
                await asyncio.sleep(0.01)
        finally:
            for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        assert not stop.is_set()

    asyncio.run(main())
    assert router.door.auth.caller([("authorization", f"Bearer {BOB}")]) == "bob"
    assert router.door.auth.caller([("authorization", f"Bearer {ALICE}")]) is None


class OneSlotPools:
    """A colocated pool of one worker with room for ``slots`` requests (one KV block each)."""

    def __init__(self, slots: int) -> None:
        self.free, self.slots = slots, slots
        self._changed = asyncio.Event()

        self.workers = {"w": Worker("w", "colocated", actor=None, state="ready")}

    def any_alive(self, *roles) -> bool:
        return True

    def worker(self, worker_id):
        return self.workers[worker_id]

    def still_ready(self, w, roles) -> bool:
        return w.ready_as(roles)

    async def submit(self, w, key, ids, params, time_left, check):
        return True

    def loads(self, *roles):
        from router.placement import WorkerLoad
        return [WorkerLoad("w", "colocated", free_blocks=self.free, total_blocks=self.slots, block_size=16)]

    def reserved(self, worker_id, blocks, new_call=True, prompt_tokens=0) -> None:
        self.free -= blocks

    def give_back(self) -> None:
        self.free += 1
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass


def test_the_routers_placement_queue_shares_3_to_1_by_weight_and_puts_high_priority_first():
    """Through the real placement (router.place): one slot, three tokens' requests waiting for it."""
    from engine.request import SamplingParams
    from router.jobs import Job, JobState
    from router.policy import Policy, TokenPolicy

    async def main():
        r = object.__new__(Router)
        r.cfg = load_config(None, {"mode": "colocated", "router.queue_timeout_s": 600.0})
        r.pools = OneSlotPools(1)
        r.admission = Admission(Policy({"a": TokenPolicy(weight=3), "b": TokenPolicy(weight=1),
                                        "vip": TokenPolicy(priority="high")}))
        r.metrics = SimpleNamespace(prefix_hit_tokens=SimpleNamespace(inc=lambda n: None))
        r.placer = Placer(r.cfg, r.pools, r.admission, Holdings(), r.metrics)  # (prefix-blind, colocated)
        jobs = []
        for i in range(60):
            for name in ("a", "b"):
                job = Job(f"{name}-{i}", [1, 2, 3], SamplingParams(max_tokens=4), owner=name)
                job.lease = r.admission.admit(name, 3)
                jobs.append(job)
        tasks = [asyncio.create_task(r.placer.place(j)) for j in jobs]
        placed: list[str] = []

        async def next_placed():
            while True:
                running = [j for j in jobs if j.state is JobState.RUNNING and j.request_id not in placed]
                if running:
                    assert len(running) == 1, "one slot: one placement at a time"
                    placed.append(running[0].request_id)
                    return running[0].owner
                await asyncio.sleep(0.001)

        owners = [await next_placed()]
        for k in range(59):
            if k == 30:  # a high-priority request arrives: it is next, ahead of both
                vip = Job("vip", [1, 2, 3], SamplingParams(max_tokens=4), owner="vip")
                vip.lease = r.admission.admit("vip", 3)
                jobs.append(vip)
                tasks.append(asyncio.create_task(r.placer.place(vip)))
                await asyncio.sleep(0.01)
            r.pools.give_back()
            owners.append(await next_placed())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert r.admission.queued == 0 and r.queued == 0  # nothing left waiting (cancelled ones left)
        return owners

    owners = asyncio.run(main())
    assert owners[31] == "vip" and owners.count("vip") == 1
    a, b = owners.count("a"), owners.count("b")
    assert a / b == pytest.approx(3.0, rel=0.15), (a, b)
