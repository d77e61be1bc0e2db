"""A real `pdserve serve` with TLS and tokens, reached as a client would over real sockets
(issue 15): plaintext and unknown callers are turned away, a request answers only to the token
that sent it, the CLI connects with --tls-ca and a token."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import pdserve_pb2 as pb
from router.client import channel, connect, make_request
from tests.cli.test_cli import PDSERVE, _run

ALICE, BOB = "alice-" + "a" * 26, "bob-" + "b" * 28
ADMIN = "admin-" + "c" * 26  # named admin: the operator's class (router/admin.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def server(certs, tmp_path_factory, http_port):
    d = tmp_path_factory.mktemp("secure")
    (d / "tokens").write_text(f"{ALICE} alice\n{BOB} bob\n{ADMIN} admin\n")
    (d / "tokens").chmod(0o600)
    (d / "cfg.yaml").write_text("mode: colocated\ndecode:\n  compile_decode: false\n")
    port = _free_port()
    proc = subprocess.Popen([PDSERVE, "serve", "--config", str(d / "cfg.yaml"), "--port", str(port),
                             "--metrics-port", "0", "--tls-cert", str(certs["server"]), "--tls-key",
                             str(certs["server_key"]), "--tokens-file", str(d / "tokens"),
                             "--http-port", str(http_port)],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 240  # hang guard only
    while not any("serving the OpenAI API" in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stderr.readline())
    assert any("TLS, 3 tokens" in line for line in lines), lines
    assert f"https://127.0.0.1:{http_port}/v1" in lines[-1], lines[-1]
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def _stub(server, certs, token):
    return connect(server, tls_ca=str(certs["ca"]), token=token)


def test_plaintext_and_unknown_callers_are_turned_away_but_health_answers(server, certs):
    with pytest.raises(grpc.RpcError) as e:  # no TLS: the handshake never happens
        connect(server, token=ALICE).GetModelInfo(pb.GetModelInfoRequest(), timeout=20)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    for token in (None, "x" * 32):
        stub = _stub(server, certs, token)
        calls = [lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=20),
                 lambda: stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=20),
                 lambda: stub.Abort(pb.AbortRequest(request_id="x"), timeout=20),
                 lambda: list(stub.Generate(make_request("Hi", max_tokens=2), timeout=20))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    health = health_pb2_grpc.HealthStub(channel(server, tls_ca=str(certs["ca"])))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=20).status == health_pb2.HealthCheckResponse.SERVING


def test_a_request_answers_only_to_its_own_token(server, certs):
    alice, bob = _stub(server, certs, ALICE), _stub(server, certs, BOB)
    stream = alice.Generate(make_request("Count to one hundred:", max_tokens=400, ignore_eos=True,
                                         request_id="alice-1"), timeout=300)
    first = next(stream)
    assert first.token_ids
    # Bob cannot stop it, nor tell it from an id nobody uses; the same id is his own request.
    assert not bob.Abort(pb.AbortRequest(request_id="alice-1"), timeout=20).found
    assert bob.Abort(pb.AbortRequest(request_id="alice-1"), timeout=20).found == \
        bob.Abort(pb.AbortRequest(request_id="nobody"), timeout=20).found
    his = list(bob.Generate(make_request("Hi", max_tokens=2, request_id="alice-1"), timeout=60))
    assert his[-1].finish_reason == pb.FINISH_REASON_LENGTH and all(r.request_id == "alice-1" for r in his)
    assert sum(len(r.token_ids) for r in his) == 2  # ran as his own request: no ALREADY_EXISTS oracle
    assert alice.Abort(pb.AbortRequest(request_id="alice-1"), timeout=20).found
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) < 400  # stopped, not run out


def test_the_cli_connects_with_a_ca_and_a_token(server, certs):
    r = _run("generate", "The capital of France is", "--server", server, "--tls-ca", str(certs["ca"]),
             "--token", BOB, "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"] and len(out["token_ids"]) == 8
    r = subprocess.run([PDSERVE, "status", "--server", server, "--tls-ca", str(certs["ca"]), "--json"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PDSERVE_TOKEN": ADMIN})
    assert r.returncode == 0 and json.loads(r.stdout)["mode"] == "colocated", r.stderr
    r = subprocess.run([PDSERVE, "status", "--server", server, "--tls-ca", str(certs["ca"]), "--json"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PDSERVE_TOKEN": ALICE})
    assert r.returncode == 1 and "PERMISSION_DENIED" in r.stderr, r.stderr  # addresses are for operators
    r = _run("status", "--server", server, "--tls-ca", str(certs["ca"]), timeout=120)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, r.stderr


def test_serving_beyond_loopback_without_tls_or_tokens_is_refused_at_start():
    r = _run("serve", "--host", "0.0.0.0", "--port", "0", timeout=120)
    assert r.returncode == 2 and "refusing to serve 0.0.0.0" in r.stderr and "--insecure" in r.stderr, r.stderr


def _openai(http_port, certs, token):
    import httpx2
    import openai
    return openai.OpenAI(base_url=f"https://127.0.0.1:{http_port}/v1", api_key=token or "none",
                         http_client=httpx2.Client(verify=str(certs["ca"])), max_retries=0, timeout=120)


def test_the_openai_api_has_the_same_door(server, certs, http_port):
    """HTTPS with the server's certificate, the same tokens: none or an unknown one is a 401 in
    OpenAI's error shape; /health stays open; plain HTTP gets no answer from the TLS port."""
    import httpx2
    import openai
    for token in (None, "x" * 32):
        client = _openai(http_port, certs, token)
        for call in (lambda: client.models.list(),
                     lambda: client.completions.create(model="any", prompt="Hi", max_tokens=2)):
            with pytest.raises(openai.AuthenticationError) as e:
                call()
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key", e.value.body
    alice = _openai(http_port, certs, ALICE)
    model = alice.models.list().data[0].id
    out = alice.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text and out.usage.completion_tokens == 8
    health = httpx2.get(f"https://127.0.0.1:{http_port}/health", verify=str(certs["ca"]), timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    with pytest.raises(httpx2.HTTPError):  # no TLS: no HTTP answer
        httpx2.get(f"http://127.0.0.1:{http_port}/health", timeout=30)
