"""The engine's disaggregation hooks: prefill-only requests hold their KV until released, a
decode engine reserves blocks, receives the KV and continues. In-process, KV copied by slots
(kvtransfer moves it across processes); greedy output must equal a single engine's."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError

from engine.request import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "Q: What is 17 times 3?\nA:", "A list of colours: red, green,"]


def _slots(block_ids, block_size, n):
    return torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in range(n)])


def _copy_kv(src, src_blocks, dst, dst_blocks, n):
    s = _slots(src_blocks, src.block_manager.block_size, n)
    d = _slots(dst_blocks, dst.block_manager.block_size, n)
    for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches):
        dk[d] = sk[s].to(dk.dtype)
        dv[d] = sv[s].to(dv.dtype)


def test_prefill_then_remote_decode_matches_single_engine(make_engine):
    single = make_engine()
    sp = SamplingParams(max_tokens=32, temperature=0)
    want = single.generate(PROMPTS, sp)
    prefill, decode = make_engine(block_size=16), make_engine(block_size=32)

    ids = [prefill.add_request(p, sp, request_id=f"r{i}", prefill_only=True) for i, p in enumerate(PROMPTS)]
    firsts = {o.request_id: o for o in prefill.stream() if o.finished}
    assert all(firsts[i].finish_reason == "prefilled" for i in ids)
    assert prefill.block_manager.num_used_blocks > 0  # held for the transfer
    for i, rid in enumerate(ids):
        req = prefill.scheduler.requests[rid]
        blocks = decode.add_remote(req.prompt_token_ids, sp, request_id=rid).block_ids
        assert blocks is not None
        _copy_kv(prefill, req.block_ids, decode, blocks, req.num_prompt_tokens)
        assert prefill.release(rid)
        decode.kv_arrived(rid, first_token=firsts[rid].token_ids[0])
    assert prefill.block_manager.num_used_blocks == 0
    got = {}
    for o in decode.stream():
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            assert o.token_ids == want[ids.index(o.request_id)].token_ids
            assert o.text == want[ids.index(o.request_id)].text
    # Streamed tokens are the ones after the prefill's first token.
    for i, rid in enumerate(ids):
        assert [firsts[rid].token_ids[0]] + got[rid] == want[i].token_ids


def test_abort_in_every_disaggregation_state_frees_blocks(make_engine):
    prefill, decode = make_engine(), make_engine()
    sp = SamplingParams(max_tokens=8, temperature=0)
    prefill.add_request("Hello there", sp, request_id="p", prefill_only=True)
    list(prefill.stream())
    assert prefill.block_manager.num_used_blocks > 0
    assert prefill.abort("p") and prefill.block_manager.num_used_blocks == 0
    assert not prefill.release("p")

    assert decode.add_remote([1, 2, 3, 4, 5], sp, request_id="d", first_token=7) is not None
    assert decode.block_manager.num_used_blocks == 1
    assert not list(decode.stream())  # nothing to compute while the KV is in flight
    assert decode.abort("d") and decode.block_manager.num_used_blocks == 0


def test_add_remote_is_not_now_when_blocks_are_short(make_engine):
    decode = make_engine(num_blocks=4)
    sp = SamplingParams(max_tokens=4, temperature=0)
    assert decode.add_remote(list(range(100, 150)), sp, request_id="a") is not None  # 4 blocks
    assert decode.add_remote([1, 2, 3], sp, request_id="b") is None
    assert "b" not in decode.scheduler.requests
    with pytest.raises(InvalidRequestError, match="first token"):
        decode.kv_arrived("a")  # the prefill's first token has not been given
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        decode.kv_arrived("a", first_token=10**9)
    decode.abort("a")


def _remote(decode, prompt_ids, first, sp, rid):
    assert decode.add_remote(prompt_ids, sp, request_id=rid) is not None
    return decode.kv_arrived(rid, first_token=first)


def test_first_token_from_prefill_can_finish_the_request(make_engine):
    decode = make_engine()
    eos = decode.eos_token_ids[0]
    out = _remote(decode, [5, 6, 7], 42, SamplingParams(max_tokens=1), "len")
    assert out.finished and out.finish_reason == "length" and out.token_ids == [42]
    out = _remote(decode, [5, 6, 7], eos, SamplingParams(max_tokens=9), "eos")
    assert out.finished and out.finish_reason == "stop"
    out = _remote(decode, [5, 6, 7], 42, SamplingParams(max_tokens=9, stop_token_ids=[42]), "stopid")
    assert out.finished and out.finish_reason == "stop"
    nl = decode.tokenizer("\n")["input_ids"][0]
    out = _remote(decode, [5, 6, 7], nl, SamplingParams(max_tokens=9, stop=["\n"]), "stopstr")
    assert out.finished and out.finish_reason == "stop" and out.text == ""
    assert decode.block_manager.num_used_blocks == 0
    with pytest.raises(KeyError, match="not waiting"):
        decode.kv_arrived("len", first_token=1)
    # The KV that arrived is cached even when the first token ends the request.
    long = list(range(100, 100 + 2 * decode.block_manager.block_size + 1))
    assert _remote(decode, long, 42, SamplingParams(max_tokens=1), "long").finished
    assert decode.add_remote(long, SamplingParams(max_tokens=1), request_id="next").token_start == len(long) - 1
    decode.abort("next")


def test_seeded_sampling_is_the_same_disaggregated(make_engine):
    single, prefill, decode = make_engine(), make_engine(), make_engine()
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    want = single.generate(["Tell me a story"], sp)[0].token_ids
    rid = prefill.add_request("Tell me a story", sp, request_id="s", prefill_only=True)
    first = [o for o in prefill.stream() if o.finished][0].token_ids[0]
    req = prefill.scheduler.requests[rid]
    blocks = decode.add_remote(req.prompt_token_ids, sp, request_id=rid).block_ids
    _copy_kv(prefill, req.block_ids, decode, blocks, req.num_prompt_tokens)
    prefill.release(rid)
    assert decode.kv_arrived(rid, first_token=first) is None
    got = [o for o in decode.stream() if o.finished][0].token_ids
    assert got == want



@pytest.mark.parametrize("stop", [[], ["@@@@"]], ids=["no-stop", "stop-never-hit"])
def test_streamed_text_across_the_handoff_equals_a_single_engine(make_engine, stop):
    """The prefill streams the first token's text (holding back a tail that could still begin
    a stop string); the decode side must continue exactly after what was sent."""
    sp = SamplingParams(max_tokens=12, temperature=0, stop=stop)
    want = make_engine().generate(PROMPTS[:3], sp)
    prefill, decode = make_engine(), make_engine()
    ids = [prefill.add_request(p, sp, request_id=f"r{i}", prefill_only=True) for i, p in enumerate(PROMPTS[:3])]
    firsts = {o.request_id: o for o in prefill.stream() if o.finished}
    streamed = {rid: firsts[rid].new_text for rid in ids}
    for rid in ids:
        req = prefill.scheduler.requests[rid]
        blocks = decode.add_remote(req.prompt_token_ids, sp, request_id=rid).block_ids
        _copy_kv(prefill, req.block_ids, decode, blocks, req.num_prompt_tokens)
        prefill.release(rid)
        decode.kv_arrived(rid, first_token=firsts[rid].token_ids[0])
    for o in decode.stream():
        streamed[o.request_id] += o.new_text
    for i, rid in enumerate(ids):
        assert streamed[rid] == want[i].text and want[i].text


def test_add_remote_shares_a_cached_prefix_and_only_the_rest_arrives(make_engine):
    """Decode-side prefix reuse: a prompt whose leading blocks the decode engine already caches
    (an earlier request's) shares them; only the positions after them are received, and the
    output equals a single engine's. Aborting it keeps the shared blocks cached for the next."""
    sp = SamplingParams(max_tokens=16, temperature=0)
    single, prefill, decode = make_engine(), make_engine(), make_engine()
    bs = decode.block_manager.block_size
    shared = single.tokenize("The quick brown fox jumps over the lazy dog. " * 6)[:3 * bs]
    first_ids, second_ids = shared + single.tokenize(" Count the foxes."), shared + single.tokenize(" And the dogs?")
    want = single.generate([second_ids], sp)[0].token_ids
    decode.generate([first_ids], sp)  # leaves the shared prefix in decode's cache (3 full blocks)
    cached = {b for b in range(decode.block_manager.num_blocks) if decode.block_manager.block_hash[b] is not None}

    rid = prefill.add_request(second_ids, sp, request_id="r", prefill_only=True)
    first = [o for o in prefill.stream() if o.finished][0].token_ids[0]
    req = prefill.scheduler.requests[rid]
    slot = decode.add_remote(second_ids, sp, request_id=rid)
    assert slot.token_start == 3 * bs and set(slot.block_ids[:3]) <= cached
    # Only [token_start, prompt) crosses; the shared blocks are never written.
    before = [kv.clone() for kv in decode.runner.kv_caches[0]]
    s = _slots(req.block_ids, bs, len(second_ids))[slot.token_start:]
    d = _slots(slot.block_ids, bs, len(second_ids))[slot.token_start:]
    for (sk, sv), (dk, dv) in zip(prefill.runner.kv_caches, decode.runner.kv_caches):
        dk[d], dv[d] = sk[s], sv[s]
    assert torch.equal(decode.runner.kv_caches[0][0][_slots(slot.block_ids, bs, 3 * bs)],
                       before[0][_slots(slot.block_ids, bs, 3 * bs)])
    prefill.release(rid)
    assert decode.kv_arrived(rid, first_token=first) is None
    got = [o for o in decode.stream() if o.finished][0].token_ids
    assert got == want

    # Not-now and abort leave the shared blocks cached (reference counts back to zero).
    again = decode.add_remote(second_ids, sp, request_id="again")
    assert again.token_start == (len(second_ids) - 1) // bs * bs  # the whole prompt but its last block now
    assert decode.abort("again") and decode.block_manager.num_used_blocks == 0
    assert decode.add_remote(second_ids, sp, request_id="third").token_start == again.token_start
    decode.abort("third")
