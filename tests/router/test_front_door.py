"""The HTTP front door against hostile and careless clients, over real sockets (issue 42): every
malformed body is a 4xx in OpenAI's error shape, foreign Hosts and Origins are refused on
loopback, the response-size budget is checked before generating, and requests in progress,
not idle connections, count against the request limit."""

from __future__ import annotations

import json

import pytest

from router.http_body import too_deep
from router.http_guard import host_ok, origin_ok
from router.openai_api import ChatCompletionRequest, CompletionRequest, logprob_entries, parse, requests_for
from tests.router.front_door_fakes import CHAT, COMPLETION, Served


@pytest.fixture(scope="module")
def srv():
    s = Served(front_door__logprob_entries=1000, security__allowed_hosts=["pdserve.internal"],
               security__allowed_origins=["https://app.example"])
    yield s
    s.stop()


def _error(status_body) -> dict:
    status, headers, body = status_body
    assert headers["content-type"].startswith("application/json"), (status, body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_deep_nesting_is_a_400_not_a_500(srv):
    for body in (b"[" * 100_000, b'{"model": "m", "prompt": "x", "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                 b'{"model": "m", "prompt": "x", "extra": ' + b'{"a":' * 33 + b"1" + b"}" * 33 + b"}"):
        status, headers, text = srv.post("/v1/completions", body)
        assert status == 400, text
        assert "front_door.json_depth" in _error((status, headers, text))["message"]
    # brackets inside strings are text, not nesting; 32 levels are allowed
    ok = b'{"model": "m", "prompt": "' + b"[[[{" * 100 + b'", "extra": ' + b"[" * 31 + b"]" * 31 + b"}"
    assert srv.post("/v1/completions", ok)[0] == 200


def test_too_deep_counts_only_structure():
    assert not too_deep(b'{"a": [[1]]}', 3) and too_deep(b'{"a": [[[1]]]}', 3)
    assert not too_deep(b'"[[[[[[[["', 1) and not too_deep(b'["\\"[[[["]', 1)
    assert not too_deep(b'"' + b'\\"' * 100_000, 1)  # an unterminated string: one linear scan


@pytest.mark.parametrize("body,param", [
    ({**COMPLETION, "prompt": "\ud800"}, "prompt"),
    ({**COMPLETION, "prompt": ["ok", "x\udfffy"]}, "prompt"),
    ({**COMPLETION, "stop": ["\ud834"]}, "stop"),
    ({**CHAT, "messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages"),
    ({**CHAT, "user": "\ud800"}, "user"),
    ({**CHAT, "\ud800": 1}, None),
])
def test_lone_surrogates_are_a_400_naming_the_parameter(srv, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, headers, text = srv.post(path, json.dumps(body).encode())  # (ensure_ascii: "\ud800" escapes)
    assert status == 400, text
    err = _error((status, headers, text))
    assert err["param"] == param and "surrogate" in err["message"]


def test_a_surrogate_pair_is_text(srv):
    status, _, text = srv.post("/v1/completions", json.dumps({**COMPLETION, "prompt": "smile \U0001F600"}).encode())
    assert status == 200, text


def test_parse_refuses_surrogates_whoever_calls_it():
    with pytest.raises(Exception) as e:
        parse(CompletionRequest, {**COMPLETION, "prompt": "\ud800"})
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize("ctype,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/vnd.api+json", 200), (None, 200)])
def test_only_json_bodies_are_read(srv, ctype, status):
    got = srv.post("/v1/completions", COMPLETION, {"content-type": ctype})
    assert got[0] == status, got
    if status == 415:
        assert _error(got)["code"] == "unsupported_media_type"


def test_bad_content_length_and_bad_json_are_400s(srv):
    s = srv.raw()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 3\r\n\r\n{x}" % srv.http_port)
    assert s.recv(65536).startswith(b"HTTP/1.1 400")
    assert srv.post("/v1/completions", b"\xff\xfe not utf-8")[0] == 400


@pytest.mark.parametrize("declared", [True, False])
def test_an_oversized_body_is_read_to_its_end_and_answered_413(srv, declared):
    """Answering 413 and closing while the client still sends would reset the connection over
    the unread bytes, losing the answer: the refused body is read and dropped first, so the
    client's whole upload goes through and the 413 arrives (declared by Content-Length, or
    found while reading a chunked body)."""
    over = srv.router.cfg.limits.message_bytes + (2 << 20)  # 2 MiB past the limit: more than
    body = b"x" * over                                       # any socket buffer holds unread
    s = srv.raw()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n" % srv.http_port
    if declared:
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % over + body)
    else:
        s.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % over + body + b"\r\n0\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        part = s.recv(65536)
        assert part, got
        got += part
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    s.close()


def test_a_foreign_host_is_refused_on_loopback(srv):
    port = srv.http_port
    for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}", f"127.0.0.1.nip.io:{port}",
                 "127.0.0.1:notaport", "[::1", "x"):
        got = srv.post("/v1/completions", COMPLETION, {"host": host})
        assert got[0] == 403 and _error(got)["code"] == "host_not_allowed", (host, got)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"127.9.9.9:{port}", f"[::1]:{port}", "localhost",
                 "127.0.0.1:9000", "pdserve.internal", f"PDSERVE.internal:{port}"):  # (9000: an SSH tunnel)
        assert srv.post("/v1/completions", COMPLETION, {"host": host})[0] == 200, host
    assert srv.get("/health", {"host": "evil.example"})[0] == 403  # a rebinding page learns nothing


def test_a_foreign_origin_is_refused(srv):
    host = f"127.0.0.1:{srv.http_port}"
    for origin in ("http://evil.example", "null", f"http://localhost:{srv.http_port}", "file://",
                   "https://app.example.org"):
        got = srv.post("/v1/completions", COMPLETION, {"origin": origin, "host": host})
        assert got[0] == 403 and _error(got)["code"] == "origin_not_allowed", (origin, got)
    for origin in (f"http://{host}", "https://app.example", "https://APP.example/"):
        assert srv.post("/v1/completions", COMPLETION, {"origin": origin, "host": host})[0] == 200, origin


def test_host_and_origin_rules():
    assert host_ok("anything", loopback=False, allowed=())  # beyond loopback: TLS and tokens guard it
    assert not host_ok("anything", loopback=False, allowed=("api.example",))
    assert host_ok("api.example:443", loopback=False, allowed=("api.example",))
    assert host_ok("api.example:8443", loopback=True, allowed=("api.example:8443",))
    assert not host_ok("api.example:9", loopback=True, allowed=("api.example:8443",))
    assert host_ok(None, loopback=True, allowed=())  # HTTP/1.0 without Host: no browser
    assert origin_ok(None, "x", ()) and not origin_ok("http://x", None, ())
    assert origin_ok("https://h:1", "h:1", ()) and not origin_ok("ftp://h:1", "h:1", ())


def test_the_logprob_budget_is_checked_before_generating(srv):
    before = srv.router.finished
    ask = {**CHAT, "n": 2, "max_tokens": 100, "logprobs": True, "top_logprobs": 5}  # 2 x 100 x 6 = 1200 > 1000
    got = srv.post("/v1/chat/completions", ask)
    err = _error(got)
    assert got[0] == 400 and err["param"] == "top_logprobs" and "front_door.logprob_entries" in err["message"]
    got = srv.post("/v1/completions", {**COMPLETION, "n": 2, "max_tokens": 100, "logprobs": 5})
    assert got[0] == 400 and _error(got)["param"] == "logprobs"
    assert srv.router.finished == before  # nothing generated
    status, _, body = srv.post("/v1/chat/completions", {**ask, "n": 1})  # 600: fits
    assert status == 200 and len(json.loads(body)["choices"][0]["logprobs"]["content"]) == 2


def test_logprob_entries_count_choices_tokens_and_alternatives():
    def entries(kind, **body):
        _, reqs = requests_for(parse(kind, {"model": "m", **body}), "x", 16)
        return logprob_entries(reqs, context_length=100, default_max_tokens=8)

    assert entries(CompletionRequest, prompt="x", max_tokens=10) == 0  # no logprobs asked: no budget
    assert entries(CompletionRequest, prompt="x", max_tokens=10, logprobs=2, n=3) == 3 * 10 * 3
    assert entries(CompletionRequest, prompt=["x", "y"], max_tokens=1, logprobs=1, echo=True) == 2 * 100 * 2
    assert entries(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], logprobs=True) == 8
    assert entries(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], logprobs=True,
                   max_tokens=10**6, top_logprobs=1) == 100 * 2


def test_unknown_paths_and_methods_stay_openai_shaped(srv):
    got = srv.get("/v1/nothing")
    assert got[0] == 404 and _error(got)
    got = srv.get("/v1/completions")
    assert got[0] == 405 and _error(got)


@pytest.mark.parametrize("override,needle", [
    ({"security.allowed_hosts": ["two words"]}, "security.allowed_hosts: must be a list of host names"),
    ({"security.allowed_origins": ["app.example"]}, "security.allowed_origins: must be a list of origins"),
    ({"front_door.json_depth": 0}, "front_door.json_depth: must be > 0"),
    ({"front_door.header_timeout_s": float("inf")}, "front_door.header_timeout_s: expected a finite number"),
    ({"front_door.health_watch": 3}, "unknown key front_door.health_watch"),
])
def test_front_door_settings_are_checked_at_start(override, needle):
    from router.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=needle):
        load_config(None, override)
