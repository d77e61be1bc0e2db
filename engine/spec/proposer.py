"""What every draft source implements: fill draft tokens into a step's speculative requests."""

from __future__ import annotations

from collections.abc import Sequence

from engine.scheduler import ScheduledRequest
from engine.spec.verify import GeneratorFn


class Proposer:
    """A draft source. ``propose`` is called once per step, before the target's forward.

    Each item has ``max_spec_tokens`` of room reserved (blocks and budget); the proposer calls
    ``item.set_draft(tokens, probs)`` with at most that many tokens (fewer, or none, is fine:
    the request then verifies only what it got). ``probs`` ([k, vocab], filtered exactly as the
    target's will be) is needed for sampled requests of a sampling draft; a deterministic
    draft leaves it None.
    """

    name = "base"

    def propose(self, items: Sequence[ScheduledRequest], generator: GeneratorFn) -> None:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """Drop per-request state once the request is finished."""

    def stale_tokens(self, request) -> int:
        """Tokens the draft must catch up on before it can propose for ``request`` (a draft
        with a cache of its own that has not seen them: a new request, or one that was off)."""
        return 0
