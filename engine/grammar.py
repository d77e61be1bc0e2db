"""Structured outputs: a grammar per request, applied to the logits as a token mask.

A request's constraint (``SamplingParams.guided``, a :class:`~engine.request.Guided`) is turned
into an llguidance grammar once and compiled against this engine's tokenizer once per distinct
constraint (``GrammarCompiler``, an LRU keyed by the constraint itself: kind + text); each
request gets a copy of the compiled matcher in a :class:`GrammarState`, which it owns.

The matcher follows the request's tokens, never the other way round::

    sync(req)         consume whatever the request has that the matcher has not seen yet:
                      a re-run's earlier output (the last ``resumed`` prompt tokens), the
                      prefill worker's first token (decode side), the tokens of the last step
    fill(bitmask, i)  the allowed next tokens, one bit per token, into row i
    draft_masks(...)  speculative verify: the mask at each of the 1+k positions, the drafts
                      consumed one by one as far as they are valid, then rolled back
    forced(...)       jump-forward (EngineConfig.jump_forward): the tokens the grammar forces
                      next, which the runner appends after the sampled one; the request's next
                      step computes them together (progress is a token count: the scheduler
                      gives it all its uncomputed tokens), one forward instead of one each

Because ``sync`` catches up from the tokens themselves, every path that hands a request its
tokens (chunked prefill's last chunk, the P/D hop, preemption, a re-run after a worker loss)
leaves the matcher where it must be without a hook of its own.

Why llguidance (not xgrammar): no dependencies (xgrammar pulls triton and apache-tvm-ffi),
``validate_tokens`` checks a draft without moving the state and ``rollback(n)`` undoes
consumed tokens, and parser limits bound what a hostile grammar may cost (below). Its mask
costs ~12 us per token at the median on a small JSON schema here (xgrammar ~3 us): both far
under 1% of a CPU decode step.

Limits (bad input is an InvalidRequestError naming the problem, before any state changes):
``MAX_SPEC_CHARS`` characters of constraint text, JSON nesting depth ``MAX_SCHEMA_DEPTH``,
and llguidance's parser limits ``LIMITS`` (grammar size, lexer states and fuel per step).
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import llguidance
import torch
from torch import Tensor

from engine.errors import InvalidRequestError
from engine.models import native

if TYPE_CHECKING:  # (engine.request validates through check(): no import back at run time)
    from engine.request import Guided

log = logging.getLogger(__name__)

MAX_SPEC_CHARS = 64 * 1024  # constraint text (schema JSON, regex, grammar, choices)
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema document
MAX_CHOICES = 1024
CACHE_SIZE = 128  # compiled grammars kept per engine
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# Parser limits: a grammar that needs more is refused when it is compiled, a step that needs
# more ends the matcher (the request then gets only EOS). Bounded compile time and memory.
_LIMIT_ARGS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
                   step_lexer_fuel=200_000, step_max_items=50_000, max_items_in_row=2_000)


def _depth(x: Any, most: int) -> int:
    """Nesting depth of a JSON value, stopping once past ``most`` (a deep bomb costs little)."""
    stack, deepest = [(x, 1)], 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > most:
            return deepest
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
    return deepest


def grammar_text(g: Guided) -> str:
    """The llguidance grammar for a constraint (not yet compiled against a tokenizer).

    Raises:
        InvalidRequestError: unknown kind, too long, not JSON where JSON is needed, too deep.
    """
    LL = llguidance.LLMatcher
    if g.kind not in KINDS:
        raise InvalidRequestError(f"guided kind must be one of {', '.join(KINDS)}; got {g.kind!r}")
    if len(g.spec) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"{g.kind}: the constraint has {len(g.spec)} characters; "
                                  f"the limit is {MAX_SPEC_CHARS}")
    if g.kind == "json_object":
        return LL.grammar_from_json_schema({"type": "object"})
    if g.kind == "regex":
        return LL.grammar_from_regex(g.spec)
    if g.kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", g.spec)  # Lark, or GBNF (llama.cpp's EBNF) converted
        except ValueError as e:
            raise InvalidRequestError(f"grammar: {e}") from None
    try:
        value = json.loads(g.spec)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{g.kind}: not valid JSON ({e})") from None
    if g.kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise InvalidRequestError(f"choice has {len(value)} entries; the limit is {MAX_CHOICES}")
        return LL.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError("json_schema: a JSON schema must be an object (or true/false)")
    if _depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"json_schema: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        # Compact separators: no free whitespace, so the model cannot stall in a run of spaces.
        return LL.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise InvalidRequestError(f"json_schema: {e}") from None


def _limits():
    return llguidance.LLParserLimits(**_LIMIT_ARGS)


@functools.lru_cache(maxsize=1024)
def check(g: Guided) -> None:
    """Validate a constraint without a tokenizer (the router's door, SamplingParams.validate):
    cached, so a popular schema is checked once per process.

    Raises:
        InvalidRequestError: naming the problem (an invalid schema, an uncompilable grammar, a
            bad regex, a grammar past the limits).
    """
    text = grammar_text(g)
    err = llguidance.LLMatcher.validate_grammar(text, None, limits=_limits())
    if err:
        raise InvalidRequestError(f"{g.kind}: {err.strip()[:500]}")


class GrammarState:
    """One request's matcher and how many of its tokens it has consumed."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.consumed = 0  # resumed prompt tokens + output tokens seen
        self.broken = False  # a token the grammar refused: from now on only EOS

    def sync(self, prompt: Sequence[int], output: Sequence[int], resumed: int) -> None:
        """Catch up with the request's tokens (see the module doc); roll back if it has fewer."""
        total = resumed + len(output)
        m = self.matcher
        if total < self.consumed:
            m.rollback(self.consumed - total)
            self.consumed = total
        base = len(prompt) - resumed
        while self.consumed < total and not self.broken:
            i = self.consumed
            tok = prompt[base + i] if i < resumed else output[i - resumed]
            if m.is_stopped():  # the grammar is complete; an EOS (or anything) after it is not its business
                self.consumed = total
                break
            if not m.consume_token(tok):
                log.warning("grammar refused token %d: %s", tok, m.get_error())
                self.broken = True
            self.consumed += 1

    def forced(self, prompt: Sequence[int], output: Sequence[int], resumed: int, limit: int) -> list[int]:
        """Jump-forward: the tokens the grammar allows no alternative to after the request's
        tokens (``sync``'s arguments), at most ``limit``; [] when none is, or the grammar is
        done or broken. Not consumed here: the next ``sync`` consumes them with the request's
        other tokens."""
        self.sync(prompt, output, resumed)
        m = self.matcher
        if limit <= 0 or self.broken or m.is_error() or m.is_stopped():
            return []
        return list(m.compute_ff_tokens())[:limit]

    def fill(self, bitmask: np.ndarray, row: int, eos: Sequence[int]) -> None:
        """The allowed next tokens into ``bitmask[row]``; only EOS once broken or stopped."""
        m = self.matcher
        if self.broken or m.is_error():
            _only(bitmask, row, eos)
            return
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)
        if not v.any():  # nothing allowed (a limit hit mid-step): end the request cleanly
            _only(bitmask, row, eos)

    def draft_masks(self, drafts: Sequence[int], bitmask: np.ndarray, row: int, eos: Sequence[int]) -> int:
        """Masks for a verify step's 1 + k positions into ``bitmask[row:row + k + 1]``: position j
        is the state after the first j drafts. Drafts the grammar refuses are never consumed
        (the masked target rejects them there); the matcher is rolled back before returning.

        Returns:
            How many leading drafts the grammar accepts.
        """
        m = self.matcher
        ok = 0 if self.broken or m.is_error() or m.is_stopped() else m.validate_tokens(list(drafts))
        for j in range(len(drafts) + 1):
            if j <= ok:
                self.fill(bitmask, row + j, eos)
                if j < ok:
                    m.consume_token(drafts[j])
            else:  # past a refused draft: never reached (acceptance stops there); keep it finite
                bitmask[row + j] = bitmask[row + ok]
        if ok:
            m.rollback(ok)
        return ok


def _only(bitmask: np.ndarray, row: int, tokens: Sequence[int]) -> None:
    bitmask[row] = 0
    for t in tokens:
        if t // 32 < bitmask.shape[1]:
            bitmask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))


def new_bitmask(rows: int, vocab: int) -> np.ndarray:
    return np.zeros((rows, (vocab + 31) // 32), dtype=np.int32)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: Tensor, rows: Sequence[int], bitmask: np.ndarray) -> Tensor:
    """``logits`` with the tokens a row's bitmask forbids at -inf, for the listed rows only;
    other rows are untouched (the same values, not recomputed). Returns a new tensor.

    On the native library where it is built (engine/models/native.py: x86-64 with a compiler):
    one pass over each mask, whole words at a time (native_decode.c pd_mask_logits): 0.23-0.55 ms
    for 4 constrained rows of a 151,936-token vocabulary, where torch over the bits expanded (the
    fallback) took 1.7-14 ms (real JSON-schema masks, 2026-12-06)."""
    lib = native.library()
    if (lib is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and bitmask.shape[1] * 32 >= logits.shape[1]):
        out = logits.contiguous().clone()
        bits = np.ascontiguousarray(bitmask, dtype=np.int32)
        idx = np.asarray(rows, dtype=np.int64)
        lib.pd_mask_logits(out.data_ptr(), out.shape[1], idx.ctypes.data, len(idx), bits.ctypes.data,
                           bits.shape[1], out.shape[1])
        return out
    return apply_bitmask_torch(logits, rows, bitmask)


def apply_bitmask_torch(logits: Tensor, rows: Sequence[int], bitmask: np.ndarray) -> Tensor:
    """``apply_bitmask`` in torch ops (any device or dtype; where the native library is not)."""
    vocab = logits.shape[1]
    bits = torch.from_numpy(bitmask)
    allowed = ((bits.unsqueeze(-1) >> _BITS) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out


class GrammarCompiler:
    """Compiles constraints against one tokenizer; one per engine. The tokenizer view is built
    on first use (~0.4 s for a 49k vocabulary), so an engine that never sees a constraint pays
    nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos = tuple(eos_token_ids)
        self._ll = None
        self._cache: OrderedDict[Guided, Any] = OrderedDict()

    def _tokenizer(self) -> Any:
        if self._ll is None:
            import llguidance.hf  # heavy: it imports transformers; only once a guided request compiles
            n = len(self._hf)
            self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=max(n, self.vocab_size),
                                                    eos_token=list(self.eos) or None)
        return self._ll

    def state(self, g: Guided) -> GrammarState:
        """A fresh matcher for one request (a copy of the cached compiled one).

        Raises:
            InvalidRequestError: the constraint does not compile for this tokenizer.
        """
        base = self._cache.get(g)
        if base is None:
            base = llguidance.LLMatcher(self._tokenizer(), grammar_text(g), log_level=0, limits=_limits())
            if base.is_error():
                raise InvalidRequestError(f"{g.kind}: {base.get_error().strip()[:500]}")
            self._cache[g] = base
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(g)
        return GrammarState(base.deep_copy())

    def masks(self, reqs: Sequence[Any]) -> tuple[list[int], np.ndarray] | None:
        """Rows of ``reqs`` that carry a grammar and their bitmasks; None when none does (the
        unconstrained batch: one attribute test per row, nothing else)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        bm = new_bitmask(len(rows), self._tokenizer().vocab_size)
        for j, i in enumerate(rows):
            r = reqs[i]
            r.grammar.sync(r.prompt_token_ids, r.output_token_ids, r.sampling_params.resumed)
            r.grammar.fill(bm, j, self.eos)
        return rows, bm

    def draft_masks(self, items: Sequence[Any]) -> tuple[list[int], np.ndarray] | None:
        """A verify step's masks: for each scheduled request (``ScheduledRequest``) with a
        grammar, one row per position (1 + its drafts), in the order of the verify logits (item
        i's 1 + k_i rows together). Returns (logit rows, bitmask) or None when none has one."""
        if not any(s.request.grammar is not None for s in items):
            return None
        rows: list[int] = []
        spans = []
        row = 0
        for s in items:
            n = len(s.spec_token_ids) + 1
            if s.request.grammar is not None:
                spans.append((s, len(rows)))
                rows.extend(range(row, row + n))
            row += n
        bm = new_bitmask(len(rows), self._tokenizer().vocab_size)
        for s, at in spans:
            r = s.request
            r.grammar.sync(r.prompt_token_ids, r.output_token_ids, r.sampling_params.resumed)
            r.grammar.draft_masks(s.spec_token_ids, bm, at, self.eos)
        return rows, bm
