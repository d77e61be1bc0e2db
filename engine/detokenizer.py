"""Incremental detokenization: text deltas per step without re-decoding the whole output.

Decoding only a short window (from ``prefix_offset``) keeps each step O(window), not O(output).
The delta is the difference between decoding the window with and without the newest tokens, so
tokenizers that change a token's text by its neighbours (leading spaces, multi-byte characters
split across tokens) still produce the right text. A window that ends in an incomplete UTF-8
sequence ("\ufffd") emits nothing until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Per-request state; ``step(ids)`` returns the new text since the previous call."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text has been emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        """New text for output tokens ``ids`` (the whole output so far).

        Args:
            ids: all output token ids of the request.
            final: the request has finished: flush whatever is held back.
        """
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.text += delta
        return delta
