"""N-gram prompt lookup: propose what followed the last n tokens earlier in the sequence.

No model: the draft is the continuation of the most recent earlier occurrence of the
sequence's last n tokens (prompt and output alike), trying n from ``ngram_max`` down to
``ngram_min``. Strong on text that repeats its input (editing, summarising, code changes),
silent otherwise (no match, no draft, no cost but the lookup).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.scheduler import ScheduledRequest
from engine.spec.proposer import Proposer
from engine.spec.verify import GeneratorFn


def ngram_lookup(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the last n tokens.

    Args:
        tokens: the whole sequence so far.
        k: most tokens to propose.
        n_max, n_min: longest and shortest suffix to match (longest first).
    Returns:
        The proposal, possibly empty.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # Windows that start before the suffix itself and have at least one token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, items: Sequence[ScheduledRequest], generator: GeneratorFn) -> None:
        for s in items:
            s.set_draft(ngram_lookup(s.request.all_token_ids, s.max_spec_tokens, self.n_max, self.n_min))
