"""Verify step: turn the target's logits over each request's 1+k positions into accepted tokens.

The runner computes logits for every verified position in one forward; here each position gets
the same penalties and filters plain sampling would apply at that point of the sequence (the
drafts before it count as output tokens), then :func:`accept_draft` decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from engine.grammar import apply_bitmask
from engine.request import Request
from engine.sampler import apply_penalties, logits_to_probs
from engine.scheduler import ScheduledRequest
from engine.spec.acceptance import accept_draft

# (request, output index of the token drawn, stream) -> generator; see ModelRunner.generator
GeneratorFn = Callable[[Request, int, int], torch.Generator | None]
VERIFY_STREAM = 1  # verify draws use their own random stream, apart from the draft's


def verify(logits: Tensor, items: Sequence[ScheduledRequest], generator: GeneratorFn,
           masks: tuple[Sequence[int], Any] | None = None) -> dict[str, list[int]]:
    """Accepted tokens per request.

    A structured-output request's rows carry its grammar's mask at each position (the state
    after the drafts before it; engine.grammar): a draft the grammar refuses has zero target
    probability (sampled) or is not the masked argmax (greedy), so it is rejected and the token
    drawn in its place, from the masked distribution, is one the grammar allows. The rejection
    rule stays exact for the masked target whatever the draft proposed.

    Args:
        logits: [sum(1 + k_i), V] target logits, item i's 1+k_i rows together, in item order.
        items: the verified requests, each with its drafts (``spec_token_ids``, maybe none).
        generator: the per-request, per-position generator.
        masks: (logit rows, bitmask) from engine.grammar.GrammarCompiler.draft_masks, or None.

    Returns:
        request id -> accepted drafts + one target token.
    """
    params, prompts, outputs = [], [], []
    for s in items:
        r, d = s.request, s.spec_token_ids
        for j in range(len(d) + 1):
            params.append(r.sampling_params)
            prompts.append(r.prompt_token_ids)
            outputs.append(r.output_token_ids + d[:j])
    logits = apply_penalties(logits, params, prompts, outputs)
    if masks is not None:
        logits = apply_bitmask(logits, *masks)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    probs = logits_to_probs(logits[sampled_rows], [params[i] for i in sampled_rows]) if sampled_rows else None
    prob_row = {row: i for i, row in enumerate(sampled_rows)}

    out: dict[str, list[int]] = {}
    row = 0
    for s in items:
        r, d = s.request, s.spec_token_ids
        rows = slice(row, row + len(d) + 1)
        greedy = r.sampling_params.greedy
        target = logits[rows] if greedy else probs[prob_row[row]:prob_row[row] + len(d) + 1]
        base = r.num_output_tokens
        out[r.request_id] = accept_draft(d, target, s.spec_probs, greedy,
                                         lambda j, r=r, base=base: generator(r, base + j, VERIFY_STREAM))
        row += len(d) + 1
    return out
