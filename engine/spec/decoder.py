"""The engine's speculative decoding: pick K per request, propose drafts, keep the stats.

Per step (``LLMEngine.step``)::

    before_schedule(running)   spec_k per request from the adaptive policy (0 = plain)
    scheduler.schedule()       reserves 1 + spec_k tokens and their blocks per request
    propose(plan)              the draft source fills the drafts in (timed: draft time)
    runner.execute(plan)       one forward verifies every request's 1 + k tokens
    observe(plan, result, s)   acceptance and step time (verify time) into policy and stats
    scheduler.update()         keeps accepted tokens, rolls back the rest

Requests with and without speculation, and with different K, share the same batch: to the
scheduler and runner a verify is just a request with more tokens this step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.scheduler import StepPlan, StepResult
from engine.spec.adaptive import AdaptiveK, expected_tokens
from engine.spec.proposer import Proposer
from engine.spec.registry import build_proposer
from engine.spec.verify import GeneratorFn


class SpecDecoder:
    """Owns the proposer and the adaptive policy; the engine calls it around each step."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = AdaptiveK(config.num_speculative_tokens, config.adaptive)
        self.verify_steps = 0  # request-steps that verified at least one draft
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0  # target forwards of steps that verified drafts
        self.steps = 0
        self.spec_steps = 0
        self._k_sum = 0

    @property
    def label(self) -> str:
        return self.config.label

    def before_schedule(self, running: Sequence[Request]) -> None:
        batch = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        for r in running:
            # (logprobs: a verify step's accepted drafts come without theirs)
            r.spec_k = 0 if r.prefill_only or r.sampling_params.logprobs is not None else self.policy.choose(
                r.request_id, max(batch, 1), self.proposer.stale_tokens(r),
                r.sampling_params.max_tokens - r.num_output_tokens)

    def propose(self, plan: StepPlan, generator: GeneratorFn) -> None:
        items = plan.speculative
        if not items:
            return
        t0 = time.perf_counter()
        self.proposer.propose(items, generator)
        dt = time.perf_counter() - t0
        self.draft_seconds += dt
        p = self.proposer
        if any(s.spec_token_ids for s in items) and getattr(p, "model", None) is not None:
            forwards = max(len(s.spec_token_ids) for s in items)
            # Split the first forward into catch-up and one draft step, by token counts.
            live = len(items)
            share = p.catchup_tokens / (p.catchup_tokens + live)
            self.policy.observe_catchup(p.catchup_tokens, p.first_seconds * share)
            self.policy.observe_draft(forwards, p.rest_seconds + p.first_seconds * (1 - share))

    def observe(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        """Record a finished forward: per request acceptance; step time when it was decode-only."""
        self.steps += 1
        verified = False
        for s in plan.scheduled:
            d = len(s.spec_token_ids)
            if not d:
                continue
            verified = True
            acc = max(len(result.sampled.get(s.request.request_id, ())) - 1, 0)
            self.policy.observe_verify(s.request.request_id, d, acc)
            self.verify_steps += 1
            self.draft_tokens += d
            self.accepted_tokens += acc
            self._k_sum += d
        if verified:
            self.spec_steps += 1
            self.verify_seconds += seconds
        decode_only = all(s.num_new_tokens - len(s.spec_token_ids) == 1 and s.samples for s in plan.scheduled)
        if decode_only:
            self.policy.observe_step(plan.num_tokens, seconds)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.policy.forget(request_id)

    def stats(self) -> dict:
        """Worker totals: acceptance rate alpha, mean accepted drafts and tokens per verify,
        the expected tokens per verify E = (1 - a^(K+1)) / (1 - a) at the mean K for
        comparison, draft vs verify time."""
        alpha = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        mean_k = self._k_sum / self.verify_steps if self.verify_steps else None
        return {
            "method": self.config.method, "k_max": self.config.num_speculative_tokens,
            "adaptive": self.config.adaptive,
            "acceptance_rate": alpha,
            "verify_steps": self.verify_steps, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_per_verify": self.accepted_tokens / self.verify_steps if self.verify_steps else None,
            "mean_tokens_per_verify": (self.accepted_tokens + self.verify_steps) / self.verify_steps
            if self.verify_steps else None,
            "mean_k": mean_k,
            "expected_tokens_per_verify": expected_tokens(alpha, round(mean_k))
            if alpha is not None and mean_k else None,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "steps": self.steps, "spec_steps": self.spec_steps,
        }


def build_spec_decoder(config: SpeculativeConfig, engine) -> SpecDecoder:
    """The decoder for ``config`` on ``engine`` (an LLMEngine being built: model, cache, tokenizer).

    Raises:
        ModelLoadError: a draft model that cannot be used (e.g. a different tokenizer).
    """
    return SpecDecoder(config, build_proposer(config, engine))
