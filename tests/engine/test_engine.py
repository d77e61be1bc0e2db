"""Engine behaviour on the real model: chunked long prompts, bad input, abort, sampling, stops."""

from __future__ import annotations

import dataclasses

import random

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_long_prompt_prefills_in_chunks_while_others_decode(make_engine):
    eng = make_engine(budget=256, prefix=False)  # no cache hits: the long prompt must be computed
    shorts = [_ids(20 + i, seed=i) for i in range(3)]
    long = _ids(1600, seed=99)
    alone = {i: eng.generate([p], GREEDY)[0].token_ids for i, p in enumerate(shorts + [long])}

    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short_ids = [eng.add_request(p, sp) for p in shorts]
    tokens: dict[str, list[int]] = {}
    for _ in range(4):  # let the short ones start decoding
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    long_id = eng.add_request(long, GREEDY)
    req = eng.scheduler.requests[long_id]
    chunk_steps = 0
    while eng.has_unfinished():
        prefilling = req.num_computed_tokens < req.num_prompt_tokens and not req.is_finished
        outs = eng.step()
        got = {o.request_id for o in outs if o.new_token_ids}
        if prefilling and req.num_computed_tokens < req.num_prompt_tokens:
            chunk_steps += 1
            # Every step of the long prefill still gives each running short request a token.
            assert set(short_ids) <= got
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert chunk_steps >= 1600 // 256 - 1
    assert tokens[long_id] == alone[3]
    for i, rid in enumerate(short_ids):
        assert tokens[rid][:24] == alone[i]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(stop=5), "lists"),
])
def test_bad_sampling_params_are_refused(kwargs, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kwargs)


def test_none_stop_lists_mean_empty():
    sp = SamplingParams(stop=None, stop_token_ids=None)
    assert sp.stop == [] and sp.stop_token_ids == []


def test_bad_requests_leave_the_engine_undisturbed(make_engine):
    eng = make_engine(memory_gb=0.05)
    running = eng.add_request("Hello there", GREEDY)
    eng.step()
    with pytest.raises(InvalidRequestError, match="context limit"):
        eng.add_request(_ids(eng.max_model_len + 5, 1), GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        eng.add_request([1, 2, 10**9], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("again", GREEDY, request_id=running)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        eng.add_request(None, GREEDY)
    outs = [o for o in eng.stream() if o.finished]
    assert [o.request_id for o in outs] == [running]
    assert len(outs[0].token_ids) == 24


def test_a_hugging_face_model_id_resolves_from_the_local_cache_only(tmp_path, model_path, monkeypatch):
    import huggingface_hub.constants

    from engine.models.loader import resolve_model_path
    repo = tmp_path / "models--acme--smol"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in model_path.iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("acme/smol") == snap
    with pytest.raises(ModelLoadError, match="Hugging Face cache") as e:
        resolve_model_path("acme/other")
    assert "huggingface-cli download acme/other" in str(e.value)


def test_unknown_model_path_and_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")), progress=False)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path)), progress=False)
    with pytest.raises(ValueError, match="attention backend"):
        LLMEngine(EngineConfig(attention_backend="nope"), progress=False)
    with pytest.raises(ValueError, match="multiple of 256"):
        LLMEngine(EngineConfig(attention_backend="flash_attn"), progress=False)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=12)


def test_abort_frees_blocks_at_any_point(make_engine):
    eng = make_engine(budget=32)
    a = eng.add_request(_ids(100, 1), GREEDY)  # mid-prefill after one step (chunked)
    b = eng.add_request(_ids(10, 2), GREEDY)
    c = eng.add_request(_ids(10, 3), GREEDY)  # still waiting
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort(a) and eng.abort(c)
    assert not eng.abort("no-such-request")
    outs = [o for o in eng.stream() if o.finished]
    assert [o.request_id for o in outs] == [b]
    assert eng.block_manager.num_used_blocks == 0


def test_preemption_by_recompute_keeps_greedy_output(make_engine):
    # 12 blocks of 16 tokens cannot hold 4 requests of 40+24 tokens at once: some get preempted.
    eng = make_engine(num_blocks=12)
    prompts = [_ids(40, s) for s in range(4)]
    alone = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    reqs = [eng.scheduler.requests[i] for i in ids]
    final = {o.request_id: o for o in eng.stream() if o.finished}
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [final[i].token_ids for i in ids] == alone


def test_seeded_sampling_reproducible_and_batched(make_engine):
    eng = make_engine()
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    first = eng.generate(["Tell me a story"], sp)[0].token_ids
    mixed = eng.generate(
        ["Tell me a story", "Tell me a story", "Another prompt"],
        [sp, SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True),
         SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)])
    assert mixed[0].token_ids == first  # same seed, same output, whatever shares the batch
    assert mixed[1].token_ids != first


@pytest.mark.parametrize("penalties", [{}, {"frequency_penalty": 0.7, "presence_penalty": 0.4}],
                         ids=["plain", "penalties"])
def test_a_seeded_request_resumed_mid_stream_gives_the_undisturbed_tokens(make_engine, tokenizer, penalties):
    """What the router does after a lost worker: the tokens streamed so far become prompt and
    the rest runs as a new request with ``resumed``; a seeded request then goes on exactly as
    it would have (its draws follow the output index; its earlier output still counts for the
    penalties). Without ``resumed`` it does not."""
    eng = make_engine()
    ids = tokenizer("Tell me a story about a lighthouse")["input_ids"]
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=4321, ignore_eos=True, **penalties)
    whole = eng.generate([ids], sp)[0].token_ids
    k = 9
    rest = eng.generate([ids + whole[:k]], dataclasses.replace(sp, max_tokens=24 - k, resumed=k))[0].token_ids
    assert whole[:k] + rest == whole
    fresh = eng.generate([ids + whole[:k]], dataclasses.replace(sp, max_tokens=24 - k))[0].token_ids
    assert fresh != whole[k:]  # the test can tell: a restart from index 0 draws other tokens


def test_stop_strings_and_stop_tokens(make_engine, tokenizer):
    eng = make_engine()
    base = eng.generate(["The capital of France is"], GREEDY)[0]
    assert base.text.startswith(" Paris")
    out = eng.generate(["The capital of France is"],
                       SamplingParams(max_tokens=24, temperature=0, stop=["aris"]))[0]
    assert out.text == " P" and out.finish_reason == "stop"
    tok = base.token_ids[2]
    out = eng.generate(["The capital of France is"],
                       SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tok]))[0]
    assert out.token_ids == base.token_ids[:3] and out.finish_reason == "stop"
    out = eng.generate(["The capital of France is"], SamplingParams(max_tokens=5, temperature=0,
                                                                      ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_plain_prompt_and_chat_messages(make_engine, tokenizer):
    eng = make_engine()
    assert eng.tokenize("Hello world") == tokenizer("Hello world")["input_ids"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = eng.tokenize(messages=msgs)
    assert ids == tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    rid = eng.add_request(messages=msgs, params=SamplingParams(max_tokens=20, temperature=0))
    final = [o for o in eng.stream() if o.finished][0]
    assert final.request_id == rid and "Paris" in final.text


def test_streamed_deltas_concatenate_to_final_text(make_engine):
    eng = make_engine()
    eng.add_request("Write a haiku about the sea.", SamplingParams(max_tokens=30, temperature=0))
    deltas, final = [], None
    for o in eng.stream():
        deltas.append(o.new_text)
        final = o
    assert "".join(deltas) == final.text
    assert final.ttft is not None and final.ttft > 0


def test_deltas_with_stop_string_never_take_text_back(make_engine, tokenizer):
    eng = make_engine()
    base = eng.generate(["The capital of France is"], GREEDY)[0]
    stop = base.text[8:14]  # a stop string somewhere inside the greedy continuation
    eng.add_request("The capital of France is", SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    deltas, final = [], None
    for o in eng.stream():
        deltas.append(o.new_text)
        final = o
    assert final.finish_reason == "stop"
    assert "".join(deltas) == final.text == base.text[:base.text.index(stop)]


def test_incremental_text_equals_full_decode(make_engine, tokenizer):
    eng = make_engine()
    # Emoji and accented text: multi-byte characters split across byte-level BPE tokens.
    eng.add_request("Répète après moi: 🙂🚀 café, naïve, 東京", SamplingParams(max_tokens=40, temperature=0.8,
                                                                          seed=3, ignore_eos=True))
    deltas, final = [], None
    for o in eng.stream():
        assert "\ufffd" not in o.new_text or o.finished
        deltas.append(o.new_text)
        final = o
    assert "".join(deltas) == final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_layer_done_fires_after_each_layer_kv_is_written(make_engine):
    from engine.request import Request
    from engine.scheduler import ScheduledRequest, StepPlan
    eng = make_engine(prefix=False)
    req = Request("x", _ids(40, 5), SamplingParams(max_tokens=1))
    assert eng.block_manager.allocate(req.block_ids, 40)
    slots = [b * 16 + o for b in req.block_ids for o in range(16)][:40]
    seen = []

    def done(i):
        k, _ = eng.runner.kv_caches[i]
        seen.append((i, bool(k[slots].abs().sum() > 0)))
        if i + 1 < len(eng.runner.kv_caches):  # the next layer has not been written yet
            assert eng.runner.kv_caches[i + 1][0][slots].abs().sum() == 0

    for k, v in eng.runner.kv_caches:
        k[slots] = 0
        v[slots] = 0
    eng.runner.execute(StepPlan([ScheduledRequest(req, 40)]), layer_done=done)
    eng.block_manager.free(req.block_ids)
    assert seen == [(i, True) for i in range(eng.model_config.num_layers)]
