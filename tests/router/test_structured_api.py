"""Structured outputs and tools through the API layers (issue 45): OpenAI ``response_format``,
vLLM's ``guided_*``, ``tools`` + ``tool_choice`` onto ``pdserve.v1`` and into SamplingParams,
tool calls parsed back into OpenAI's shape, bad schemas a 400 naming the parameter."""

from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequestError
from engine.grammar import grammar_text
from engine.request import Guided
from pdserve.v1 import pdserve_pb2 as pb
from router.openai_answer import Shaper
from router.openai_api import ChatCompletionRequest, CompletionRequest, parse, requests_for
from router.requests import Limits, prompt_ids, sampling_params, tool_call_token, with_tool_choice
from router.tools import call_grammar, parse_calls
from tests.router.front_door_fakes import CHAT, COMPLETION, Served

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _one(kind, **body) -> pb.GenerateRequest:
    _, [g] = requests_for(parse(kind, {"model": "m", **body}), "x", 16)
    return g


def _params(g: pb.GenerateRequest, tokenizer=None):
    lim = Limits(context_length=4096, vocab_size=200_000)
    p = sampling_params(g.sampling, lim, 10)
    return with_tool_choice(g, p, tool_call_token(tokenizer)) if tokenizer is not None else p


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "json_object"}}, Guided("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     Guided("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, Guided("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[a-z]+"}, Guided("regex", "[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, Guided("choice", '["yes", "no"]')),
    ({"guided_grammar": 'start: "a"+'}, Guided("grammar", 'start: "a"+')),
    ({"response_format": {"type": "text"}}, None),
])
@pytest.mark.parametrize("kind, base", [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": USER})])
def test_response_format_and_guided_fields_reach_sampling_params(kind, base, body, want):
    g = _one(kind, **base, **body)
    assert _params(g).guided == want


@pytest.mark.parametrize("schema", [{"type": "frobnicate"}, {"properties": {"a": {"$ref": "#/nowhere"}}}])
def test_a_bad_schema_is_invalid_argument_naming_it(schema):
    g = _one(ChatCompletionRequest, messages=USER,
             response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    with pytest.raises(InvalidRequestError, match="json_schema"):
        _params(g)


def test_a_bad_schema_is_a_400_over_http():
    srv = Served()
    try:
        status, _, body = srv.post("/v1/completions", {**COMPLETION, "response_format": {
            "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 3}}}})
        assert status == 400 and "json_schema" in json.loads(body)["error"]["message"]
        status, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]})
        assert status == 400 and json.loads(body)["error"]["param"] == "tools"
    finally:
        srv.stop()


def test_tool_choice_travels_in_chat_messages():
    g = _one(ChatCompletionRequest, messages=USER, tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(g.messages.tools_json) == TOOLS
    assert (g.messages.tool_choice, g.messages.tool_choice_function) == ("", "get_time")
    assert _one(ChatCompletionRequest, messages=USER, tools=TOOLS).messages.tool_choice == "auto"


@pytest.fixture(scope="module")
def qwen():
    """The real Qwen2.5-Coder-0.5B tokenizer and chat template, read from its GGUF as the server
    reads them (``make install`` pulls the model: tests/pulled.py asserts it is there)."""
    # (heavy: transformers and the GGUF reader, for the tests that use the real tokenizer only)
    from transformers import AutoTokenizer

    from engine.models import gguf
    from tests.pulled import gguf_file
    return AutoTokenizer.from_pretrained(str(gguf.prepare(gguf_file("qwen2.5-coder-0.5b"), progress=False)))


def test_tools_are_rendered_by_the_models_chat_template(qwen):
    lim = Limits(context_length=32768, vocab_size=151936)
    g = _one(ChatCompletionRequest, messages=USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=TOOLS)
    text = qwen.decode(prompt_ids(g, qwen, lim))
    assert "<tools>" in text and "get_weather" in text and "Weather in a city" in text
    assert '"city": "Paris"' in text and "sunny" in text  # the earlier call and its answer
    none = _one(ChatCompletionRequest, messages=USER, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in qwen.decode(prompt_ids(none, qwen, lim))


@pytest.mark.parametrize("choice, function", [("required", None), ({"type": "function", "function": {"name": "get_weather"}},
                                                                    "get_weather")])
def test_required_and_named_tool_choice_force_a_valid_call(qwen, choice, function):
    import llguidance
    import llguidance.hf
    g = _one(ChatCompletionRequest, messages=USER, tools=TOOLS, tool_choice=choice)
    guided = _params(g, qwen).guided
    assert guided == call_grammar(TOOLS, function, special_tokens=True)
    lt = llguidance.hf.from_tokenizer(qwen, n_vocab=151936)
    m = llguidance.LLMatcher(lt, grammar_text(guided))
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert all(m.consume_token(t) for t in qwen(good)["input_ids"]) and m.is_accepting()
    m.reset()
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"town": 3}}'
    assert not all(m.consume_token(t) for t in qwen(bad)["input_ids"])
    if function:  # a named function: the other one is refused
        m2 = llguidance.LLMatcher(lt, grammar_text(guided))
        other = '<tool_call>\n{"name": "get_time", "arguments": {}}'
        assert not all(m2.consume_token(t) for t in qwen(other)["input_ids"])


def test_forced_call_with_response_format_or_without_tools_is_refused(qwen):
    g = _one(ChatCompletionRequest, messages=USER, tools=TOOLS, tool_choice="required",
             response_format={"type": "json_object"})
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        _params(g, qwen)
    with pytest.raises(InvalidRequestError, match="not in tools"):
        call_grammar(TOOLS, "nope", True)


def _answer(tools: tuple[str, ...], parts: list[str], stream: bool):
    """A chat answer of ``parts`` (the last one finishes it) with ``tools`` offered, shaped for
    OpenAI: its chunks, or the whole answer."""
    sh = Shaper(True, "r", "m", 1, tools=tools)
    rs = [pb.GenerateResponse(text=p) for p in parts[:-1]]
    rs.append(pb.GenerateResponse(text=parts[-1], finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))
    if stream:
        return [c for r in rs for c in sh.chunks(0, r)]
    for r in rs:
        sh.add(0, r)
    return sh.whole(1)


def test_tool_calls_are_parsed_into_openais_shape():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parse_calls("no calls here") == ("no calls here", [])
    assert parse_calls("<tool_call>\n{broken\n</tool_call>")[1] == []

    def answer(stream: bool):
        return _answer(("get_weather", "get_time"), [text[:30], text[30:]], stream)

    whole = answer(False)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and len(whole["message"]["tool_calls"]) == 2
    assert whole["message"]["content"] == "Let me check."
    first, *calls, last = answer(True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Let me check."}  # what comes before the calls
    [entries] = [c["choices"][0]["delta"]["tool_calls"] for c in calls]  # (both in one response: one delta)
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in entries] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    # without tools nothing is parsed
    sh = Shaper(True, "r", "m", 1)
    sh.add(0, pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))
    assert sh.whole(1)["choices"][0]["message"] == {"role": "assistant", "content": text}


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Madrid", "unit": "celsius"}}',
    '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Madrid", "unit": "celsius"}\n}\n```',
    '  [{"name": "get_weather", "parameters": {"city": "Madrid", "unit": "celsius"}}]\n'])
def test_a_call_without_the_tags_is_a_call_of_an_offered_function(text):
    """What the 0.5B answers to tool_choice auto (bench/agents.py): the call's JSON alone, bare
    or fenced, without <tool_call>."""
    names = ("get_weather", "get_time")
    content, calls = parse_calls(text, names)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Madrid", "unit": "celsius"}
    assert parse_calls(text) == (text, [])  # no names (no tools offered): never a call

    def answer(stream: bool):
        return _answer(names, [text[:7], text[7:], ""], stream)

    whole = answer(False)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    chunks = answer(True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # held, then the call: no JSON as content first
    [entries] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [(e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries] == \
        [("get_weather", {"city": "Madrid", "unit": "celsius"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("text", [
    '{"name": "launch_rockets", "arguments": {}}',  # not an offered function
    '{"name": "get_time", "arguments": {}, "why": "asked"}',  # more than a call
    '{"city": "Madrid"}', '```python\nprint(1)\n```', '{"name": "get_time", "arguments": {}} and then',
    'Here: {"name": "get_time", "arguments": {}}'])
def test_json_or_code_that_is_not_only_a_call_stays_content_streamed_or_whole(text):
    names = ("get_weather", "get_time")
    assert parse_calls(text, names) == (text, [])
    chunks = _answer(names, [text[:5], text[5:]], stream=True)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ---- streamed tool calls, through the real HTTP app on a socket ------------------------------
CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _events(body: bytes) -> list[dict]:
    lines = [ln[len(b"data: "):] for ln in body.split(b"\n\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _streamed(events: list[dict], index: int = 0) -> tuple[str, list[dict], list[str | None]]:
    """(content, calls as {id, name, arguments}, finish reasons) of one choice's chunks, with
    OpenAI's rules checked: a call's id, type and name come in its first entry, once."""
    content, calls, reasons = "", {}, []
    for e in events:
        for c in e["choices"]:
            if c["index"] != index:
                continue
            reasons.append(c["finish_reason"])
            d = c["delta"]
            content += d.get("content") or ""
            for t in d.get("tool_calls", []):
                if t["index"] not in calls:
                    assert t["type"] == "function" and t["id"].startswith("call_") and t["function"]["name"]
                    calls[t["index"]] = {"id": t["id"], "name": t["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in t and "name" not in t["function"]
                calls[t["index"]]["arguments"] += t["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[k] for k in sorted(calls)], reasons


def _same_calls(streamed: list[dict], whole: list[dict]) -> None:
    assert [c["name"] for c in streamed] == [c["function"]["name"] for c in whole]
    assert [json.loads(c["arguments"]) for c in streamed] == [json.loads(c["function"]["arguments"]) for c in whole]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_tool_calls_stream_as_openai_streams_them(size):
    srv = Served()
    try:
        srv.router.answer = _pieces(CALLS, size)
        status, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS})
        assert status == 200
        whole = json.loads(body)["choices"][0]
        status, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS, "stream": True})
        assert status == 200
        events = _events(body)
        content, calls, reasons = _streamed(events)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert content == whole["message"]["content"] == "Let me check."
        _same_calls(calls, whole["message"]["tool_calls"])
        assert reasons[-1] == whole["finish_reason"] == "tool_calls" and not any(reasons[:-1])
        assert events[-1]["choices"][0]["delta"] == {}
        deltas = [e["choices"][0]["delta"] for e in events]
        first_call = next(k for k, d in enumerate(deltas) if "tool_calls" in d)
        assert all("tool_calls" not in d for d in deltas[:first_call]) and \
            all(not d.get("content") for d in deltas[first_call:])  # content first, then the calls
        if size < 1000:  # the arguments come in fragments, as they are generated
            assert sum(1 for d in deltas for t in d.get("tool_calls", []) if t["index"] == 0
                       and t["function"].get("arguments")) > 3
    finally:
        srv.stop()


def test_a_calls_name_and_first_arguments_reach_the_client_before_the_answer_ends():
    srv = Served()
    try:
        srv.router.answer = _pieces(CALLS, 4)
        srv.holding(True)  # the last piece waits
        body = json.dumps({**CHAT, "tools": TOOLS, "stream": True}).encode()
        s = srv.raw()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (srv.http_port, len(body), body))
        got = b""
        while b'ET\\"}' not in got:  # the second call's arguments' end, streamed while the answer is held
            part = s.recv(65536)
            assert part, got
            got += part
        assert b'"get_weather"' in got and b"finish_reason\":\"tool_calls" not in got
        srv.holding(False)
        while part := s.recv(65536):
            got += part
        assert b"finish_reason\":\"tool_calls" in got and b"data: [DONE]\n\n" in got
        s.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("text", [
    "plain text, no call",
    "ends like a call opens <tool_",
    "a <tool_call>not JSON</tool_call> and after",
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"',  # cut short
])
def test_text_that_is_no_call_still_reaches_the_client(text):
    srv = Served()
    try:
        srv.router.answer = _pieces(text, 2)
        status, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS})
        whole = json.loads(body)["choices"][0]
        _, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS, "stream": True})
        content, calls, reasons = _streamed(_events(body))
        if "arguments" in text:  # announced as a call once its name is out: cut short, it stays one
            assert [c["name"] for c in calls] == ["get_time"] and calls[0]["arguments"] == '{"zone": "CET"'
            assert content == "" and reasons[-1] == "tool_calls"
        else:
            assert content == whole["message"]["content"] == text and calls == []
            assert reasons[-1] == whole["finish_reason"] == "stop"
    finally:
        srv.stop()


def test_streamed_tool_calls_with_n_choices():
    srv = Served()
    try:
        srv.router.answer = _pieces(CALLS, 5)
        _, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS, "n": 3})
        whole = json.loads(body)["choices"]
        _, _, body = srv.post("/v1/chat/completions", {**CHAT, "tools": TOOLS, "n": 3, "stream": True})
        events = _events(body)
        for k in range(3):
            content, calls, reasons = _streamed(events, k)
            assert content == "Let me check." and reasons[-1] == "tool_calls"
            _same_calls(calls, whole[k]["message"]["tool_calls"])
    finally:
        srv.stop()


@pytest.mark.parametrize("choice, function", [("required", None), ({"type": "function", "function": {"name": "get_weather"}},
                                                                    "get_weather")])
def test_forced_tool_calls_stream_token_by_token(qwen, choice, function):
    import dataclasses
    srv = Served(tokenizer=qwen)
    try:
        srv.router.limits = dataclasses.replace(srv.router.limits, context_length=4096)
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        srv.router.answer = [qwen.decode([t]) for t in qwen(text)["input_ids"]]  # one response per token
        req = {**CHAT, "tools": TOOLS, "tool_choice": choice, "n": 2}
        _, _, body = srv.post("/v1/chat/completions", req)
        whole = json.loads(body)["choices"]
        status, _, body = srv.post("/v1/chat/completions", {**req, "stream": True})
        assert status == 200
        assert srv.router.params[-1].guided == call_grammar(TOOLS, function, special_tokens=True)  # enforced
        events = _events(body)
        for k in range(2):
            content, calls, reasons = _streamed(events, k)
            assert content == "" and reasons[-1] == whole[k]["finish_reason"] == "tool_calls"
            _same_calls(calls, whole[k]["message"]["tool_calls"])
    finally:
        srv.stop()


# ---- the router compiles constraints off its event loop --------------------------------------
def test_a_slow_constraint_compile_does_not_stall_other_requests(monkeypatch):
    """Router.generate builds a constrained request's SamplingParams (engine.grammar.check) in a
    thread: while one request's schema compiles, another runs to its end on the same loop."""
    import asyncio
    import threading

    import engine.grammar
    from router.auth import FrontDoor
    from router.config import load_config
    from tests.router.test_token_policy import _router

    real, release, compiling = engine.grammar.check, threading.Event(), threading.Event()

    def slow_check(g):
        if g.spec == "slow[a-z]+":
            compiling.set()
            release.wait(3)  # (on the loop, it would stall it this long, then the assertion fails)
            compiling.clear()
        return real(g)

    monkeypatch.setattr(engine.grammar, "check", slow_check)

    async def main():
        r = _router(monkeypatch, load_config(None, {}), FrontDoor())

        async def answer(rid: str, guided: pb.Guided | None) -> list:
            req = pb.GenerateRequest(request_id=rid, prompt="x", sampling=pb.SamplingParams(max_tokens=2))
            if guided is not None:
                req.sampling.guided.CopyFrom(guided)
            return [x async for x in r.generate(req, "", None)]

        slow = asyncio.create_task(answer("slow", pb.Guided(regex="slow[a-z]+")))
        assert await asyncio.to_thread(compiling.wait, 3)
        other = await asyncio.wait_for(answer("other", None), 3)
        assert len(other) == 2 and other[-1].finish_reason and compiling.is_set()  # done while it compiles
        release.set()
        assert len(await slow) == 2

    asyncio.run(main())
