"""Continuous-batching scheduler: ``schedule() -> StepPlan``, ``update(plan, StepResult)``.

Queues (and only these):
- ``waiting``: admitted and ready to compute: new or preempted requests (holding no blocks), or
  requests whose KV arrived from a prefill worker (holding it); FIFO, a preempted request goes
  back to the front.
- ``running``: holding blocks; scheduled every step until finished.
- ``receiving`` (decode side of disaggregation): blocks reserved, KV in flight from a prefill
  worker; nothing to compute until it lands.
- ``sending`` (prefill side): prompt computed and first token sampled; blocks held until the
  KV transfer is acknowledged, then released.

Transitions: waiting -> running when blocks are granted (prefix-cache hits first); running ->
waiting on preemption (blocks freed, progress reset: recompute); waiting/running -> finished on
stop, length or abort (blocks freed at once). Disaggregated: add_remote -> receiving ->
(kv_arrived) waiting -> running; a prefill-only request: running -> sending (first token) ->
(release) gone. An abort in any queue frees the blocks.

Each step has a token budget. Running requests go first (decodes take 1 token, an unfinished
prompt takes a chunk of what is left), then waiting ones while budget, seats and blocks last.
Progress is a token count: a request is given ``num_tokens - num_computed_tokens`` tokens (or a
chunk of them); the step that catches it up samples its next token. Jump-forward needs nothing
else: the tokens a grammar forces arrive with the sampled one (``StepResult.sampled``), are
appended uncomputed, and the next step computes them all.

Speculative decoding: a decoding request with ``spec_k > 0`` is scheduled with room for up to
``spec_k`` draft tokens after its last token (budget and blocks reserved; when blocks are short
it decodes plainly instead of preempting for drafts). The proposer fills the drafts into the
plan, the runner verifies 1+k tokens in the same forward, and ``update`` keeps the accepted
ones: ``num_computed_tokens`` advances by 1 + accepted (rejected positions are rolled back)
and blocks past the end are released.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.config import SchedulerConfig
from engine.kv_cache import BlockManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` starting at ``num_computed_tokens``."""

    request: Request
    num_new_tokens: int
    # Speculative verify: room reserved for up to max_spec_tokens drafts after the last token;
    # the proposer fills spec_token_ids (and, for a sampled draft, spec_probs [k, vocab]).
    max_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: Any = None
    first_row: int = 0  # set by the runner: this request's first row in the flattened batch

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so a new token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens

    def set_draft(self, token_ids: list[int], probs: Any = None) -> None:
        """Put the proposer's draft tokens (at most ``max_spec_tokens``) into this step."""
        token_ids = list(token_ids)[:self.max_spec_tokens]
        self.num_new_tokens += len(token_ids) - len(self.spec_token_ids)
        self.spec_token_ids = token_ids
        self.spec_probs = None if probs is None or not token_ids else probs[:len(token_ids)]


@dataclass
class StepPlan:
    """Scheduler -> runner: what to compute this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def speculative(self) -> list[ScheduledRequest]:
        """Scheduled requests with room for draft tokens this step."""
        return [s for s in self.scheduled if s.max_spec_tokens]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepResult:
    """Runner -> scheduler: tokens sampled per request id (only for requests that sample); for a
    speculative verify, the accepted drafts followed by the target's own token."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    # for requests that ask (SamplingParams.logprobs): one entry per sampled token
    logprobs: dict[str, list] = field(default_factory=dict)
    # for requests that ask (SamplingParams.prompt_logprobs): their prompt positions computed this step
    prompt_logprobs: dict[str, list] = field(default_factory=dict)


class Scheduler:
    """Moves requests between ``waiting`` and ``running``; the block manager edits their blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}
        self.sending: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}

    # ---- admission / abort -----------------------------------------------------------------
    def add(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish ``request_id`` as aborted and free its blocks. Unknown ids return None."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take ``req`` out of whichever queue holds it and free every block it held."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.receiving.pop(req.request_id, None)
        self.sending.pop(req.request_id, None)
        self.bm.free(req.block_ids)
        req.status = status
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """True when a step would compute something (receiving/sending requests only wait)."""
        return bool(self.waiting or self.running)

    # ---- disaggregation ------------------------------------------------------------------
    def add_remote(self, req: Request) -> bool:
        """Reserve blocks for a request whose prompt KV a prefill worker will send.

        ``req`` carries its prompt and the first token the prefill side sampled. Returns False
        (changing nothing) when the blocks are not free now. A prefix of the prompt already in
        this side's prefix cache is shared, not received again: ``req.num_cached_tokens`` says
        how many leading tokens it covers (whole blocks; never the last prompt token, which the
        transfer must carry so that it ends with the first token).
        """
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        hits = self.bm.match_prefix(req.prompt_token_ids, req.num_prompt_tokens - 1)
        # One token more than the prompt: the first decode step writes the first token's KV,
        # and that must never wait for memory that only other waiting requests hold.
        if not self.bm.allocate(req.block_ids, req.num_prompt_tokens + 1, hits):
            return False
        req.num_cached_tokens = len(hits) * self.bm.block_size
        req.status = RequestStatus.WAITING_FOR_KV
        self.receiving[req.request_id] = req
        self.requests[req.request_id] = req
        return True

    def kv_arrived(self, request_id: str) -> None:
        """The prompt's KV is in the reserved blocks: the request joins the queue to decode."""
        req = self.receiving.pop(request_id)
        req.num_computed_tokens = req.num_cached_tokens = req.num_prompt_tokens
        self.bm.cache_blocks(req.block_ids, req.prompt_token_ids, 0, req.num_prompt_tokens)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def release(self, request_id: str) -> bool:
        """Free a prefilled request's blocks once its KV transfer has ended. False if unknown."""
        req = self.sending.pop(request_id, None)
        if req is None:
            return False
        self.bm.free(req.block_ids)
        self.requests.pop(request_id, None)
        return True

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """This step's plan: ``running`` first, then ``waiting`` while budget, seats and blocks last."""
        plan = StepPlan()
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        # Admit waiting requests, but not in a step that had to preempt: memory is short.
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Give each running request its tokens (a chunk of them at most the budget left),
        preempting the newest when blocks run out. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            # Preempt from the back (newest first) until this request's blocks fit.
            while not self.bm.allocate(req.block_ids, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            k = self._spec_room(req, n, budget)
            plan.scheduled.append(ScheduledRequest(req, n, max_spec_tokens=k))
            budget -= n + k
            i += 1
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Move the head of ``waiting`` to ``running`` while budget, seats and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            resumed = bool(req.block_ids)
            hits, cached = self._cached_prefix(req)
            n = req.num_tokens - cached
            if n > budget:
                # Unchunked, a request waits to go whole, unless it could never fit one step
                # (a preempted request recomputes prompt plus outputs): then it is chunked.
                if not self.config.enable_chunked_prefill and n <= self.config.max_num_batched_tokens:
                    break
                n = budget
            if not self.bm.allocate(req.block_ids, cached + n, hits):
                if self._drop_held_kv():
                    continue
                break
            self.waiting.popleft()
            if not resumed:
                req.num_cached_tokens = cached
            req.num_computed_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """(prefix-cache blocks to share, tokens already computed) for a waiting request."""
        if req.block_ids:  # its KV arrived from a prefill worker: resume where it is
            return [], req.num_computed_tokens
        if req.sampling_params.prompt_logprobs is not None and not req.output_token_ids:
            return [], 0  # every prompt position's logits are wanted: compute them all
        # Leave at least one token to compute: its logits pick the next token.
        hits = self.bm.match_prefix(req.all_token_ids, req.num_tokens - 1)
        return hits, len(hits) * self.bm.block_size

    def _drop_held_kv(self) -> bool:
        """Free the newest waiting holder's KV when nothing else could free memory. Returns
        False (changing nothing) when something runs or no waiting request holds KV.

        Waiting requests holding KV (arrived from prefill) may pin the memory the head needs;
        with nothing running, nothing else would ever free it: the newest holder's KV goes (it
        recomputes, like a preemption) and the head tries again.
        """
        holder = next((r for r in reversed(self.waiting) if r.block_ids), None)
        if self.running or holder is None:
            return False
        self.bm.free(holder.block_ids)
        holder.num_computed_tokens = 0
        holder.num_preemptions += 1
        return True

    def _spec_room(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens a decoding request may verify this step (0: plain decode).

        Never more than the budget left, the tokens it may still generate (the verify also
        yields one token of its own) or the context; blocks are taken only if free now.
        """
        if req.spec_k <= 0 or n != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        k = min(req.spec_k, budget - n, req.sampling_params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens)
        if k <= 0 or not self.bm.allocate(req.block_ids, req.num_computed_tokens + n + k):
            return 0
        return k

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.block_ids)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance progress, append sampled tokens, finish what stopped. Returns touched requests."""
        touched = []
        for s in plan.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            if s.max_spec_tokens:
                self._update_verified(s, result)
                touched.append(req)
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens += s.num_new_tokens
            self.bm.cache_blocks(req.block_ids, req.all_token_ids, before, req.num_computed_tokens)
            req.prompt_logprobs.extend(result.prompt_logprobs.get(req.request_id, ()))
            # (more than one: jump-forward's forced tokens)
            self._append(req, result.sampled.get(req.request_id, []))
            if req.prefill_only and req.status == RequestStatus.RUNNING and req.output_token_ids:
                # Prefill done: hold the blocks for the KV transfer, compute nothing more.
                self.running.remove(req)
                req.status = RequestStatus.PREFILLED
                self.sending[req.request_id] = req
            touched.append(req)
        return touched

    def _update_verified(self, s: ScheduledRequest, result: StepResult) -> None:
        """Keep what a verify step accepted and roll back the rest.

        The step computed KV for the last token and the k drafts. ``result`` holds the accepted
        drafts plus one token from the target, so the last token and the accepted drafts are
        computed now; rejected drafts' positions are not (their slots are overwritten later,
        never hashed: only blocks full of computed tokens enter the prefix cache), and blocks
        past the request's end go back to the block manager. Tokens after a stop are dropped
        from ``result`` too, so outputs show only what was appended.
        """
        req = s.request
        tokens = result.sampled.get(req.request_id, [])
        before = req.num_computed_tokens
        base = s.num_new_tokens - len(s.spec_token_ids)  # 1: the last token
        computed = before + base + max(len(tokens) - 1, 0)
        # Hash blocks that became full of accepted tokens before a stop may free them.
        self.bm.cache_blocks(req.block_ids, req.all_token_ids + tokens, before, computed)
        req.num_computed_tokens = computed
        self._append(req, tokens)
        if not req.is_finished:
            self.bm.trim(req.block_ids, req.num_tokens)

    def _append(self, req: Request, tokens: list[int]) -> None:
        """Append a step's tokens to ``req`` until one stops it; ``tokens`` (the step result's
        list) loses those after the stop, so outputs show only what was appended."""
        for i, tok in enumerate(tokens):
            req.append_output_token(tok)
            status = self.check_stop(req, tok)
            if status is not None:
                self.finish(req, status)
                del tokens[i + 1:]
                return

    def check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """Stop on EOS (unless ignored), a stop token id, max_tokens or the context limit."""
        sp = req.sampling_params
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
