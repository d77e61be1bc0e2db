"""Structured outputs and tools through the API layers (issue 45): OpenAI ``response_format``,
vLLM's ``guided_*``, ``tools`` + ``tool_choice`` onto ``pdserve.v1`` and into SamplingParams,
tool calls parsed back into OpenAI's shape, bad schemas a 400 naming the parameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.grammar import grammar_text
from engine.request import Guided
from pdserve.v1 import pdserve_pb2 as pb
from router.openai_api import ChatCompletionRequest, CompletionRequest, Shaper, parse, requests_for
from router.requests import Limits, prompt_ids, sampling_params, with_tool_choice
from router.tools import call_grammar, parse_calls
from tests.router.front_door_fakes import CHAT, COMPLETION, Served

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
QWEN = Path.home() / ".cache/pdserve/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m-1d9614638d18024d"


def _one(kind, **body) -> pb.GenerateRequest:
    _, [g] = requests_for(parse(kind, {"model": "m", **body}), "x", 16)
    return g


def _params(g: pb.GenerateRequest, tokenizer=None):
    lim = Limits(context_length=4096, vocab_size=200_000)
    p = sampling_params(g.sampling, lim, 10)
    return with_tool_choice(g, p, tokenizer) if tokenizer is not None else p


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
    if not (QWEN / "tokenizer.json").exists():
        pytest.skip("the Qwen2.5-Coder-0.5B tokenizer is not in the model cache (make models)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(QWEN))


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
        sh = Shaper(True, "r", "m", 1, tools=True)
        parts = [text[:30], text[30:]]
        rs = [pb.GenerateResponse(text=parts[0]),
              pb.GenerateResponse(text=parts[1], finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage())]
        if stream:
            return [sh.chunk(0, r) for r in rs]
        for r in rs:
            sh.add(0, r)
        return sh.whole(1)

    whole = answer(False)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and len(whole["message"]["tool_calls"]) == 2
    assert whole["message"]["content"] == "Let me check."
    first, last = answer(True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # held: calls or not is known at the end
    d = last["choices"][0]
    assert d["finish_reason"] == "tool_calls" and [c["index"] for c in d["delta"]["tool_calls"]] == [0, 1]
    # without tools nothing is parsed
    sh = Shaper(True, "r", "m", 1)
    sh.add(0, pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))
    assert sh.whole(1)["choices"][0]["message"] == {"role": "assistant", "content": text}
