"""A draft that is a model: k batched forwards over the paged KV layout, one token each.

Shared by the separate draft model, the layer-skip self-draft and the quantized self-draft.
The draft's KV uses the target's block tables (same slots: block * block_size + offset) in
tensors of its own (``kv_caches``), or in the target's own tensors for a layer-skip draft whose
layers *are* the target's first layers (the target rewrites those slots in its verify).

Keeping the draft's cache in step: per request the draft knows how many leading positions hold
its KV (``_computed``). After a verify, positions below the target's ``num_computed_tokens``
hold exactly the tokens the draft fed (accepted drafts are its own tokens), so the count is
cut to that; a preemption (new blocks) resets it to 0 and the draft recomputes from the start.
Each propose step first feeds the tokens the draft has not seen (one or two after a verify,
the whole prompt for a new request), then its own drafts one at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.request import Request
from engine.sampler import apply_penalties, logits_to_probs, sample_from_probs
from engine.scheduler import ScheduledRequest
from engine.spec.proposer import Proposer
from engine.spec.verify import GeneratorFn

DRAFT_STREAM = 2  # the draft's sampling draws, apart from the verify's


class ModelDraft(Proposer):
    """Greedy or sampled proposals from ``model`` (``forward(ids, pos, meta, kv)`` returns hidden
    states, ``compute_logits(hidden)`` logits), whose KV lives in ``kv_caches``.

    Args:
        model: the draft network.
        backend: its attention backend.
        kv_caches: per draft layer (K, V), laid out like the target's cache.
        block_size: the target's block size.
        shares_target_kv: the draft's KV is the target's own (layer-skip): every position the
            target computed is valid for the draft too.
    """

    def __init__(self, model, backend: AttentionBackend, kv_caches: list[tuple[Tensor, Tensor]],
                 block_size: int, device: str = "cpu", shares_target_kv: bool = False) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.shares_target_kv = shares_target_kv
        self._computed: dict[str, tuple[int, int]] = {}  # id -> (num_preemptions, positions)

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    def stale_tokens(self, request: Request) -> int:
        return request.num_tokens - 1 - self._valid(request)

    def _valid(self, r: Request) -> int:
        """Leading positions whose draft KV matches the request's tokens now."""
        if self.shares_target_kv:
            return r.num_computed_tokens
        preemptions, n = self._computed.get(r.request_id, (-1, 0))
        return min(n, r.num_computed_tokens) if preemptions == r.num_preemptions else 0

    @torch.inference_mode()
    def propose(self, items: Sequence[ScheduledRequest], generator: GeneratorFn) -> None:
        items = [s for s in items if s.max_spec_tokens]
        if not items:
            return
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[Tensor]] = [[] for _ in items]
        # Step 0 feeds what the draft has not seen, up to the last token; then one draft each.
        # Timing for the adaptive policy: the first forward carries the catch-up tokens.
        feeds = [self._unseen(s.request) for s in items]
        self.catchup_tokens = sum(len(toks) - 1 for _, toks in feeds)
        self.first_seconds, self.rest_seconds = 0.0, 0.0
        for step in range(max(s.max_spec_tokens for s in items)):
            t0 = time.perf_counter()
            live = [i for i, s in enumerate(items) if s.max_spec_tokens > step]
            reqs = [items[i].request for i in live]
            logits = self._forward(reqs, [feeds[i] for i in live])
            best = self._choose(logits, reqs, step, generator, [drafts[i] for i in live], [probs[i] for i in live])
            for j, i in enumerate(live):
                drafts[i].append(best[j])
                start, toks = feeds[i]
                feeds[i] = (start + len(toks), [best[j]])
            dt = time.perf_counter() - t0
            if step == 0:
                self.first_seconds = dt
            else:
                self.rest_seconds += dt
        for i, s in enumerate(items):
            r = s.request
            # Fed positions: up to the last token, then all drafts but the newest.
            self._computed[r.request_id] = (r.num_preemptions, feeds[i][0])
            s.set_draft(drafts[i], torch.stack(probs[i]) if probs[i] else None)

    def _unseen(self, r: Request) -> tuple[int, list[int]]:
        """(first position the draft has no KV for, the tokens from there on)."""
        start = self._valid(r)
        return start, r.all_token_ids[start:]

    def _forward(self, reqs: list[Request], feeds: list[tuple[int, list[int]]]) -> Tensor:
        """One draft forward over each request's fed tokens; the logits at each one's last."""
        bs, dev = self.block_size, self.device
        ids, pos, slots, qlens, ctxs, rows = [], [], [], [], [], []
        for r, (start, toks) in zip(reqs, feeds):
            rng = range(start, start + len(toks))
            ids.extend(toks)
            pos.extend(rng)
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in rng)
            qlens.append(len(toks))
            ctxs.append(start + len(toks))
            rows.append(len(ids) - 1)
        tables = [r.block_ids for r in reqs]
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), qlens, ctxs, tables, bs)
        self.backend.prepare(meta, dev)
        hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta,
                                    self.kv_caches)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])

    def _choose(self, logits: Tensor, reqs: list[Request], step: int, generator: GeneratorFn,
                drafts: list[list[int]], probs: list[list[Tensor]]) -> list[int]:
        """Each request's next draft token: the argmax for greedy requests, a draw from q for
        sampled ones (whose q row is appended to their ``probs``)."""
        params = [r.sampling_params for r in reqs]
        logits = apply_penalties(logits, params, [r.prompt_token_ids for r in reqs],
                                 [r.output_token_ids + d for r, d in zip(reqs, drafts)])
        best = logits.argmax(dim=-1).tolist()
        sampled = [j for j, p in enumerate(params) if not p.greedy]
        if sampled:
            q = logits_to_probs(logits[sampled], [params[j] for j in sampled])
            for row, j in enumerate(sampled):
                r = reqs[j]
                gen = generator(r, r.num_output_tokens + step, DRAFT_STREAM)
                best[j] = int(sample_from_probs(q[row:row + 1], [gen])[0])
                probs[j].append(q[row])
        return best
