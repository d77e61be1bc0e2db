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


class TextStream:
    """A request's output text as its tokens arrive: incremental detokenization, stop strings
    (the text ends before the first one; the stop string itself is not returned) and deltas that
    hold back the tail that could still turn into a stop string.

    Used by the engine for every request, and by the router for a request re-run elsewhere
    after a lost worker (the new worker sees the streamed tokens as prompt, so text and stop
    strings across the boundary are the router's to get right).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._detok = IncrementalDetokenizer(tokenizer)
        self.text = ""
        self.stopped = False
        self.emitted = 0  # chars of text already returned as deltas

    def step(self, ids: Sequence[int], final: bool = False, search_from: int | None = None) -> bool:
        """Advance to the output token ids ``ids`` (all of them so far).

        Args:
            final: no more tokens will come: flush any incomplete character.
            search_from: where a stop string may start (default: where the text added by this
                call could first complete one).

        Returns:
            True when a stop string is in the text now (``text`` is cut before it).
        """
        if self.stopped:
            return True
        start = len(self._detok.text)
        self._detok.step(ids, final=final)
        text = self._detok.text
        if self.stop:
            look = max(0, start - max(map(len, self.stop)) + 1) if search_from is None else search_from
            hits = [i for i in (text.find(s, look) for s in self.stop) if i >= 0]
            if hits:
                text, self.stopped = text[:min(hits)], True
        self.text = text
        return self.stopped

    def _sendable(self, done: bool) -> int:
        hold = max(map(len, self.stop)) - 1 if self.stop and not done and not self.stopped else 0
        return len(self.text) - hold

    def delta(self, done: bool) -> str:
        """The text not returned yet; unless ``done``, less the tail a later token could still
        complete into a stop string (text once returned is never taken back)."""
        upto = self._sendable(done)
        out = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out

    def mark_sent(self, chars: int | None = None) -> None:
        """Someone else returned the text so far: ``chars`` of it, or by default what
        ``delta(done=False)`` would have returned."""
        self.emitted = self._sendable(False) if chars is None else chars


def tokens_through_stop(tokenizer, ids: Sequence[int], num_new: int, stop: Sequence[str]) -> int:
    """Of the ``num_new`` newest of ``ids``, how many to keep so that the last one kept is the
    token that completed a stop string (several tokens may arrive at once: speculative verify,
    a batch of streamed tokens)."""
    while num_new > 1:
        text = tokenizer.decode(ids[:len(ids) - 1], skip_special_tokens=True)
        if not any(s in text for s in stop):
            break
        ids = ids[:-1]
        num_new -= 1
    return num_new
