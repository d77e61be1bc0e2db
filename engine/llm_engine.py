"""LLMEngine: tokenizer + scheduler + runner in one process; ``step()`` drives everything.

Lifecycle of a request: ``add_request`` validates and queues it (bad input raises an
InvalidRequestError before any state changes); each ``step`` schedules, runs one forward,
updates progress and returns a RequestOutput (new tokens and text delta) for every request
that produced something; finished and aborted requests have already released their blocks.

With ``EngineConfig.speculative`` a step may give a request several tokens: its drafts are
proposed after scheduling and verified in the same forward (``engine.spec.decoder``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import TextStream, tokens_through_stop
from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler
from engine.kv_cache import BlockManager, allocate_kv_tensors, kv_bytes_per_block
from engine.layers.attention import get_attention_backend
from engine.memory import keep_step_buffers, release_freed_memory
from engine.models.loader import load_model, read_generation_eos, resolve_model_path
from engine.quant.kernel_report import report
from engine.request import Request, RequestStatus, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import ScheduledRequest, Scheduler, StepPlan
from engine.spec.decoder import build_spec_decoder
from engine.spec.registry import extra_kv_bytes_per_block

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteSlot:
    """Where a remote prefill's KV lands (``add_remote``): the request's blocks from token 0,
    and ``token_start``, the first prompt position it lacks (the rest is a cached prefix)."""

    block_ids: list[int]
    token_start: int = 0


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), plus totals so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft: float | None
    mean_tpot: float | None
    new_logprobs: list | None = None  # per new token (SamplingParams.logprobs): engine.sampler.TokenLogprob
    # SamplingParams.prompt_logprobs, on the output with the first token: per prompt token from the second on
    prompt_logprobs: list | None = None


class LLMEngine:
    """The shared engine both worker kinds wrap."""

    def __init__(self, config: EngineConfig | None = None, progress: bool = True) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.monotonic()
        self.model_path = resolve_model_path(config.model, progress=progress)
        self.model_config = mc = ModelConfig.from_hf(self.model_path)
        self.dtype = getattr(torch, config.dtype)
        if config.attention_backend == "flash_attn" and config.cache.block_size % 256:
            raise ValueError("attention backend flash_attn needs cache block_size to be a multiple of 256 "
                             f"(paged KV in flash-attn), got {config.cache.block_size}")
        backend = get_attention_backend(config.attention_backend)
        self.model = load_model(self.model_path, backend, self.dtype, config.device,
                                quantization=config.quantization, single_token=config.compile_decode,
                                compile_rows=config.compile_decode_rows, min_rows=config.verify_rows,
                                dequantize=config.dequantize, activations=config.activations,
                                cache=config.weight_cache)
        from transformers import AutoTokenizer  # heavy: transformers
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))

        cc = config.cache
        per_block = kv_bytes_per_block(mc.num_layers, cc.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        if config.speculative is not None:  # a draft with its own KV shares the cache's memory
            per_block += extra_kv_bytes_per_block(config.speculative, self.model_path, cc.block_size, self.dtype)
        num_blocks = cc.num_blocks or max(1, int(cc.memory_gb * 2**30) // per_block)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings, num_blocks * cc.block_size)
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        kv = allocate_kv_tensors(mc.num_layers, num_blocks, cc.block_size, mc.num_kv_heads,
                                 mc.head_dim, self.dtype, config.device)
        self.runner = ModelRunner(self.model, backend, kv, cc.block_size, config.device)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.spec = None
        if config.speculative is not None:
            self.spec = build_spec_decoder(config.speculative, self)

        eos = set(mc.eos_token_ids) | set(read_generation_eos(self.model_path))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.grammars = self.runner.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.runner.jump_forward = config.jump_forward
        self._ids = itertools.count()
        self._text: dict[str, TextStream] = {}
        # which kernel each format runs on this CPU class (they differ in speed and, for W8A8,
        # in activation width): logged once, reported in model info
        st = getattr(self.model, "single_token", None)
        self.kernels = report(self.model, single_token=st.kernel if st is not None else None,
                              rows=st.max_rows if st is not None else 1)
        log.info("kernels: %s", self.kernels)
        release_freed_memory()  # the load's freed temporaries: not the worker's to keep
        keep_step_buffers()  # then the steps' activations stay in the heap from step to step
        self.load_seconds = time.monotonic() - t0

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        """Plain text exactly as ``tokenizer(prompt)``; chat messages through the chat template."""
        if messages is not None:
            return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
        return self.tokenizer(prompt)["input_ids"]

    def add_request(self, prompt: str | Sequence[int] | None = None, params: SamplingParams | None = None,
                    request_id: str | None = None, messages: Sequence[dict] | None = None,
                    prefill_only: bool = False) -> str:
        """Validate and queue one request; returns its id.

        Args:
            prompt: text (tokenized as ``tokenizer(prompt)``) or token ids.
            params: sampling parameters (validated when built).
            request_id: unique id; generated when None.
            messages: chat messages (role/content), rendered with the model's chat template.
            prefill_only: prefill side of disaggregation: stop after the first token and hold
                the KV blocks until :meth:`release`.
        Raises:
            InvalidRequestError: empty or too long prompt, token ids out of range, duplicate id.
        """
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages")
        if isinstance(prompt, str) or messages is not None:
            ids = self.tokenize(prompt if isinstance(prompt, str) else None, messages)
        else:
            ids = list(prompt)
        req = self._new_request(ids, params, request_id)
        req.prefill_only = prefill_only
        self.scheduler.add(req)
        self._track(req)
        return req.request_id

    def _new_request(self, ids: list[int], params: SamplingParams | None, request_id: str | None) -> Request:
        params = params or SamplingParams()
        params.validate()
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is needed")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the context limit is {self.max_model_len} "
                "(prompt plus at least one new token must fit): shorten the prompt")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and len(ids) > sc.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, more than max_num_batched_tokens="
                f"{sc.max_num_batched_tokens} with chunked prefill off")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids)
        if params.guided is not None:
            req.grammar = self.grammars.state(params.guided)
        return req

    def _track(self, req: Request) -> None:
        self._text[req.request_id] = TextStream(self.tokenizer, req.sampling_params.stop)

    # ---- disaggregation ---------------------------------------------------------------------
    def add_remote(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                   request_id: str | None = None, first_token: int | None = None) -> RemoteSlot | None:
        """Decode side: reserve blocks for a request whose prompt a prefill worker computes.

        Args:
            prompt_ids: the prompt's token ids (its KV will arrive into the returned blocks).
            params: the request's sampling parameters.
            request_id: unique id (the router's).
            first_token: the token the prefill side sampled, if already known; otherwise give
                it to :meth:`kv_arrived`.
        Returns:
            Where the transfer must land: the request's blocks and the first prompt position
            to receive (positions before it are a prefix this side's cache already held); or
            None if the blocks are not free now.
        Raises:
            InvalidRequestError: like add_request, or a first token outside the vocabulary.
        """
        req = self._new_request(list(prompt_ids), params, request_id)
        if first_token is not None:
            self._check_token(first_token)
            req.append_output_token(first_token)
        if not self.scheduler.add_remote(req):
            return None
        self._track(req)
        return RemoteSlot(list(req.block_ids), req.num_cached_tokens)

    def cached_prefix_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Leading prompt tokens a request would find in the prefix cache now (whole blocks
        before its last token, as ``add_remote`` and the scheduler look up); counts no hit."""
        bm = self.block_manager
        return len(bm.lookup(prompt_ids, len(prompt_ids) - 1)) * bm.block_size

    def kv_arrived(self, request_id: str, first_token: int | None = None) -> RequestOutput | None:
        """Decode side: the KV transfer into the reserved blocks is complete; start decoding
        after ``first_token`` (required here unless given to :meth:`add_remote`).

        Returns:
            None when the request now decodes; its final output when the first token already
            ends it (EOS, a stop token or string, max_tokens, the context limit): its blocks
            are freed and nothing is queued.
        Raises:
            KeyError: not a request waiting for its KV here (e.g. already aborted).
        """
        req = self.scheduler.receiving.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not waiting for its KV here")
        if first_token is not None:
            self._check_token(first_token)
            if req.output_token_ids:
                raise InvalidRequestError(f"request {request_id!r} already has its first token")
            req.append_output_token(first_token)
        if not req.output_token_ids:
            raise InvalidRequestError(f"request {request_id!r} needs the prefill's first token")
        # The first token's text was streamed by whoever sampled it (less a tail that could
        # still become a stop string): start the deltas after what it sent.
        text = self._text[request_id]
        stopped = text.step(req.output_token_ids, search_from=0)
        text.mark_sent()
        status = self.scheduler.check_stop(req, req.output_token_ids[-1])
        if status is None and stopped:
            status = RequestStatus.FINISHED_STOPPED
        self.scheduler.kv_arrived(request_id)  # (its prompt's blocks enter the prefix cache either way)
        if status is not None:
            self.scheduler.finish(req, status)
            return self._output(req, 0, search_from=0)
        return None

    def _check_token(self, token: int) -> None:
        if not isinstance(token, int) or not 0 <= token < self.model_config.vocab_size:
            raise InvalidRequestError(f"token {token!r} is outside the vocabulary")

    def release(self, request_id: str) -> bool:
        """Prefill side: the KV transfer ended (acked or failed); free the request's blocks."""
        return self.scheduler.release(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; its blocks are freed now. False if unknown.

        Decode side of disaggregation: abort the request's KV transfer first
        (``KVReceiver.abort``); after that the receiver drops late frames, so freeing the
        reserved blocks here cannot race a write into them.
        """
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self, layer_done: Callable[[int, StepPlan], None] | None = None) -> list[RequestOutput]:
        """Schedule, run one forward, update; returns outputs of requests that produced tokens.

        Args:
            layer_done: called as ``layer_done(i, plan)`` once layer i's KV of this step is in
                the cache (a prefill worker streams it from there); requests in ``plan`` still
                show their pre-step ``num_computed_tokens``.
        """
        spec = self.spec
        if spec is not None:
            spec.before_schedule(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        hook = None if layer_done is None else (lambda i: layer_done(i, plan))
        if spec is not None:
            spec.propose(plan, self.runner.generator)
            t0 = time.perf_counter()
        result = self.runner.execute(plan, hook)
        if spec is not None:
            spec.observe(plan, result, time.perf_counter() - t0)
        touched = self.scheduler.update(plan, result)
        outputs = []
        for req in touched:
            new = result.sampled.get(req.request_id)
            if not new and not req.is_finished:
                continue
            outputs.append(self._output(req, len(new or ()), logprobs=result.logprobs.get(req.request_id)))
        return outputs

    def _output(self, req: Request, num_new: int, search_from: int | None = None,
                logprobs: list | None = None) -> RequestOutput:
        """Build the step's output: text delta, stop strings, finish. ``search_from``: where a
        stop string may start (default: just before the text added by this step)."""
        stream = self._text[req.request_id]
        done = req.is_finished and req.status != RequestStatus.PREFILLED  # decode goes on elsewhere
        if stream.step(req.output_token_ids, final=done, search_from=search_from):
            num_new = self._drop_after_stop(req, num_new)
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        done = req.is_finished and req.status != RequestStatus.PREFILLED
        delta = stream.delta(done)
        text = stream.text
        req.output_text = text
        if req.is_finished:
            req.finish_time = time.monotonic()
            self._forget(req.request_id)
        return RequestOutput(req.request_id, req.output_token_ids[-num_new:] if num_new else [], delta,
                             list(req.output_token_ids), text, req.is_finished, req.finish_reason,
                             req.num_prompt_tokens, req.num_cached_tokens, req.ttft, req.mean_tpot,
                             logprobs[:num_new] if logprobs is not None else None,
                             req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None
                             and num_new and len(req.output_token_ids) == num_new else None)

    def _drop_after_stop(self, req: Request, num_new: int) -> int:
        """A step that added several tokens (speculative verify) may run past a stop string:
        keep only the tokens up to the one that completed it, as one-token steps would."""
        keep = tokens_through_stop(self.tokenizer, req.output_token_ids, num_new, req.sampling_params.stop)
        for _ in range(num_new - keep):
            req.output_token_ids.pop()
        return keep

    def _forget(self, request_id: str) -> None:
        self._text.pop(request_id, None)
        self.runner.forget(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, vocab] of every position of ``token_ids`` (for evaluation and tests).

        Runs one prefill through the paged cache on temporary blocks, freed before returning.
        Raises:
            InvalidRequestError: empty or longer than the context limit.
            RuntimeError: not enough free KV blocks right now.
        """
        ids = list(token_ids)
        if not ids or len(ids) > self.max_model_len:
            raise InvalidRequestError(f"need 1..{self.max_model_len} tokens, got {len(ids)}")
        req = Request("__score__", ids, SamplingParams(max_tokens=1))
        if not self.block_manager.allocate(req.block_ids, len(ids)):
            raise RuntimeError("not enough free KV blocks to score this sequence now")
        try:
            return self.runner.all_logits(StepPlan([ScheduledRequest(req, len(ids))]))
        finally:
            self.block_manager.free(req.block_ids)

    def stream(self) -> Iterator[RequestOutput]:
        """Step while there is something to compute, yielding outputs as they come."""
        while self.scheduler.has_work():
            yield from self.step()

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` together in one continuous batch; final outputs in prompt order."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        for out in self.stream():
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]
