"""gRPC GenerateRequest -> (prompt token ids, SamplingParams), or a message for INVALID_ARGUMENT.

The router validates everything before a request touches a worker: bad input is answered at
the door with a message the client can act on, and the cluster never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.request import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
# A request id names the request in logs, in Abort and (with its attempt) in every KV frame
# header: short, printable ASCII without spaces, so it fits a header and a log line whole.
MAX_REQUEST_ID_CHARS = 128


def request_id(req) -> str:
    """The request's id (a fresh one when it sets none).

    Raises:
        InvalidRequestError: longer than MAX_REQUEST_ID_CHARS, or a character outside
            printable ASCII (33..126).
    """
    import uuid
    rid = req.request_id
    if not rid:
        return uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS or not all(33 <= ord(c) <= 126 for c in rid):
        raise InvalidRequestError(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters "
                                  f"without spaces; got {len(rid)} characters starting {rid[:16]!r}")
    return rid


@dataclass(frozen=True)
class Limits:
    """What the served model allows (from the workers' model info and the router config)."""

    context_length: int
    vocab_size: int
    default_max_tokens: int = 256


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
    bad = [t for t in msg.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {limits.vocab_size}); got {bad[:5]}")

    def opt(name: str, default):
        return getattr(msg, name) if msg.HasField(name) else default

    return SamplingParams(
        max_tokens=max_tokens, temperature=opt("temperature", 0.0), top_p=opt("top_p", 1.0),
        top_k=opt("top_k", 0), min_p=opt("min_p", 0.0), repetition_penalty=opt("repetition_penalty", 1.0),
        presence_penalty=opt("presence_penalty", 0.0), frequency_penalty=opt("frequency_penalty", 0.0),
        seed=opt("seed", None), stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos)


def prompt_ids(req, tokenizer, limits: Limits) -> list[int]:
    """Token ids of a ``pdserve.v1.GenerateRequest``'s input (prompt, token_ids or messages).

    Raises:
        InvalidRequestError: no input, empty prompt, unknown chat role, ids outside the
            vocabulary, or a prompt that leaves no room in the context.
    """
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("the request has no input: set prompt, token_ids or messages")
    if kind == "prompt":
        ids = tokenizer(req.prompt)["input_ids"]
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError(f"token_ids must be in [0, {limits.vocab_size}); got {bad[:5]}")
    else:
        msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not msgs:
            raise InvalidRequestError("messages is empty")
        roles = sorted({m["role"] for m in msgs} - set(CHAT_ROLES))
        if roles:
            raise InvalidRequestError(f"unknown chat role {roles[0]!r}; valid: {', '.join(CHAT_ROLES)}")
        ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    if not ids:
        raise InvalidRequestError("the prompt is empty: at least one token is needed")
    if len(ids) >= limits.context_length:
        raise InvalidRequestError(f"the prompt has {len(ids)} tokens; the context length is "
                                  f"{limits.context_length} (prompt plus one new token must fit)")
    return ids
