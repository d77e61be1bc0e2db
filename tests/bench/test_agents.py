"""bench/agents.py: its schemas and tools are valid JSON schemas the engine's grammar compiler
accepts, and its checks tell valid answers from invalid ones (the cluster run is the benchmark)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.agents import SCHEMAS, TOOLS, call_errors, call_names, looks_like_call, main, plan, schema_error
from engine.grammar import GrammarCompiler, GrammarState
from engine.request import Guided
from router.tools import call_grammar


def test_the_schemas_are_ten_distinct_valid_schemas_with_three_asks_each():
    assert len({name for name, _, _ in SCHEMAS}) == len(SCHEMAS) == 10
    for _, schema, asks in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        assert len(set(asks)) == 3
    for t in TOOLS:
        jsonschema.Draft202012Validator.check_schema(t["function"]["parameters"])


def test_every_schema_and_the_tool_grammar_compile_for_a_real_tokenizer(tokenizer):
    gc = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    # (state() raises InvalidRequestError, naming the problem, for a constraint that does not compile)
    states = [gc.state(Guided("json_schema", json.dumps(schema))) for _, schema, _ in SCHEMAS]
    states.append(gc.state(call_grammar(TOOLS, None, special_tokens=False)))
    assert all(isinstance(s, GrammarState) for s in states)


def test_schema_error_accepts_a_valid_answer_and_names_what_is_wrong():
    todo = dict((n, s) for n, s, _ in SCHEMAS)["todo"]
    assert schema_error('[{"task": "bake", "done": false, "priority": "high"}]', todo) is None
    assert schema_error('[{"task": "bake", "done": false, "priority": "urgent"}]', todo).startswith("invalid")
    assert schema_error('[{"task": "bake", "done": false, "priority": "high"}', todo).startswith("not JSON")
    assert schema_error(None, todo).startswith("not JSON")
    shape = dict((n, s) for n, s, _ in SCHEMAS)["shape"]
    assert schema_error('{"kind": "circle", "radius": 3}', shape) is None
    assert schema_error('{"kind": "circle", "width": 3, "height": 2}', shape) is not None


def test_call_errors_check_the_name_and_the_arguments_against_the_functions_schema():
    def call(name, args):
        return {"function": {"name": name, "arguments": json.dumps(args)}}
    assert call_errors([call("get_weather", {"city": "Oslo", "unit": "celsius"})], TOOLS) == []
    assert call_errors([call("get_weather", {"city": "Oslo", "unit": "kelvin"})], TOOLS)[0].startswith("get_weather")
    assert call_errors([call("launch", {})], TOOLS) == ["unknown function 'launch'"]
    assert call_errors([{"function": {"name": "search_web", "arguments": "{"}}], TOOLS)[0].endswith(
        "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")
    assert call_errors(None, TOOLS) == []


def test_an_answer_that_is_a_calls_json_is_seen_as_a_call_whatever_the_parser_made_of_it():
    assert looks_like_call('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert looks_like_call('```json\n{"name": "nope", "parameters": {}}\n```')
    assert looks_like_call('[{"name": "search_web", "arguments": {}}]')
    assert not looks_like_call("The weather in Oslo is mild.")
    assert not looks_like_call('{"city": "Oslo"}')
    assert not looks_like_call(None)
    assert call_names('```json\n[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {}}]\n```') == ["a", "b"]


def test_the_plan_covers_every_schema_and_every_ask_and_alternates_tool_choices():
    p = plan(60, 6)
    schema = [s for s in p if s["kind"] == "schema"]
    assert len(schema) == 60 and {s["schema_name"] for s in schema} == {n for n, _, _ in SCHEMAS}
    assert {(s["schema_name"], s["ask"]) for s in schema} == {(n, a) for n, _, asks in SCHEMAS for a in asks}
    assert [s["kind"] for s in p[60:]] == ["required", "auto"] * 3


@pytest.mark.parametrize("argv", [["--modes", "sideways"], ["--speculative", ""]])
def test_bad_arguments_are_refused_before_anything_starts(argv, capsys):
    assert main(argv) == 2
    assert "--modes takes" in capsys.readouterr().err
