"""Structured outputs in the engine (engine/grammar.py): every token of every path is one the
grammar allows, outputs parse and validate, and unconstrained neighbours are untouched.

Most tests run a tiny random Llama with the bundled tokenizer: its unmasked output is noise, so
a valid result can only come from the mask. One runs the real bundled model.
"""

from __future__ import annotations

import collections
import json
import shutil

import jsonschema
import pytest
import torch

from engine.config import SpeculativeConfig
from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler, MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, check
from engine.request import Guided, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["id", "kind", "ok", "tags"], "additionalProperties": False}
JSON = Guided("json_schema", json.dumps(SCHEMA))
REGEX = Guided("regex", r"(yes|no|maybe) [0-9]{2,4}")
CHOICE = Guided("choice", json.dumps(["red", "green", "blue"]))
PROMPTS = ["Describe a pet as JSON:", "The answer is", "My favourite colour, in one word, is a colour that many "
           "people like and that is often seen in flags of countries around the world:"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    import transformers as tf
    path = tmp_path_factory.mktemp("tiny-grammar")
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / f, path / f)
    return path


def _replay(eng, guided: Guided, tokens: list[int]) -> None:
    """Every token in turn is one a fresh matcher allows (EOS excepted: the engine stops there)."""
    state = eng.grammars.state(guided)
    for i, t in enumerate(tokens):
        if t in eng.eos_token_ids and state.matcher.is_accepting():
            assert i == len(tokens) - 1
            return
        assert state.matcher.consume_token(t), (i, t, eng.tokenizer.decode(tokens), state.matcher.get_error())


def _valid(text: str, guided: Guided) -> None:
    if guided.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(guided.spec))
    elif guided.kind == "regex":
        import re
        assert re.fullmatch(guided.spec, text), text
    elif guided.kind == "choice":
        assert text in json.loads(guided.spec)


@pytest.mark.parametrize("bad, msg", [
    (Guided("json_schema", "{not json"), "not valid JSON"),
    (Guided("json_schema", "[1, 2]"), "must be an object"),
    (Guided("json_schema", json.dumps({"type": "frobnicate"})), "json_schema"),
    (Guided("json_schema", '{"a": ' * (MAX_SCHEMA_DEPTH + 2) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 2)), "nested deeper"),
    (Guided("json_schema", " " * (MAX_SPEC_CHARS + 1)), "limit is"),
    (Guided("regex", "(unclosed"), "regex"),
    (Guided("grammar", "start: ( undefined_rule"), "grammar"),
    (Guided("choice", "[]"), "non-empty list"),
    (Guided("xml", ""), "guided kind must be one of"),
])
def test_bad_constraints_are_invalid_requests(bad, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(guided=bad)


def test_check_is_cached_and_accepts_every_kind():
    for g in (JSON, REGEX, CHOICE, Guided("json_object"), Guided("grammar", 'start: "a" | "b" "c"'),
              Guided("grammar", 'root ::= "x" [0-9]+')):
        check(g)
        SamplingParams(guided=g)
    assert check.cache_info().hits >= 1


@pytest.mark.parametrize("compile_decode", [True, False], ids=["single-token", "batched"])
def test_every_token_allowed_and_neighbours_untouched(make_engine, tiny, compile_decode):
    # budget 16: the long prompt prefills in chunks and samples its first token on the last one
    eng = make_engine(model=tiny, budget=16, compile_decode=compile_decode)
    plain = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=1.0, seed=7)]
    alone = eng.generate(PROMPTS[:2], plain)
    guided = [SamplingParams(max_tokens=60, temperature=0, guided=JSON),
              SamplingParams(max_tokens=60, temperature=0.9, seed=1, guided=JSON),
              SamplingParams(max_tokens=30, temperature=1.0, seed=2, guided=REGEX),
              SamplingParams(max_tokens=10, temperature=0, guided=CHOICE)]
    outs = eng.generate(PROMPTS[:2] + [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2]], plain + guided)
    for o, a in zip(outs[:2], alone):  # the constrained neighbours changed nothing
        assert o.token_ids == a.token_ids
    for o, p in zip(outs[2:], guided):
        _replay(eng, p.guided, o.token_ids)
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        _valid(o.text, p.guided)


def test_speculative_verify_respects_the_grammar(make_engine, tiny):
    # layer_skip drafts of a random model: mostly tokens the grammar refuses, so verify rejects
    spec = SpeculativeConfig(method="layer_skip", draft_layers=1, num_speculative_tokens=4, adaptive=False)
    eng = make_engine(model=tiny, speculative=spec)
    ref = make_engine(model=tiny)
    params = [SamplingParams(max_tokens=60, temperature=0, guided=JSON),
              SamplingParams(max_tokens=60, temperature=0.8, seed=5, guided=JSON),
              SamplingParams(max_tokens=30, temperature=0, guided=REGEX),
              SamplingParams(max_tokens=24, temperature=0)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    got, want = eng.generate(prompts, params), ref.generate(prompts, params)
    assert eng.spec.draft_tokens > 0
    for g, w, p in zip(got, want, params):
        if p.greedy:  # exact: speculation never changes a greedy output, constrained or not
            assert g.token_ids == w.token_ids
        if p.guided is not None:
            _replay(eng, p.guided, g.token_ids)
            _valid(g.text, p.guided)


def test_grammar_follows_the_pd_hop_and_a_rerun(make_engine, tiny):
    from tests.engine.test_disaggregation import _copy_kv
    single, prefill, decode = make_engine(model=tiny), make_engine(model=tiny), make_engine(model=tiny, block_size=32)
    sp = SamplingParams(max_tokens=60, temperature=0, guided=JSON)
    want = single.generate([PROMPTS[0]], sp)[0]
    rid = prefill.add_request(PROMPTS[0], sp, request_id="r", prefill_only=True)
    first = [o for o in prefill.stream() if o.finished][0].token_ids[0]
    req = prefill.scheduler.requests[rid]
    blocks = decode.add_remote(req.prompt_token_ids, sp, request_id=rid).block_ids
    _copy_kv(prefill, req.block_ids, decode, blocks, req.num_prompt_tokens)
    prefill.release(rid)
    decode.kv_arrived(rid, first_token=first)
    got = [o for o in decode.stream() if o.finished][0]
    assert got.token_ids == want.token_ids  # the decode side's matcher started after `first`
    _valid(got.text, JSON)
    # A re-run after a lost worker: 5 tokens already streamed travel as the prompt's tail.
    done = want.token_ids[:5]
    ids = single.tokenize(PROMPTS[0]) + done
    rerun = SamplingParams(max_tokens=55, temperature=0, guided=JSON, resumed=5)
    out = single.generate([ids], rerun)[0]
    assert done + out.token_ids == want.token_ids


def _counting_steps(eng) -> collections.Counter:
    """Forwards that sampled for each request id, counted as ``eng`` runs."""
    steps: collections.Counter = collections.Counter()
    execute = eng.runner.execute

    def counted(plan, layer_done=None):
        result = execute(plan, layer_done)
        steps.update(result.sampled.keys())
        return result
    eng.runner.execute = counted
    return steps


@pytest.mark.parametrize("compile_decode", [True, False], ids=["single-token", "batched"])
def test_jump_forward_appends_forced_tokens_without_a_forward_each(make_engine, tiny, compile_decode):
    """EngineConfig.jump_forward: the schema's keys and punctuation arrive with the sampled
    token before them; every token is still one the grammar allows, the output validates, an
    unconstrained neighbour is untouched, and max_tokens and logprobs are respected."""
    eng = make_engine(model=tiny, jump_forward=16, compile_decode=compile_decode)
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = eng.generate([PROMPTS[1]], plain)[0]
    steps = _counting_steps(eng)
    sp = SamplingParams(max_tokens=60, temperature=0, guided=JSON)
    out, neighbour = eng.generate([PROMPTS[0], PROMPTS[1]], [sp, plain])
    assert neighbour.token_ids == alone.token_ids
    _replay(eng, JSON, out.token_ids)
    _valid(out.text, JSON)
    assert out.finish_reason == "stop"
    # the forced keys ("id", "kind", ...) came without forwards of their own
    assert steps[out.request_id] < len(out.token_ids) - 8, (steps[out.request_id], len(out.token_ids))
    # max_tokens cuts a forced run short, to the token
    short = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, guided=JSON))[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    # a request asking for logprobs is never jumped: one forward a token (each has its logprob)
    lp = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=60, temperature=0, guided=JSON, logprobs=0))[0]
    assert steps[lp.request_id] == len(lp.token_ids)
    _valid(lp.text, JSON)


@pytest.mark.parametrize("vocab", [96, 100, 31])
def test_the_native_mask_equals_torchs(vocab):
    """pd_mask_logits (native_decode.c) against the torch ops it replaces, bit for bit: words of
    zeros, of ones and mixed, masked rows among unmasked ones, a vocabulary that ends inside a
    word (the bits beyond it set and clear), and a bitmask wider than the logits."""
    import numpy as np

    from engine.grammar import apply_bitmask, apply_bitmask_torch
    from engine.models import native
    assert native.library() is not None  # (x86-64 with gcc: every machine of this project's kind)
    gen = np.random.default_rng(vocab)
    logits = torch.randn(5, vocab)
    rows = [4, 0, 2]
    words = (vocab + 31) // 32 + 1
    bits = gen.integers(-2**31, 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32)
    bits[0, 0], bits[1, 0], bits[2, -2:] = 0, -1, 0  # whole words forbidden / allowed
    got, want = apply_bitmask(logits, rows, bits), apply_bitmask_torch(logits, rows, bits)
    assert torch.equal(got, want) and torch.equal(got[[1, 3]], logits[[1, 3]])
    assert torch.isinf(got[4, :32]).all() and torch.equal(got[0, :32], logits[0, :32])


def test_compiled_grammars_are_cached(tokenizer):
    comp = GrammarCompiler(tokenizer, 49152, (2,))
    a, b = comp.state(JSON), comp.state(JSON)
    assert a.matcher is not b.matcher and len(comp._cache) == 1
    assert comp.state(REGEX) and len(comp._cache) == 2


def test_real_model_greedy_json_is_valid(make_engine):
    eng = make_engine()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    g = Guided("json_schema", json.dumps(schema))
    ids = eng.tokenize(messages=[{"role": "user", "content": "Give me a person as JSON with a name and an age."}])
    out = eng.generate([ids], SamplingParams(max_tokens=48, temperature=0, guided=g))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
