"""The request: owns its token ids, progress, blocks, status and timings.

Managers (scheduler, block manager) move a request between queues and edit its block list;
the request itself is the single source of truth for how far it has got.

Progress is a token count: ``num_computed_tokens`` catches up with ``num_tokens`` one step at a
time. A prompt chunk, a decode token and a speculative verify are the same thing to the engine.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, KV in flight
    RUNNING = "running"
    PREEMPTED = "preempted"
    PREFILLED = "prefilled"  # prefill side: first token out, blocks held until the KV is sent
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.PREFILLED)


MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class Guided:
    """A constraint on the output (structured outputs; engine.grammar applies it). vLLM's names:

    ``json_schema``: ``spec`` is a JSON schema (JSON text); ``json_object``: any JSON object
    (``spec`` unused); ``regex``: ``spec`` is a regular expression; ``choice``: ``spec`` is a
    JSON list of strings, the output is one of them; ``grammar``: ``spec`` is a Lark grammar or
    a GBNF (llama.cpp EBNF) one. Frozen and hashable: it is the compiled-grammar cache's key.
    """

    kind: str
    spec: str = ""


@dataclass
class SamplingParams:
    """How to pick each new token, and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``repetition_penalty`` (HF/CTRL style, divides positive logits) applies
    to prompt and output tokens; ``presence_penalty`` and ``frequency_penalty`` (OpenAI style,
    subtracted from logits) apply to output tokens only.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Set: each new token comes with its log probability and the ``logprobs`` most likely
    # alternatives (engine.sampler.token_logprobs); speculation is off for the request.
    logprobs: int | None = None
    # Set: the first output also carries each prompt token's log probability given the tokens
    # before it (from the second on) and this many alternatives, raw (no penalties, T = 1); the
    # prompt is then computed whole, not taken from the prefix cache.
    prompt_logprobs: int | None = None
    # A re-run (the router, after a lost worker): the last ``resumed`` prompt tokens are this
    # request's own earlier output. They keep counting as output (presence/frequency
    # penalties) and the seed's draws go on after them, so a seeded request re-run mid-stream
    # gives the tokens it would have given undisturbed.
    resumed: int = 0
    # Structured output: every token is one the constraint allows (engine.grammar). Travels with
    # the request to prefill and decode workers and into re-runs.
    guided: Guided | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError with a message the caller can act on."""
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            bad(f"top_k must be an integer (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not isinstance(self.resumed, int) or self.resumed < 0:
            bad(f"resumed must be an integer >= 0, got {self.resumed!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not isinstance(self.stop_token_ids, (list, tuple)):
            bad("stop and stop_token_ids must be lists")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.guided is not None:
            g = self.guided
            if not isinstance(g, Guided) or not isinstance(g.kind, str) or not isinstance(g.spec, str):
                bad(f"guided must be a Guided(kind, spec) of strings, got {g!r}")
            from engine.grammar import check  # heavy: torch and llguidance (the router imports this module)
            check(g)  # cached per constraint: a schema seen before costs a dict lookup


@dataclass
class Request:
    """One generation request and everything the engine knows about it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # Prefill side of disaggregation: stop after the first token, keep the KV for the transfer.
    prefill_only: bool = False

    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Equals num_tokens - 1 while decoding: the newest
    # sampled token is fed in the next step.
    num_computed_tokens: int = 0
    # Tokens served from the prefix cache when the request was (re)admitted.
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    output_text: str = ""
    # Speculative decoding: draft tokens to verify in this request's next decode step (0 =
    # plain decode; set by the adaptive policy). Acceptance is counted per worker (SpecDecoder).
    spec_k: int = 0
    # SamplingParams.prompt_logprobs: per prompt token from the second on, as computed so far
    prompt_logprobs: list = field(default_factory=list)
    # SamplingParams.guided: this request's matcher (engine.grammar.GrammarState), or None
    grammar: Any = None

    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_token_ids.append(token_id)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def mean_tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)
