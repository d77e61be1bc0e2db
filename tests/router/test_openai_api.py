"""The OpenAI API's shapes (router.openai_api): requests onto pdserve.v1 messages, refusals
naming their parameter, router refusals onto HTTP statuses, responses in OpenAI's fields."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from router.openai_answer import Shaper, usage
from router.openai_api import (COMPLETION_MAX_TOKENS, ApiError, ChatCompletionRequest, CompletionRequest, api_error,
                               parse, requests_for)


def _one(kind, **body):
    req = parse(kind, {"model": "m", **body})
    return requests_for(req, "x", 16)[1]


def _refused(kind, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        requests_for(parse(kind, {"model": "m", **body}), "x", 16)
    assert e.value.status == 400
    return e.value


def test_a_completion_maps_every_field_and_takes_openais_defaults():
    [g] = _one(CompletionRequest, prompt="Hi")
    s = g.sampling
    assert g.prompt == "Hi" and s.max_tokens == COMPLETION_MAX_TOKENS and s.temperature == 1.0
    assert not s.HasField("seed") and not s.HasField("top_p") and not s.stop
    [g] = _one(CompletionRequest, prompt=[1, 2, 3], max_tokens=5, temperature=0, top_p=0.5, top_k=3, min_p=0.1,
               repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5, stop="\n", seed=7,
               ignore_eos=True, stop_token_ids=[2])
    s = g.sampling
    assert list(g.token_ids.ids) == [1, 2, 3]
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop), list(s.stop_token_ids)) == \
        (5, 0.0, 0.5, 3, 7, ["\n"], [2])
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.2) and s.ignore_eos
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -0.5


def test_choices_are_prompt_major_with_seeds_per_choice_and_ids_per_choice():
    gs = _one(CompletionRequest, prompt=["a", "b"], n=3, seed=10)
    assert [g.prompt for g in gs] == ["a"] * 3 + ["b"] * 3
    assert [g.sampling.seed for g in gs] == [10, 11, 12] * 2
    assert len({g.request_id for g in gs}) == 6 and all(g.request_id.startswith("x-") for g in gs)
    [g1], [g2] = _one(CompletionRequest, prompt="a"), _one(CompletionRequest, prompt="a")
    assert g1.request_id != g2.request_id


def test_a_chat_maps_messages_text_parts_and_max_completion_tokens():
    [g] = _one(ChatCompletionRequest, messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
        max_completion_tokens=9, max_tokens=3)
    assert [(m.role, m.content) for m in g.messages.messages] == [("system", "Be brief."), ("user", "Hello")]
    assert g.sampling.max_tokens == 9
    [g] = _one(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}])
    assert not g.sampling.HasField("max_tokens")  # the router's default_max_tokens


@pytest.mark.parametrize("kind,body,param", [
    (CompletionRequest, {"prompt": "x", "temperature": 3}, "temperature"),
    (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "n": 0}, "n"),
    (CompletionRequest, {"prompt": "x", "n": 17}, "n"),
    (CompletionRequest, {"prompt": "x", "seed": -1}, "seed"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 2**31}, "max_tokens"),  # int32 in the gRPC messages
    (CompletionRequest, {"prompt": "x", "top_k": 2**31}, "top_k"),
    (CompletionRequest, {"prompt": [2**31]}, "prompt"),
    (CompletionRequest, {"prompt": [-1]}, "prompt"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [2**40]}, "stop_token_ids"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**31},
     "max_completion_tokens"),
    (CompletionRequest, {"prompt": ""}, "prompt"),
    (CompletionRequest, {"prompt": []}, "prompt"),
    (CompletionRequest, {"prompt": {"a": 1}}, "prompt"),
    (CompletionRequest, {}, "prompt"),
    (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "response_format": {"type": "xml"}}, "response_format"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes",
                             "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    (CompletionRequest, {"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "response_format"),
])
def test_bad_or_unsupported_input_is_a_400_naming_the_parameter(kind, body, param):
    assert _refused(kind, body).param == param


def test_unknown_fields_and_harmless_ones_are_accepted():
    [g] = _one(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], user="u", store=False,
               metadata={"a": "b"}, tools=[], tool_choice="none", response_format={"type": "text"},
               some_future_field=1)
    assert g.messages.messages[0].content == "x"


def test_too_many_choices_are_refused_before_the_body_is_validated():
    body = {"model": "m", "prompt": [[1]] * 200_000}
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, body, most_choices=16)
    assert e.value.param == "prompt" and "limits.choices" in str(e.value)
    with pytest.raises(ApiError):
        parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "n": 9}, most_choices=16)
    assert parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "n": 8}, most_choices=16).n == 8


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, [1, 2])
    assert e.value.status == 400


@pytest.mark.parametrize("code,status,param", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "max_tokens"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    (grpc.StatusCode.UNAVAILABLE, 503, None),
    (grpc.StatusCode.UNAUTHENTICATED, 401, None),
    (grpc.StatusCode.ALREADY_EXISTS, 409, None),
    (grpc.StatusCode.INTERNAL, 500, None),
])
def test_router_refusals_map_to_http_statuses(code, status, param):
    e = api_error(code, "max_tokens 9000 does not fit: the prompt has 3 tokens")
    assert (e.status, e.param) == (status, param)
    assert e.body()["error"]["message"].startswith("max_tokens 9000")


@pytest.mark.parametrize("message,param", [
    ("the prompt has 9000 tokens; the context length is 8192", "prompt"),
    ("token_ids must be in [0, 49152); got [99999]", "prompt"),
    ("unknown chat role 'tool'; valid: system, user, assistant", "messages"),
    ("stop has 20 strings; the limit is 16", "stop"),
])
def test_router_messages_name_the_openai_parameter(message, param):
    assert api_error(grpc.StatusCode.INVALID_ARGUMENT, message).param == param


def _r(text="", finish=0, usage=None, lps=()):
    return pb.GenerateResponse(text=text, finish_reason=finish, usage=usage, logprobs=list(lps))


def test_responses_have_openais_fields():
    chat = Shaper(True, "chatcmpl-1", "m", 1)
    first, later = chat.chunk(0, _r("Hel")), chat.chunk(0, _r("lo"))
    last = chat.chunk(0, _r("", pb.FINISH_REASON_STOP, pb.Usage(prompt_tokens=3, completion_tokens=2)))
    assert first["object"] == "chat.completion.chunk" and first["model"] == "m" and first["id"] == "chatcmpl-1"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert later["choices"][0]["delta"] == {"content": "lo"} and later["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert chat.usage_chunk(1)["usage"]["total_tokens"] == 5 and chat.usage_chunk(1)["choices"] == []
    text = Shaper(False, "cmpl-1", "m", 1)
    c = text.chunk(0, _r("a", pb.FINISH_REASON_LENGTH, pb.Usage()))
    assert c["object"] == "text_completion" and c["choices"][0] == {"index": 0, "text": "a", "logprobs": None,
                                                                     "finish_reason": "length"}
    u = usage([pb.Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=2),
               pb.Usage(prompt_tokens=5, completion_tokens=4, cached_prompt_tokens=5),
               pb.Usage(prompt_tokens=7, completion_tokens=1)], n=2)  # choices 0-1: prompt 0; 2: prompt 1
    assert u == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20,
                 "prompt_tokens_details": {"cached_tokens": 2}}
    whole = Shaper(True, "chatcmpl-2", "m", 2)
    whole.add(1, _r("b", pb.FINISH_REASON_LENGTH, pb.Usage(prompt_tokens=4, completion_tokens=1)))
    whole.add(0, _r("h"))
    whole.add(0, _r("i", pb.FINISH_REASON_STOP, pb.Usage(prompt_tokens=4, completion_tokens=2)))
    w = whole.whole(2)
    assert w["object"] == "chat.completion" and w["usage"]["prompt_tokens"] == 4 and w["usage"]["total_tokens"] == 7
    assert w["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "b"}, "logprobs": None, "finish_reason": "length"}]


def _lp(token, lp, *top):
    return pb.TokenLogprob(token_id=token, logprob=lp, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_logprobs_in_both_shapes():
    names = {1: "Hi", 2: " there", 3: "Yo"}.get
    text = Shaper(False, "c", "m", 1, names)
    a = text.chunk(0, _r("Hi", lps=[_lp(1, -0.5, (1, -0.5), (3, -1.0))]))["choices"][0]["logprobs"]
    b = text.chunk(0, _r(" there", lps=[_lp(2, -0.25, (2, -0.25), (1, -2.0))]))["choices"][0]["logprobs"]
    assert a == {"tokens": ["Hi"], "token_logprobs": [-0.5], "top_logprobs": [{"Hi": -0.5, "Yo": -1.0}],
                 "text_offset": [0]}
    assert b["text_offset"] == [2] and b["top_logprobs"] == [{" there": -0.25, "Hi": -2.0}]
    chat = Shaper(True, "c", "m", 1, names)
    chat.add(0, _r("Hi", lps=[_lp(1, -0.5, (1, -0.5))]))
    c = chat.whole(1)["choices"][0]["logprobs"]
    assert c == {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                              "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}],
                 "refusal": None}


def test_logprobs_requests_map_onto_sampling_logprobs():
    [g] = _one(CompletionRequest, prompt="x", logprobs=3)
    assert g.sampling.logprobs == 3
    [g] = _one(CompletionRequest, prompt="x")
    assert not g.sampling.HasField("logprobs")
    [g] = _one(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=5)
    assert g.sampling.logprobs == 5
    [g] = _one(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert g.sampling.HasField("logprobs") and g.sampling.logprobs == 0
    assert _refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                            "top_logprobs": 2}).param == "top_logprobs"
    assert _refused(CompletionRequest, {"prompt": "x", "logprobs": 6}).param == "logprobs"
    [g] = _one(CompletionRequest, prompt="x", logprobs=1, echo=True)
    assert g.sampling.prompt_logprobs == 1 and g.sampling.logprobs == 1
    [g] = _one(CompletionRequest, prompt="x", echo=True)
    assert not g.sampling.HasField("prompt_logprobs")


def test_echo_puts_the_prompt_and_its_logprobs_first():
    names = {1: "Hi", 2: " there", 3: "!"}.get
    text = Shaper(False, "c", "m", 1, names, echo=["Hi there"])
    first = _r("!", lps=[_lp(3, -0.125, (3, -0.125))])  # (values exact in float32)
    first.prompt_token_ids.extend([1, 2])
    first.prompt_logprobs.append(_lp(2, -2.5, (3, -1.0)))
    c = text.chunk(0, first)["choices"][0]
    assert c["text"] == "Hi there!"
    assert c["logprobs"] == {"tokens": ["Hi", " there", "!"], "token_logprobs": [None, -2.5, -0.125],
                             "top_logprobs": [None, {"!": -1.0}, {"!": -0.125}], "text_offset": [0, 2, 8]}
    assert text.chunk(0, _r("!"))["choices"][0]["text"] == "!"  # only the first chunk echoes
