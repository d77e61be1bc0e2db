"""Token sampling: penalties, then temperature and top-k / top-p / min-p filters, then a draw.

One step over a batch of rows (one row per request, each row with its own SamplingParams):

    apply_penalties    repetition penalty (prompt + output tokens), then presence and
                       frequency penalties (output tokens only)
    logits_to_probs    greedy rows: one-hot of the argmax; other rows, in this order:
                       temperature -> top-k -> top-p -> min-p -> renormalized softmax
    sample_from_probs  argmax of probs / Exp(1) noise, the noise from the row's own generator

A structured-output row (SamplingParams.guided) has its grammar's mask applied after the
penalties: forbidden tokens at -inf, so greedy, sampling and every filter see only allowed ones.

``logits_to_probs`` is pure, so speculative decoding builds its draft and target distributions
with it and gets them filtered identically. All maths runs in float32 whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from engine.grammar import apply_bitmask
from engine.request import SamplingParams

# Slack on the top-p comparison: a cumulative sum that equals top_p in exact arithmetic but
# lands a few ulps below it in float32 still closes the nucleus there.
_TOP_P_EPS = 1e-6
# Dividing by a temperature much smaller than this overflows float32 logits into inf/nan.
_MIN_TEMPERATURE = 1e-5


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for a request's ``seed``: same seed, same draws.

    Args:
        seed: SamplingParams.seed; None means the request draws from the Sampler's default.
        device: where the logits live; a generator must sit on the device it samples on.

    Returns:
        A freshly seeded generator, or None when ``seed`` is None.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _flat_ids(rows: Sequence[int], id_lists: Sequence[Sequence[int]], vocab_size: int) -> Tensor:
    """Token ids of ``id_lists[j]`` (belonging to row ``rows[j]``) as ``row * V + id``, on CPU."""
    parts = [torch.as_tensor(ids, dtype=torch.long).reshape(-1) for ids in id_lists]
    ids = torch.cat(parts)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        # Out-of-range ids would silently land in a neighbouring row of the flat index.
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.long)
    row_of = torch.repeat_interleave(torch.as_tensor(rows, dtype=torch.long), lengths)
    return row_of * vocab_size + ids


def apply_penalties(logits: Tensor, params: Sequence[SamplingParams],
                    prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]) -> Tensor:
    """Penalize tokens already seen, HF-style repetition first, then OpenAI-style presence/frequency.

    Repetition (over the set of prompt + output tokens, once per token however often it
    appears): positive logits are divided by the penalty, negative ones multiplied, so a
    penalty > 1 always lowers the logit. Then, over output tokens only:
    ``logit -= frequency_penalty * count + presence_penalty``.

    Args:
        logits: [B, V] scores, any float dtype. Never modified.
        params: one SamplingParams per row.
        prompt_ids: per row, the prompt token ids.
        output_ids: per row, the token ids generated so far.

    Returns:
        [B, V] float32 logits. When no row has a penalty this is ``logits.float()`` (the input
        itself if already float32) and costs nothing more; otherwise a new tensor in which
        rows with neutral penalties are copied unchanged.
    """
    batch, vocab = logits.shape
    if not len(params) == len(prompt_ids) == len(output_ids) == batch:
        raise ValueError(f"expected {batch} params/prompt_ids/output_ids, got "
                         f"{len(params)}/{len(prompt_ids)}/{len(output_ids)}")
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    pf_rows = [i for i, p in enumerate(params)
               if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rep_rows and not pf_rows:
        return logits.float()

    out = logits.to(torch.float32, copy=True)
    dev = out.device

    def per_row(name: str, index: Tensor) -> Tensor:
        values = torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
        return values[index].to(dev)

    if rep_rows:
        # Prompt and output ids of the same row go in as two lists; unique() merges them.
        flat = torch.unique(_flat_ids(rep_rows * 2, [prompt_ids[i] for i in rep_rows]
                                      + [output_ids[i] for i in rep_rows], vocab))
        row, col = flat // vocab, flat % vocab
        penalty = per_row("repetition_penalty", row)
        row, col = row.to(dev), col.to(dev)
        seen = out[row, col]
        out[row, col] = torch.where(seen > 0, seen / penalty, seen * penalty)

    if pf_rows:
        # A re-run's earlier output sits at the end of its prompt (SamplingParams.resumed).
        outs = [[*prompt_ids[i][len(prompt_ids[i]) - params[i].resumed:], *output_ids[i]] if params[i].resumed
                else output_ids[i] for i in pf_rows]
        flat, counts = torch.unique(_flat_ids(pf_rows, outs, vocab), return_counts=True)
        row, col = flat // vocab, flat % vocab
        delta = per_row("frequency_penalty", row) * counts.to(dev, torch.float32)
        delta += per_row("presence_penalty", row)
        row, col = row.to(dev), col.to(dev)
        out[row, col] -= delta
    return out


def _one_hot_argmax(logits: Tensor) -> Tensor:
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _filtered_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature -> top-k -> top-p -> min-p for rows that all sample; returns [B, V] probs."""
    batch, vocab = logits.shape
    dev = logits.device

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)

    temps = [max(p.temperature, _MIN_TEMPERATURE) for p in params]
    x = logits.float() / column(temps)  # a new tensor: the caller's logits stay untouched

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        # Stable sort: among tied logits the lower token id ranks first, so ties are cut
        # deterministically.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = rank >= torch.tensor(top_k, device=dev).unsqueeze(1)
        if use_p:
            # top-p sees the distribution renormalized after top-k.
            sorted_probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            cum = sorted_probs.cumsum(dim=-1)
            # Mass strictly before each token. A token is kept while that mass is still short
            # of top_p: the kept set is the smallest one whose mass reaches top_p.
            before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
            limit = column([p - _TOP_P_EPS if p < 1.0 else float("inf") for p in top_p])
            drop |= before >= limit
            drop[:, 0] = False  # the top token always survives, however small top_p is
        mask = torch.empty_like(drop).scatter_(1, order, drop)
        x = x.masked_fill(mask, float("-inf"))

    probs = x.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        # p >= min_p * p_max is a ratio test, so it does not care that top-k/top-p already
        # renormalized; the top token always passes (min_p <= 1).
        p_max = probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < column(min_p) * p_max, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def logits_to_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The distribution each row samples from. Pure: the input is never modified.

    Non-greedy rows, in this order: divide by temperature; keep the ``top_k`` highest
    (``top_k <= 0`` disables); keep the smallest set whose cumulative probability reaches
    ``top_p`` (the top token always kept); keep tokens with ``p >= min_p * p_max``; softmax
    renormalized over what is kept. Filtered tokens get exactly zero probability.

    Args:
        logits: [B, V] scores, any float dtype (penalties already applied).
        params: one SamplingParams per row.

    Returns:
        [B, V] float32 probabilities; greedy rows (temperature 0) are a one-hot of the argmax.
    """
    batch, _ = logits.shape
    if len(params) != batch:
        raise ValueError(f"expected {batch} params, got {len(params)}")
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return _one_hot_argmax(logits)
    if len(sampled) == batch:
        return _filtered_probs(logits, params)
    probs = _one_hot_argmax(logits)
    idx = torch.tensor(sampled, device=logits.device)
    probs[idx] = _filtered_probs(logits[idx], [params[i] for i in sampled])
    return probs


def sample_from_probs(probs: Tensor, generators: Sequence[torch.Generator | None],
                      default: torch.Generator | None = None) -> Tensor:
    """Draw one token per row from ``probs``, each row's randomness from its own generator.

    Uses the exponential race: with E_i ~ Exp(1) independent, E_i / p_i ~ Exp(rate p_i) and the
    smallest of those is token i with probability p_i / sum(p); so argmax(p / E) is an exact
    draw, needs no cumsum, and never picks a zero-probability token.

    Args:
        probs: [B, V] non-negative rows (need not be normalized).
        generators: per row, its generator, or None to draw from ``default``.
        default: generator for rows without one; None means torch's global RNG.

    Returns:
        [B] long token ids on ``probs.device``.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"expected {probs.shape[0]} generators, got {len(generators)}")
    noise = torch.empty_like(probs, dtype=torch.float32)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        noise.exponential_(generator=default)
    else:
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            noise[idx] = torch.empty_like(noise[idx]).exponential_(generator=default)
        # Each seeded row draws V values from its own generator, so its tokens do not depend
        # on which other requests share the batch.
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
    # A zero draw would make 0/0 = nan for masked tokens, and argmax picks nan.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs.float() / noise).argmax(dim=-1)


# (sampled token, its log probability, [(token, log probability) of the most likely, first first])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def token_logprobs(logits: Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
                   ) -> list[TokenLogprob | None]:
    """Per row that asks (``params[i].logprobs`` set; None for the others): the sampled token's
    log probability and the ``logprobs`` most likely tokens', from ``log_softmax(logits / T)``.

    ``logits`` are the rows' penalized logits (apply_penalties), the distribution the token was
    drawn from before top-k/top-p/min-p filtering (filtered tokens keep a finite value, as the
    OpenAI API reports them); T is the row's temperature, 1 for a greedy row (its plain
    log-softmax, what a log-likelihood evaluation wants).
    """
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    dev = logits.device
    temps = torch.tensor([max(params[i].temperature, _MIN_TEMPERATURE) if params[i].temperature else 1.0
                          for i in rows], dtype=torch.float32, device=dev)
    lp = torch.log_softmax(logits[torch.tensor(rows, device=dev)].float() / temps[:, None], dim=-1)
    scored = _scored(lp, [tokens[i] for i in rows], max(params[i].logprobs for i in rows))
    for i, (tok, chosen, top) in zip(rows, scored):
        out[i] = (tok, chosen, top[:params[i].logprobs])
    return out


def _scored(lp: Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Per row of log probabilities ``lp``: (``tokens[j]``, its value, the ``k`` largest)."""
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return [(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, top_i.tolist(), top_v.tolist())]


def prompt_token_logprobs(logits: Tensor, next_tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Raw log probabilities (log_softmax, no penalties, temperature 1) of ``next_tokens[j]``
    under ``logits[j]`` and the ``k`` most likely tokens there: a prompt's own tokens, scored."""
    return _scored(torch.log_softmax(logits.float(), dim=-1), next_tokens, k)


class Sampler:
    """Turns a step's logits into one token id per row.

    Rows without a generator share the Sampler's default generator (one per device), seeded
    from ``seed`` when given so a whole run can be replayed.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._defaults: dict[torch.device, torch.Generator] = {}

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The shared generator for rows without a seed, created on first use per device."""
        gen = self._defaults.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._defaults[device] = gen
        return gen

    def __call__(self, logits: Tensor, params: Sequence[SamplingParams],
                 prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                 generators: Sequence[torch.Generator | None],
                 masks: tuple[Sequence[int], Any] | None = None) -> list[int]:
        """Sample the next token of every row.

        Args:
            logits: [B, V] last-position logits, any float dtype.
            params: one SamplingParams per row; rows may differ.
            prompt_ids: per row, the prompt token ids (for the repetition penalty).
            output_ids: per row, the tokens generated so far (for all penalties).
            generators: per row, the request's generator (see make_generator) or None.
            masks: (rows, bitmask) from engine.grammar.GrammarCompiler.masks: the constrained
                rows and their allowed tokens, one bit each; None when no row is constrained.

        Returns:
            B token ids.
        """
        if len(generators) != logits.shape[0]:
            raise ValueError(f"expected {logits.shape[0]} generators, got {len(generators)}")
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
        if masks is not None:
            logits = apply_bitmask(logits, *masks)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return logits.argmax(dim=-1).tolist()  # fast path: no softmax, no noise
        default = self.default_generator(logits.device)
        if len(sampled) == len(params):
            probs = logits_to_probs(logits, params)
            return sample_from_probs(probs, generators, default).tolist()
        tokens = logits.argmax(dim=-1)
        idx = torch.tensor(sampled, device=logits.device)
        probs = logits_to_probs(logits[idx], [params[i] for i in sampled])
        tokens[idx] = sample_from_probs(probs, [generators[i] for i in sampled], default)
        return tokens.tolist()
