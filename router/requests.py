"""gRPC GenerateRequest -> (prompt token ids, SamplingParams), or a message for INVALID_ARGUMENT.

The router validates everything before a request touches a worker: bad input is answered at
the door with a message the client can act on, and the cluster never sees it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.request import Guided, SamplingParams
from router.config import InputLimits
from router.tools import call_grammar, chat_messages, check_tools

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    """What the served model allows (from the workers' model info) and what one request may
    carry (the config's ``limits``)."""

    context_length: int
    vocab_size: int
    default_max_tokens: int = 256
    input: InputLimits = InputLimits()


def request_id(req, limits: Limits) -> str:
    """The request's id (a fresh one when it sets none). A request id names the request in
    logs, in Abort and (with its attempt) in every KV frame header: short, printable ASCII
    without spaces, so it fits a header and a log line whole.

    Raises:
        InvalidRequestError: too long, or a character outside printable ASCII (33..126).
    """
    rid, most = req.request_id, limits.input.request_id_chars
    if not rid:
        return uuid.uuid4().hex
    if len(rid) > most or not all(33 <= ord(c) <= 126 for c in rid):
        raise InvalidRequestError(f"request_id must be 1..{most} printable ASCII characters without spaces; "
                                  f"got {len(rid)} characters starting {rid[:16]!r}")
    return rid


def _at_most(field: str, n: int, most: int, unit: str) -> None:
    if n > most:
        raise InvalidRequestError(f"{field} has {n} {unit}; the limit is {most}")


def sampling_params(msg, limits: Limits, prompt_len: int) -> SamplingParams:
    """Build validated SamplingParams from a ``pdserve.v1.SamplingParams`` message.

    Raises:
        InvalidRequestError: a value out of range (the message names the field).
    """
    room = limits.context_length - prompt_len
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else min(limits.default_max_tokens, room)
    if max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise InvalidRequestError(f"max_tokens {max_tokens} does not fit: the prompt has {prompt_len} "
                                  f"tokens and the context length is {limits.context_length}")
    lim = limits.input
    _at_most("stop", len(msg.stop), lim.stop_strings, "strings")
    for i, stop in enumerate(msg.stop):
        _at_most(f"stop[{i}]", len(stop), lim.stop_string_chars, "characters")
    _at_most("stop_token_ids", len(msg.stop_token_ids), lim.stop_token_ids, "ids")
    bad = [t for t in msg.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {limits.vocab_size}); got {bad[:5]}")
    for name in ("logprobs", "prompt_logprobs"):
        if msg.HasField(name) and not 0 <= getattr(msg, name) <= lim.top_logprobs:
            raise InvalidRequestError(f"{name} must be in [0, {lim.top_logprobs}] (alternatives per token), "
                                      f"got {getattr(msg, name)}")

    def opt(name: str, default):
        return getattr(msg, name) if msg.HasField(name) else default

    return SamplingParams(
        guided=guided(msg.guided) if msg.HasField("guided") else None,
        max_tokens=max_tokens, temperature=opt("temperature", 0.0), top_p=opt("top_p", 1.0),
        top_k=opt("top_k", 0), min_p=opt("min_p", 0.0), repetition_penalty=opt("repetition_penalty", 1.0),
        presence_penalty=opt("presence_penalty", 0.0), frequency_penalty=opt("frequency_penalty", 0.0),
        seed=opt("seed", None), stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, logprobs=opt("logprobs", None), prompt_logprobs=opt("prompt_logprobs", None))


def guided(msg) -> Guided | None:
    """A ``pdserve.v1.Guided`` as the engine's constraint (validated when SamplingParams is built)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return Guided("json_object") if msg.json_object else None
    if kind == "choice":
        return Guided("choice", json.dumps(list(msg.choice.values)))
    return Guided(kind, getattr(msg, kind))


def _tools(req) -> list | None:
    """The request's tools when they are offered (chat, tools set, tool_choice not none)."""
    if req.WhichOneof("input") != "messages" or not req.messages.tools_json or req.messages.tool_choice == "none":
        return None
    try:
        return check_tools(json.loads(req.messages.tools_json))
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"tools: not valid JSON ({e})") from None


def tool_call_token(tokenizer) -> bool:
    """Whether the tokenizer has ``<tool_call>`` as one token (Qwen2.5): the forcing grammar
    then names the token rather than the text (router.tools.call_grammar)."""
    return "<tool_call>" in tokenizer.get_added_vocab()


def has_constraint(req) -> bool:
    """Whether building ``req``'s SamplingParams compiles a constraint (a guided field, or a
    forced tool call): then it is built off the event loop (router.server)."""
    forced = req.WhichOneof("input") == "messages" and \
        (req.messages.tool_choice == "required" or bool(req.messages.tool_choice_function))
    return req.sampling.HasField("guided") or forced


def with_tool_choice(req, params: SamplingParams, tool_token: bool) -> SamplingParams:
    """``params`` with the grammar that forces a tool call when tool_choice is ``required`` or
    names a function (router.tools.call_grammar); unchanged otherwise. ``tool_token``: the
    tokenizer has ``<tool_call>`` as one token (``tool_call_token``).

    Raises:
        InvalidRequestError: a bad tool_choice, or a forced call together with another constraint.
    """
    if req.WhichOneof("input") != "messages":
        return params
    m = req.messages
    if m.tool_choice not in ("", "auto", "none", "required"):
        raise InvalidRequestError(f"tool_choice must be auto, none, required or a function; got {m.tool_choice!r}")
    if m.tool_choice != "required" and not m.tool_choice_function:
        return params
    tools = _tools(req)
    if tools is None:
        raise InvalidRequestError("tool_choice requires tools")
    if params.guided is not None:
        raise InvalidRequestError("tool_choice: a forced tool call cannot be combined with response_format")
    g = call_grammar(tools, m.tool_choice_function or None, tool_token)
    return dataclasses.replace(params, guided=g)


def prompt_ids(req, tokenizer, limits: Limits) -> list[int]:
    """Token ids of a ``pdserve.v1.GenerateRequest``'s input (prompt, token_ids or messages).

    Raises:
        InvalidRequestError: no input, empty prompt, unknown chat role, messages to a model
            without a chat template, ids outside the vocabulary, or a prompt that leaves no room
            in the context.
    """
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("the request has no input: set prompt, token_ids or messages")
    lim = limits.input
    if kind == "prompt":
        _at_most("prompt", len(req.prompt.encode()), lim.prompt_bytes, "bytes")
        ids = tokenizer(req.prompt)["input_ids"]
    elif kind == "token_ids":
        _at_most("token_ids", len(req.token_ids.ids), limits.context_length - 1, "ids (the context length less one)")
        ids = list(req.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError(f"token_ids must be in [0, {limits.vocab_size}); got {bad[:5]}")
    else:
        _at_most("messages", len(req.messages.messages), lim.messages, "messages")
        _at_most("messages", sum(len(m.content.encode()) for m in req.messages.messages), lim.prompt_bytes,
                 "bytes of content")
        msgs = chat_messages(req.messages.messages)
        if not msgs:
            raise InvalidRequestError("messages is empty")
        roles = sorted({m["role"] for m in msgs} - set(CHAT_ROLES))
        if roles:
            raise InvalidRequestError(f"unknown chat role {roles[0]!r}; valid: {', '.join(CHAT_ROLES)}")
        if getattr(tokenizer, "chat_template", None) is None:  # transformers' own error would be a 500
            raise InvalidRequestError("messages: this model has no chat template (a base model, not "
                                      "instruction-tuned): send a prompt (/v1/completions) instead")
        tools = _tools(req)
        if tools is not None and "tools" not in tokenizer.chat_template:
            raise InvalidRequestError("tools: this model's chat template does not render tools")
        ids = list(tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    if not ids:
        raise InvalidRequestError("the prompt is empty: at least one token is needed")
    if len(ids) >= limits.context_length:
        raise InvalidRequestError(f"the prompt has {len(ids)} tokens; the context length is "
                                  f"{limits.context_length} (prompt plus one new token must fit)")
    return ids
