"""Model runner: turns a StepPlan into one forward over the paged KV cache, then samples.

Owns the model, the KV tensors, the attention backend and the sampler. Knows nothing of
queues: it reads each scheduled request's tokens, positions and blocks, and returns a
StepResult with the sampled tokens of the requests that reached their last token.

A speculative request brings its last token plus k draft tokens; all 1+k positions get logits
and ``engine.spec.verify`` turns them into the accepted drafts plus one token of the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.sampler import Sampler, apply_penalties, make_generator, prompt_token_logprobs, token_logprobs
from engine.scheduler import StepPlan, StepResult
from engine.spec.verify import verify


PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per slice (SamplingParams.prompt_logprobs)


class ModelRunner:
    """Executes steps; ``kv_caches`` is the per-layer (K, V) list from ``allocate_kv_tensors``."""

    def __init__(self, model: nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: str = "cpu") -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.grammars = None  # engine.grammar.GrammarCompiler: set by the engine (structured outputs)
        self.jump_forward = 0  # EngineConfig.jump_forward: set by the engine
        self._generators: dict[str, torch.Generator | None] = {}

    def forget(self, request_id: str) -> None:
        """Drop per-request state (its sampling generator) once the request is finished."""
        self._generators.pop(request_id, None)

    def _generator(self, req) -> torch.Generator | None:
        """The request's generator, re-seeded for the position of the token it draws next.

        Seeding by (seed, output index) makes a seeded request's draws depend only on its own
        progress: the same tokens whether it runs alone, batched, after a preemption, or on a
        decode worker that continues after a prefill worker drew its first token.
        """
        return self.generator(req, req.num_output_tokens, 0) if req.sampling_params.seed is not None else None

    def generator(self, req, index: int, stream: int = 0) -> torch.Generator | None:
        """The generator for output token ``index`` of ``req`` in random ``stream`` (0: plain
        sampling; speculative decoding keeps its draft and verify draws in streams of their
        own). Unseeded requests get the sampler's shared generator."""
        seed = req.sampling_params.seed
        if seed is None:
            return self.sampler.default_generator(self.device) if stream else None
        index += req.sampling_params.resumed  # a re-run continues its seed's sequence
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = make_generator(seed, self.device)
        # splitmix-style mixing keeps neighbouring (seed, index) pairs far apart
        gen.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9
                         + stream * 0x94D049BB133111EB) % 2**63)
        return gen

    @torch.inference_mode()
    def execute(self, plan: StepPlan, layer_done: Callable[[int], None] | None = None) -> StepResult:
        """Run one forward for ``plan`` and sample where a request reached its last token.

        Args:
            plan: what to compute.
            layer_done: called with i when layer i's K/V are in the cache (KV streaming).
        """
        hidden, sample_rows, sample_reqs = self._forward(plan, layer_done)
        result = StepResult()
        self._prompt_logprobs(plan, hidden, result)
        verified = [s for s in plan.scheduled if s.max_spec_tokens]
        if not sample_reqs and not verified:
            return result
        if verified:  # verify rows first (1+k per request), then the plain sampling rows
            vrows = [i for s in verified for i in range(s.first_row, s.first_row + s.num_new_tokens)]
            logits = self.model.compute_logits(hidden[torch.tensor(vrows + sample_rows, device=self.device)])
            masks = self.grammars.draft_masks(verified) if self.grammars is not None else None
            result.sampled.update(verify(logits[:len(vrows)], verified, self.generator, masks))
            logits = logits[len(vrows):]
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        if not sample_reqs:
            return result
        params = [r.sampling_params for r in sample_reqs]
        prompts, outputs = [r.prompt_token_ids for r in sample_reqs], [r.output_token_ids for r in sample_reqs]
        masks = self.grammars.masks(sample_reqs) if self.grammars is not None else None
        tokens = self.sampler(logits, params, prompts, outputs, [self._generator(r) for r in sample_reqs], masks)
        for r, t in zip(sample_reqs, tokens):
            result.sampled[r.request_id] = [t] + self._forced(r, t)
        if any(p.logprobs is not None for p in params):
            for r, lp in zip(sample_reqs, token_logprobs(apply_penalties(logits, params, prompts, outputs),
                                                         params, tokens)):
                if lp is not None:
                    result.logprobs[r.request_id] = [lp]
        return result

    def _forced(self, req, token: int) -> list[int]:
        """Jump-forward (EngineConfig.jump_forward): what ``req``'s grammar forces after
        ``token``. Not on a prefill-only request (its decode worker takes it from the first
        token), nor one asking for logprobs (forced tokens have none), nor past max_tokens."""
        sp = req.sampling_params
        if not self.jump_forward or req.grammar is None or req.prefill_only or sp.logprobs is not None:
            return []
        room = min(self.jump_forward, sp.max_tokens - req.num_output_tokens - 1)
        return req.grammar.forced(req.prompt_token_ids, [*req.output_token_ids, token], sp.resumed, room)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, result: StepResult) -> None:
        """For requests with SamplingParams.prompt_logprobs, score the prompt tokens this step
        computed (the logits at position p score prompt token p + 1), before any output."""
        for s in plan.scheduled:
            r = s.request
            k = r.sampling_params.prompt_logprobs
            if k is None or r.output_token_ids:
                continue
            start, prompt = r.num_computed_tokens, r.prompt_token_ids
            first = max(start, len(r.prompt_logprobs))  # positions already scored stay scored
            end = min(start + s.num_new_tokens, len(prompt) - 1)
            if first >= end:
                continue
            out = result.prompt_logprobs[r.request_id] = []
            # Full-vocabulary logits for a whole chunk at once would be rows x vocab x 4 bytes
            # twice over (0.8 GB for 2,048 rows here): a slice at a time.
            for a in range(first, end, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, end)
                rows = torch.arange(s.first_row + a - start, s.first_row + b - start, device=self.device)
                out += prompt_token_logprobs(self.model.compute_logits(hidden[rows]), prompt[a + 1:b + 1], k)

    @torch.inference_mode()
    def all_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits [T, vocab] (fp32) of every token in ``plan``, in batch order; nothing sampled."""
        hidden, _, _ = self._forward(plan)
        return self.model.compute_logits(hidden)

    def _forward(self, plan: StepPlan, layer_done: Callable[[int], None] | None = None
                 ) -> tuple[torch.Tensor, list[int], list]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens, ctxs, tables = [], [], []
        sample_rows: list[int] = []
        sample_reqs = []
        bs = self.block_size
        for s in plan.scheduled:
            r, n = s.request, s.num_new_tokens
            start = r.num_computed_tokens
            s.first_row = len(ids)
            toks = r.all_token_ids[start:start + n - len(s.spec_token_ids)] + s.spec_token_ids
            ids.extend(toks)
            rng = range(start, start + n)
            pos.extend(rng)
            bt = r.block_ids
            slots.extend(bt[p // bs] * bs + p % bs for p in rng)
            qlens.append(n)
            ctxs.append(start + n)
            tables.append(bt)
            if s.samples and not s.max_spec_tokens:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(r)
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), qlens, ctxs, tables, bs)
        self.backend.prepare(meta, dev)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, self.kv_caches,
                            layer_done)
        return hidden, sample_rows, sample_reqs
