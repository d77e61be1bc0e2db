"""Router-side validation of GenerateRequest: every bad input named, good ones converted."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from pdserve.v1 import pdserve_pb2 as pb
from router.requests import Limits, prompt_ids, request_id, sampling_params

LIMITS = Limits(context_length=64, vocab_size=49152, default_max_tokens=16)


def _req(**kw):
    sampling = kw.pop("sampling", {})
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)


def _parse(req, tokenizer):
    ids = prompt_ids(req, tokenizer, LIMITS)
    return ids, sampling_params(req.sampling, LIMITS, len(ids))


def test_prompt_token_ids_and_messages(tokenizer):
    ids, sp = _parse(_req(prompt="Hello world"), tokenizer)
    assert ids == tokenizer("Hello world")["input_ids"]
    assert sp.max_tokens == 16 and sp.greedy  # defaults: greedy, default_max_tokens
    ids, _ = _parse(_req(token_ids=pb.TokenIds(ids=[5, 6, 7])), tokenizer)
    assert ids == [5, 6, 7]
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    ids, _ = _parse(_req(messages=msgs), tokenizer)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    _, sp = _parse(_req(prompt="x", sampling=dict(temperature=0.7, top_p=0.9, seed=3, stop=["\n"])), tokenizer)
    assert (sp.temperature, sp.seed, sp.stop) == (pytest.approx(0.7), 3, ["\n"])
    assert sp.top_p == pytest.approx(0.9)


@pytest.mark.parametrize("req,needle", [
    (_req(), "no input"),
    (_req(prompt=""), "empty"),
    (_req(prompt="word " * 80), "context length"),
    (_req(token_ids=pb.TokenIds(ids=[1, 10**6])), "token_ids must be in"),
    (_req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])), "unknown chat role"),
    (_req(prompt="hi", sampling=dict(max_tokens=0)), "max_tokens must be >= 1"),
    (_req(prompt="hi", sampling=dict(max_tokens=1000)), "does not fit"),
    (_req(prompt="hi", sampling=dict(temperature=-1.0)), "temperature"),
    (_req(prompt="hi", sampling=dict(top_p=0.0)), "top_p"),
    (_req(prompt="hi", sampling=dict(top_p=1.5)), "top_p"),
    (_req(prompt="hi", sampling=dict(stop_token_ids=[60000])), "stop_token_ids"),
])
def test_bad_requests_are_named(req, needle, tokenizer):
    with pytest.raises(InvalidRequestError, match=needle):
        _parse(req, tokenizer)


def test_messages_to_a_model_without_a_chat_template_are_bad_input(tokenizer):
    """A base model (gemma3-270m) has no chat template: INVALID_ARGUMENT / HTTP 400 naming
    messages, not transformers' ValueError surfacing as an internal error."""
    import copy
    base = copy.copy(tokenizer)
    base.chat_template = None
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    with pytest.raises(InvalidRequestError, match="^messages: this model has no chat template"):
        _parse(_req(messages=msgs), base)
    assert _parse(_req(prompt="hi"), base)[0] == tokenizer("hi")["input_ids"]  # plain prompts still work


@pytest.mark.parametrize("rid,ok", [("", True), ("req-1_a.b:c", True), ("r" * 128, True), ("r" * 129, False),
                                    ("🦩" * 250, False), ("a b", False), ("tab\there", False), ("é", False)])
def test_request_ids_are_short_printable_ascii(rid, ok):
    """The id names the request in every KV frame header: one that cannot fit is refused here."""
    if ok:
        got = request_id(pb.GenerateRequest(request_id=rid), LIMITS)
        assert got == rid or (not rid and len(got) == 32)
    else:
        with pytest.raises(InvalidRequestError, match="request_id"):
            request_id(pb.GenerateRequest(request_id=rid), LIMITS)


def _big(n: int) -> list[str]:
    return ["x"] * n


@pytest.mark.parametrize("req,needle", [
    (_req(prompt="é" * 131073), "prompt has 262146 bytes; the limit is 262144"),
    (_req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 257)),
     "messages has 257 messages; the limit is 256"),
    (_req(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x" * 140000)] * 2)),
     "messages has 280000 bytes of content"),
    (_req(token_ids=pb.TokenIds(ids=[5] * 64)), "token_ids has 64 ids"),
    (_req(prompt="x", sampling=dict(stop=_big(17))), "stop has 17 strings; the limit is 16"),
    (_req(prompt="x", sampling=dict(stop=["ok", "y" * 257])), "stop[1] has 257 characters; the limit is 256"),
    (_req(prompt="x", sampling=dict(stop_token_ids=[1] * 65)), "stop_token_ids has 65 ids; the limit is 64"),
])
def test_every_input_has_a_limit_named_in_its_error(req, needle, tokenizer):
    """Each limit (config ``limits``, defaults here) is checked before the tokenizer runs."""
    class Untouchable:  # a limit must refuse before tokenizing: the tokenizer is never called
        def __call__(self, *a, **k):
            raise AssertionError("tokenized an over-limit prompt")
        apply_chat_template = __call__
    tok = tokenizer if needle.startswith("stop") else Untouchable()
    with pytest.raises(InvalidRequestError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        _parse(req, tok)
