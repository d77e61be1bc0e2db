"""Quality of a (quantized) model: sliding-window perplexity and greedy agreement.

Perplexity over a long text uses overlapping windows: window k covers tokens
[k * stride, k * stride + window) and scores only the tokens the previous window did not, so
every token (after the first) is scored exactly once with up to ``window - stride`` tokens of
context before it. ``ppl = exp(mean NLL)``.

Greedy agreement: the full-precision model's greedy continuation of each prompt is the
reference; the quantized model reads the same tokens (teacher forcing) and we count the
positions where its own argmax equals the reference token. 1.0 means it would have generated
exactly the same text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from engine.quant.calib import DATA_DIR, SequenceForward

HELDOUT = {"prose": DATA_DIR / "heldout_prose.txt", "code": DATA_DIR / "heldout_code.py.txt"}

AGREEMENT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 17 times 3?\nA:",
    "Once upon a time, in a small village at the edge of a great forest,",
    "import numpy as np\n\ndef normalize(x):\n",
    "A list of the planets of the solar system, in order from the sun:",
]


def read_text(path: str | Path) -> str:
    """Raises ValueError for a missing or empty file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"text file {str(p)!r} does not exist")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"text file {str(p)!r} is empty")
    return text


@torch.inference_mode()
def perplexity(model: nn.Module, ids: Sequence[int], window: int = 512, stride: int = 256,
               max_tokens: int | None = None, progress: Callable[[int, int], None] | None = None) -> float:
    """Sliding-window perplexity of ``ids`` under ``model``.

    Args:
        window: tokens per forward (context + scored).
        stride: new tokens scored per window (``<= window``).
        max_tokens: score only the first this many tokens.
        progress: called as ``progress(done, total)`` after each window.
    """
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride}, window={window}")
    ids = list(ids)[:max_tokens] if max_tokens else list(ids)
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    fwd = SequenceForward(model)
    nll, n, prev_end = 0.0, 0, 0
    begin = 0
    while prev_end < len(ids):
        end = min(begin + window, len(ids))
        chunk = ids[begin:end]
        s, c = fwd.nll(chunk, score_from=max(1, prev_end - begin))
        nll, n, prev_end = nll + s, n + c, end
        begin += stride
        if progress:
            progress(prev_end, len(ids))
    return math.exp(nll / n)


@torch.inference_mode()
def greedy_agreement(model: nn.Module, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Fraction of reference tokens the model's argmax reproduces, under teacher forcing."""
    fwd = SequenceForward(model)
    hit = tot = 0
    for p, ref in zip(prompts, references):
        if not ref:
            continue
        ids = list(p) + list(ref)
        pred = fwd.logits(ids)[len(p) - 1:-1].argmax(-1)
        hit += int((pred == torch.tensor(list(ref))).sum())
        tot += len(ref)
    return hit / max(tot, 1)
