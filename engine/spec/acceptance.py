"""The acceptance rule of speculative decoding: which draft tokens the target keeps.

One function, :func:`accept_draft`, for greedy and sampled requests alike; the runner calls it
once per verified request with the target's distributions over the 1+k verified positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.sampler import sample_from_probs


def accept_draft(draft_ids: list[int], target: Tensor, draft_probs: Tensor | None, greedy: bool,
                 generator_at: Callable[[int], torch.Generator | None]) -> list[int]:
    """Accept a prefix of the draft and add one token of the target's own.

    Greedy requests keep the draft where it equals the target's argmax (:func:`_accept_greedy`);
    sampled ones use speculative sampling, whose maths is written beside its code
    (:func:`_accept_sampled`).

    Args:
        draft_ids: the k draft tokens d_0..d_{k-1} (k may be 0: plain decoding).
        target: [k+1, V]. Sampling: the target's probabilities p_0..p_k (row j is the
            distribution of the token at draft slot j, row k the one after the last draft).
            Greedy: scores whose argmax is the target's choice (penalized logits suffice).
        draft_probs: [k, V] draft probabilities q_j, or None for a deterministic draft.
        greedy: the request decodes greedily.
        generator_at: the generator for the draws at slot j (None: torch's global RNG).

    Returns:
        n accepted drafts followed by one token from the target: n + 1 token ids, 0 <= n <= k.
    """
    if greedy:
        return _accept_greedy(draft_ids, target)
    return _accept_sampled(draft_ids, target, draft_probs, generator_at)


def _accept_greedy(draft_ids: list[int], target: Tensor) -> list[int]:
    """Greedy (temperature 0): keep the longest prefix of the draft that equals the target's
    argmax at each position, then add the target's argmax after it (the "bonus" token when
    every draft was right, the correction otherwise). The output equals plain greedy decoding
    token for token, whatever the draft proposed."""
    k = len(draft_ids)
    best = target.argmax(dim=-1).tolist()
    n = 0
    while n < k and draft_ids[n] == best[n]:
        n += 1
    return list(draft_ids[:n]) + [best[n]]


def _accept_sampled(draft_ids: list[int], target: Tensor, draft_probs: Tensor | None,
                    generator_at: Callable[[int], torch.Generator | None]) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023 / Chen et al. 2023). At draft slot j the
    draft proposed x ~ q_j and the target's distribution there is p_j (both after the same
    penalties, temperature, top-k, top-p and min-p; the caller builds them identically):

        accept x with probability min(1, p_j(x) / q_j(x));
        on rejection draw from r_j = normalize(max(0, p_j - q_j)) and stop;
        if all k drafts are accepted, draw one more token from p_k.

    Why the output is distributed exactly as p_j: the chance of emitting y at slot j is
        q(y) * min(1, p(y)/q(y))  +  P(reject) * r(y)
      = min(p(y), q(y))          +  (sum_x max(0, q(x) - p(x))) * max(0, p(y) - q(y)) / Z
    and Z = sum_x max(0, p(x) - q(x)) = 1 - sum_x min(p(x), q(x)) = sum_x max(0, q(x) - p(x)),
    so the second term is max(0, p(y) - q(y)) and the sum is min(p, q) + max(0, p - q) = p(y).
    A deterministic draft (n-gram lookup, a greedy draft model) has q_j = point mass on x: then
    x is accepted with probability p_j(x) and r_j is p_j with x removed. Greedy is the special
    case where p_j is a point mass too.
    """
    for j, x in enumerate(draft_ids):
        p = target[j]
        px = float(p[x])
        qx = 1.0 if draft_probs is None else float(draft_probs[j, x])
        gen = generator_at(j)
        u = float(torch.rand((), generator=gen, device=p.device))
        # u < min(1, px/qx), written without the division (qx > 0: x was drawn from q).
        if u * qx < px:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere: only float rounding gets here
            residual = p
        tok = int(sample_from_probs(residual.unsqueeze(0), [gen])[0])
        return list(draft_ids[:j]) + [tok]
    k = len(draft_ids)
    tok = int(sample_from_probs(target[k].unsqueeze(0), [generator_at(k)])[0])
    return list(draft_ids) + [tok]
