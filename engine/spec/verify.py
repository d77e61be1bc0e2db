"""Verify step: turn the target's logits over each request's 1+k positions into accepted tokens.

The runner computes logits for every verified position in one forward; here each position gets
the same penalties and filters plain sampling would apply at that point of the sequence (the
drafts before it count as output tokens), then :func:`accept_draft` decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from engine.request import Request
from engine.sampler import apply_penalties, logits_to_probs
from engine.scheduler import ScheduledRequest
from engine.spec.acceptance import accept_draft

# (request, output index of the token drawn, stream) -> generator; see ModelRunner.generator
GeneratorFn = Callable[[Request, int, int], torch.Generator | None]
VERIFY_STREAM = 1  # verify draws use their own random stream, apart from the draft's


def verify(logits: Tensor, items: Sequence[ScheduledRequest], generator: GeneratorFn) -> dict[str, list[int]]:
    """Accepted tokens per request.

    Args:
        logits: [sum(1 + k_i), V] target logits, item i's 1+k_i rows together, in item order.
        items: the verified requests, each with its drafts (``spec_token_ids``, maybe none).
        generator: the per-request, per-position generator.

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
