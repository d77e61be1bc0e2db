"""Fuzzing the front door (issue 42): hypothesis sends OpenAI request bodies (completions and
chat; well-typed, ill-typed, lone surrogates, NaN, huge numbers, raw bytes) to the real HTTP
app, and GenerateRequests to the real gRPC server, over a router without workers that runs the
router's own validation with the real tokenizer. No answer may be a 500 or INTERNAL: every
refusal is a 4xx in OpenAI's error shape (or a gRPC status the client can act on)."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.v1 import pdserve_pb2 as pb
from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.router.front_door_fakes import Served

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@pytest.fixture(scope="module")
def srv(model_path):
    from transformers import AutoTokenizer
    s = Served(tokenizer=AutoTokenizer.from_pretrained(str(model_path)), front_door__logprob_entries=5000,
               limits__message_bytes=65536)
    yield s
    s.stop()


# text with lone surrogates, controls and everything else in it; and text a client would send
chars = st.characters(categories=["L", "N", "P", "S", "Z", "Cc", "Cs"]) | st.sampled_from("\ud800\udbff\udc00\udfff")
wild_text = st.lists(chars, max_size=12).map("".join)  # (st.text would drop the surrogates)
text = st.one_of(*[st.text(st.characters(categories=["L", "N", "P", "S", "Zs"]), max_size=12)] * 3, wild_text)
leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
        | wild_text)
anything = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(wild_text, kids, max_size=3),
                        max_leaves=8)
ids = st.lists(st.integers(0, 40000), min_size=1, max_size=6)


def fields(valid: dict, wild: dict) -> st.SearchStrategy:
    """Bodies whose every field is valid, or each one of them possibly anything."""
    return st.fixed_dictionaries({}, optional=valid) | st.fixed_dictionaries(
        {}, optional={k: st.one_of(v, wild.get(k, v), anything) for k, v in valid.items()})


common = {
    "n": st.integers(1, 3), "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**64 - 1), "stop": text | st.lists(text, max_size=3), "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "stop_token_ids": ids, "ignore_eos": st.booleans(), "user": text,
    "response_format": st.just({"type": "text"}), "tools": st.just([]),
}
wild = {"n": st.integers(-1, 20), "max_tokens": st.integers(-3, 10**6), "temperature": st.floats(-1, 3),
        "seed": st.integers(-1, 2**65), "stop": wild_text | st.lists(wild_text, max_size=20),
        "stop_token_ids": st.lists(st.integers(-2, 60000)), "top_logprobs": st.integers(-1, 30),
        "logprobs": st.integers(-1, 30), "user": wild_text, "stream_options": anything,
        "response_format": st.sampled_from([{"type": "json_object"}, "text"]), "tools": st.just([{"type": "x"}])}
model = st.sampled_from(["m", "m", "m", "other"])
prompts = text.filter(bool) | ids | st.lists(text.filter(bool), min_size=1, max_size=3) | st.lists(ids, min_size=1,
                                                                                                   max_size=3)
completion = st.tuples(
    st.fixed_dictionaries({"model": model, "prompt": prompts | wild_text | anything}),
    fields({**common, "logprobs": st.integers(0, 5), "echo": st.booleans(), "best_of": st.integers(1, 3),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}, wild),
).map(lambda t: {**t[0], **t[1]})
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]) | wild_text},
                             optional={"text": text | wild_text | anything})
role = st.sampled_from(["user", "system", "assistant", "developer", "user"]) | wild_text
message = st.fixed_dictionaries({"role": role}, optional={"content": text | wild_text | st.lists(part, max_size=3)
                                                          | anything, "name": text})
chat = st.tuples(
    st.fixed_dictionaries({"model": model, "messages": st.lists(message, min_size=1, max_size=4) | anything}),
    fields({**common, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
            "max_completion_tokens": st.integers(1, 8)}, wild),
).map(lambda t: {**t[0], **t[1]})


def _send(srv, path: str, data: bytes) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    try:
        c.request("POST", path, data, {"content-type": "application/json", "host": f"127.0.0.1:{srv.http_port}"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _check(status: int, body: bytes) -> None:
    event(f"HTTP {status}")  # (pytest --hypothesis-show-statistics: how the bodies fared)
    assert status < 500, (status, body[:500])
    if status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif body.startswith(b"data: "):  # a stream: to its end, or an error event after its first token
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" or '"error"' in events[-1], events[-3:]
    else:
        assert json.loads(body)["choices"]


@FUZZ
@given(body=completion | anything, raw=st.booleans())
def test_completions_never_answer_500(srv, body, raw):
    data = json.dumps(body).encode()
    _check(*_send(srv, "/v1/completions", data[: len(data) // 2] if raw else data))


@FUZZ
@given(body=chat | anything)
def test_chat_completions_never_answer_500(srv, body):
    _check(*_send(srv, "/v1/chat/completions", json.dumps(body).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200) | st.builds(lambda b: b"[" * b, st.integers(0, 70_000)))
def test_any_bytes_are_never_a_500(srv, data):
    _check(*_send(srv, "/v1/chat/completions", data))


grpc_text = st.text(st.characters(categories=["L", "N", "P", "S", "Z", "Cc"]), max_size=12)  # (protobuf: no surrogates)
sampling = st.builds(pb.SamplingParams, max_tokens=st.integers(-1, 10), temperature=st.floats(0, 2, width=32),
                     top_p=st.floats(0.125, 1, width=32), top_k=st.integers(-1, 50), seed=st.integers(0, 2**64 - 1),
                     stop=st.lists(grpc_text, max_size=3), stop_token_ids=st.lists(st.integers(0, 40000), max_size=3),
                     logprobs=st.integers(0, 5), prompt_logprobs=st.integers(0, 5)) | st.builds(
    pb.SamplingParams, max_tokens=st.integers(-2**31, 2**31 - 1), temperature=st.floats(width=32),
    top_p=st.floats(width=32), top_k=st.integers(-2**31, 2**31 - 1), stop=st.lists(grpc_text, max_size=20),
    stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=70), logprobs=st.integers(-2**31, 2**31 - 1),
    prompt_logprobs=st.integers(-2**31, 2**31 - 1))
inputs = st.one_of(
    st.builds(lambda p: {"prompt": p}, grpc_text),
    st.builds(lambda i: {"token_ids": pb.TokenIds(ids=i)}, ids | st.lists(st.integers(-2**31, 2**31 - 1), max_size=6)),
    st.builds(lambda ms: {"messages": pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in ms])},
              st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "bot", ""]), grpc_text), max_size=3)),
    st.just({}))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inp=inputs, s=sampling, rid=st.just("") | st.text(st.characters(categories=["L", "N", "P", "Zs"]), max_size=140))
def test_generate_over_grpc_is_never_internal(srv, inp, s, rid):
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        try:
            list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(request_id=rid, sampling=s, **inp), timeout=60))
            event("OK")
        except grpc.RpcError as e:
            event(e.code().name)
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), e.details()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64) | st.builds(lambda m, cut: m.SerializeToString()[:cut], st.builds(
    pb.GenerateRequest, prompt=grpc_text, sampling=sampling), st.integers(0, 64)))
def test_any_bytes_over_grpc_are_never_internal_or_unknown(srv, data):
    """Whatever bytes arrive as a Generate request (not UTF-8, cut short, garbage), the answer
    is a status the caller can act on (router.grpc_guard), never INTERNAL or UNKNOWN."""
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        try:
            list(ch.unary_stream("/pdserve.v1.Generation/Generate")(data, timeout=60))
            event("OK")
        except grpc.RpcError as e:
            event(e.code().name)
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), e.details()
