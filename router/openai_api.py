"""The OpenAI API's shapes: its requests onto ``pdserve.v1`` messages, responses back.

Pure (no server: router.openai_http serves it). Fields are those of OpenAI's API reference for
``/v1/completions`` and ``/v1/chat/completions``, plus the extensions vLLM users pass
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, and the
structured outputs ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``). A
field OpenAI defines that changes the output and that pdserve does not implement (logit bias,
...) is refused with a 400 naming it, never silently ignored; an unknown field is ignored, as
OpenAI's own server does, so that newer clients still work.

Structured outputs: ``response_format`` ``{"type": "json_object"}`` or ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`` (always enforced, strict or not),
on both endpoints; limits in engine/grammar.py (64 KiB, nesting 32), a bad schema is a 400.
Chat ``tools`` + ``tool_choice`` (router/tools.py): checked here; the calls in the answer are
router.openai_answer's (responses: chunks, whole answers, usage, logprobs).

Defaults are OpenAI's, not the gRPC API's: ``temperature`` 1 (sampling), and a completion's
``max_tokens`` 16; a chat's is the router's ``default_max_tokens`` (what fits in the context).

A request with ``n`` choices (and a completion with several prompts) becomes one pdserve
request per choice, ``<id>-<k>``; with a ``seed``, choice ``k`` samples with ``seed + k``: the
choices differ, and the same request gives the same choices again.

Refused with a 400 before anything runs: a lone UTF-16 surrogate in any string (valid JSON, not
text), and an answer that could hold more than ``front_door.logprob_entries`` log probabilities
(``check_logprob_budget``: choices x tokens x (1 + alternatives)).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any

import grpc
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from pdserve.v1 import pdserve_pb2 as pb
from engine.errors import InvalidRequestError
from router.tools import check_tools

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_SEED = 2**64 - 1
INT32 = 2**31 - 1  # the gRPC messages' integers: beyond, a 400 here rather than an error later
TokenId = Annotated[int, Field(ge=0, le=INT32)]


class ApiError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


# gRPC status of a Reject (router.server) -> (HTTP status, OpenAI error type, code)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
# The router's messages start with the field they are about, in the gRPC API's names.
_PARAM_OF = {"token_ids": "prompt", "prompt": "prompt", "messages": "messages", "max_tokens": "max_tokens",
             "stop": "stop", "stop_token_ids": "stop_token_ids", "temperature": "temperature",
             "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
             "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "unknown chat role": "messages", "the prompt": "prompt",
             "tools": "tools", "tool_choice": "tool_choice", "json_schema": "response_format",
             "guided": "response_format", "grammar": "guided_grammar", "choice": "guided_choice"}


def api_error(code: grpc.StatusCode, message: str) -> ApiError:
    """The HTTP answer for a router refusal (``router.server.Reject``)."""
    status, type_, err_code = _STATUS.get(code, (500, "server_error", None))
    m = re.match(r"(unknown chat role|the prompt|[a-z_]+)", message)
    param = _PARAM_OF.get(m.group(1)) if m and status == 400 else None
    return ApiError(status, message, param, type_, err_code)


# ---- requests --------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share. Ranges are OpenAI's (and the engine's)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: ignored (see the module doc)

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None  # accepted, unused
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-INT32, le=INT32)  # <= 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None

    # fields OpenAI defines that would change the output and that pdserve does not do
    _guided: Any = PrivateAttr(None)  # the constraint, built once by refuse_unsupported
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    _UNSUPPORTED = ("functions", "function_call", "logit_bias", "suffix",
                    "prediction", "audio", "modalities", "web_search_options", "use_beam_search")

    def refuse_unsupported(self) -> None:
        for name in self._UNSUPPORTED:
            value = (self.model_extra or {}).get(name)
            if value not in (None, {}, [], False, "none", "auto"):
                raise ApiError(400, f"{name} is not supported by this server", name)
        self._guided = self.guided()
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")

    def guided(self) -> pb.Guided | None:
        """The one output constraint asked for (response_format or a guided_* field), or None."""
        asked = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                asked.append(pb.Guided(json_object=True))
            elif kind == "json_schema":
                js = fmt.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, (dict, bool)):
                    raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                                   "response_format")
                asked.append(pb.Guided(json_schema=json.dumps(schema)))
            elif kind != "text":
                raise ApiError(400, "response_format.type must be text, json_object or json_schema; got "
                                    f"{kind!r}", "response_format")
        if self.guided_json is not None:
            g = self.guided_json
            asked.append(pb.Guided(json_schema=g if isinstance(g, str) else json.dumps(g)))
        if self.guided_regex is not None:
            asked.append(pb.Guided(regex=self.guided_regex))
        if self.guided_choice is not None:
            asked.append(pb.Guided(choice=pb.Choices(values=self.guided_choice)))
        if self.guided_grammar is not None:
            asked.append(pb.Guided(grammar=self.guided_grammar))
        if len(asked) > 1:
            raise ApiError(400, "give at most one of response_format, guided_json, guided_regex, guided_choice, "
                                "guided_grammar", "response_format")
        return asked[0] if asked else None

    def sampling(self, max_tokens: int | None, seed_offset: int) -> pb.SamplingParams:
        s = pb.SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [])
        if max_tokens is not None:
            s.max_tokens = max_tokens
        s.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        if self.seed is not None:
            s.seed = (self.seed + seed_offset) % (MAX_SEED + 1)
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if (v := getattr(self, name)) is not None:
                setattr(s, name, v)
        if self._guided is not None:
            s.guided.CopyFrom(self._guided)
        return s


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, ge=1, le=INT32)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None

    def prompts(self) -> list[pb.GenerateRequest]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise ApiError(400, "prompt is empty: at least one token is needed", "prompt")
        return [pb.GenerateRequest(prompt=x) if isinstance(x, str) else pb.GenerateRequest(token_ids=pb.TokenIds(ids=x))
                for x in p]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self, i: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages[{i}]: content parts of type {part.type!r} are not supported "
                                    "(text only)", "messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32)  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def tool_choice_parts(self) -> tuple[str, str]:
        """(tool_choice, forced function name) as pdserve.v1.ChatMessages carries them."""
        c = self.tool_choice
        if c is None:
            return ("auto" if self.tools else "none"), ""
        if isinstance(c, str):
            if c not in ("auto", "none", "required"):
                raise ApiError(400, f"tool_choice must be auto, none, required or a function; got {c!r}", "tool_choice")
            return c, ""
        name = (c.get("function") or {}).get("name") if c.get("type") == "function" else None
        if not isinstance(name, str):
            raise ApiError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
        return "", name

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            try:
                check_tools(self.tools)
            except InvalidRequestError as e:
                raise ApiError(400, str(e), "tools") from None
        self.tool_choice_parts()

    @property
    def tools_offered(self) -> bool:
        return bool(self.tools) and self.tool_choice_parts()[0] != "none"

    def prompts(self) -> list[pb.GenerateRequest]:
        roles = {"developer": "system"}  # OpenAI's newer name for the system role
        msgs = [pb.ChatMessage(role=roles.get(m.role, m.role), content=m.text(i), name=m.name or "",
                               tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "",
                               tool_call_id=m.tool_call_id or "") for i, m in enumerate(self.messages)]
        choice, function = self.tool_choice_parts()
        if (choice == "required" or function) and not self.tools:
            raise ApiError(400, "tool_choice requires tools", "tool_choice")
        chat = pb.ChatMessages(messages=msgs, tools_json=json.dumps(self.tools) if self.tools else "",
                               tool_choice=choice, tool_choice_function=function)
        return [pb.GenerateRequest(messages=chat)]


def parse(kind: type[_Sampling], body: Any, most_choices: int | None = None) -> _Sampling:
    """Validate a JSON body into a request (ApiError 400 naming the first bad parameter).
    ``most_choices``: the prompts x n limit, checked first on the raw body (validating a body
    of a million one-token prompts would hold the event loop for seconds)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_surrogates(body)
    prompt, n = body.get("prompt"), body.get("n", 1)
    if most_choices is not None and isinstance(n, int) and isinstance(prompt, list) and prompt \
            and not isinstance(prompt[0], int) and len(prompt) * max(n, 1) > most_choices:
        raise ApiError(400, f"{len(prompt)} prompts x n={n} is more than {most_choices} choices (limits.choices)",
                       "prompt")
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{loc}: {err['msg']}", str(err["loc"][0]) if err["loc"] else None) from None
    req.refuse_unsupported()
    return req


def _refuse_surrogates(body: dict[str, Any]) -> None:
    """A lone UTF-16 surrogate (JSON ``"\\ud800"``) anywhere is a 400 naming its parameter: it
    is valid JSON but not text, and protobuf (UTF-8) would fail on it later. One C-speed
    encode of the whole body; the parameter is looked for only when there is one."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        param = next((k for k, v in body.items() if _encodes(k) and not _encodes(v)), None)
        raise ApiError(400, f"{param or 'the request'}: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                            "without its pair); text must be valid Unicode", param) from None


def _encodes(x: Any) -> bool:
    try:
        json.dumps(x, ensure_ascii=False).encode()
        return True
    except UnicodeEncodeError:
        return False


def logprob_entries(reqs: list[pb.GenerateRequest], context_length: int, default_max_tokens: int) -> int:
    """The most log probabilities the answer to ``reqs`` can hold: per choice asking for them,
    tokens x (1 + alternatives), tokens being max_tokens (else the router's default), or with
    echo the whole context (the prompt's are scored too)."""
    total = 0
    for g in reqs:
        s = g.sampling
        if not (s.HasField("logprobs") or s.HasField("prompt_logprobs")):
            continue
        tokens = context_length if s.HasField("prompt_logprobs") else \
            min(s.max_tokens if s.HasField("max_tokens") else default_max_tokens, context_length)
        total += tokens * (1 + max(s.logprobs, s.prompt_logprobs))
    return total


def check_logprob_budget(reqs: list[pb.GenerateRequest], chat: bool, context_length: int, default_max_tokens: int,
                         most: int) -> None:
    """ApiError 400 when the answer could hold more than ``most`` log probabilities
    (``front_door.logprob_entries``): refused before anything is generated."""
    n = logprob_entries(reqs, context_length, default_max_tokens)
    if n > most:
        param = "top_logprobs" if chat else "logprobs"
        raise ApiError(400, f"{param}: this request may return {n} log probabilities (choices x tokens x "
                            f"(1 + alternatives)); the limit is {most} (front_door.logprob_entries): ask for "
                            "fewer choices, max_tokens or alternatives", param)


IDEMPOTENCY_HEADER = "idempotency-key"  # (Idempotency-Key: the IETF draft's name, as Stripe and others use it)
IDEMPOTENCY_KEY_CHARS = 64


def requests_for(req: _Sampling, id_prefix: str, most_choices: int,
                 idempotency_key: str | None = None) -> tuple[str, list[pb.GenerateRequest]]:
    """The response id and one GenerateRequest per choice, in choice order (prompt-major).
    ``idempotency_key`` (the request's Idempotency-Key header) makes the ids: the same request
    sent again under it, to the router that replaced the one it ran on, gets the same answer
    (router.resume); absent, the ids are fresh."""
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, req.n):
            raise ApiError(400, "best_of other than n is not supported", "best_of")
        max_tokens, logprobs = req.max_tokens, req.logprobs
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prompts = req.prompts()
    if len(prompts) * req.n > most_choices:
        raise ApiError(400, f"{len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} choices; the limit is "
                            f"{most_choices} (limits.choices)", "n")
    key = idempotency_key
    if key is not None and not (0 < len(key) <= IDEMPOTENCY_KEY_CHARS and all(33 <= ord(ch) <= 126 for ch in key)):
        raise ApiError(400, f"the Idempotency-Key header must be 1..{IDEMPOTENCY_KEY_CHARS} printable ASCII "
                            "characters without spaces", "Idempotency-Key")
    rid = f"{id_prefix}-{key if key is not None else uuid.uuid4().hex}"
    out = []
    for p in prompts:
        for k in range(req.n):
            g = pb.GenerateRequest()
            g.CopyFrom(p)
            g.request_id = f"{rid}-{len(out)}"
            g.sampling.CopyFrom(req.sampling(max_tokens, k))
            if logprobs is not None:
                g.sampling.logprobs = logprobs
                if getattr(req, "echo", False):
                    g.sampling.prompt_logprobs = logprobs
            out.append(g)
    return rid, out
