"""What the live requests hold on each worker, kept as they change (prefix-aware placement).

Placement scores a prompt by two facts of the live requests (router.prefix_index
``prefix_view``): per worker, the uncached prompt tokens still waiting there for their first
token (its prefill queue as the router placed it), and how many of the prompt's leading
blocks live requests there hold (shared, not allocated again). Walking every live request for
them on every try made a placement cost O(live requests), and queued requests retry every
0.1 s: quadratic work on the event loop under overload (issue 44, bug 6). Here they are kept
up to date instead, as each request changes (``update``: placed, first token, re-run; ``drop``:
ended), so one placement reads them in O(workers x log(prompt blocks) + prompt blocks): one
lookup per worker, by bisection over the prompt's blocks (``in_use``).

A request counts (exactly as it did when each try walked them):

- while prefilling (placed, no token of this attempt yet): its estimated uncached prompt tokens
  in its prefill worker's queue;
- while placed (``RUNNING``) with a prompt hashed: its prompt's blocks on its prefill worker,
  and on its decode worker once that has the KV (after the first token).

Tables (exactly these): ``_queued`` worker id → prompt tokens; ``_blocks`` worker id → block
hash → requests holding it; ``_counted`` request → what it was counted as (undone on a change).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from router.jobs import JobState


class Counted(NamedTuple):
    """One request's part in the tables, as last counted."""

    prefill_id: str  # its queue entry is here ("": none)
    queued: int
    holders: tuple[str, ...]  # workers holding its prompt's blocks
    hashes: tuple[int, ...]


NOTHING = Counted("", 0, (), ())


def counted_as(job: Any) -> Counted:
    """What ``job`` (a router.jobs.Job, or anything with its fields) counts as now (module doc)."""
    if job.state is not JobState.RUNNING:
        return NOTHING
    prefilling = job.prefilling
    holders: tuple[str, ...] = ()
    if job.prefix_hashes:
        # (a decode worker shares the prefix too, once it has the KV: after the first token)
        holders = tuple(w for w in dict.fromkeys((job.prefill_id, "" if prefilling else job.decode_id)) if w)
    return Counted(job.prefill_id if prefilling else "", job.uncached if prefilling else 0, holders,
                   tuple(job.prefix_hashes) if holders else ())


class Holdings:
    """The live requests' queues and held blocks per worker (module doc)."""

    def __init__(self) -> None:
        self._queued: collections.Counter[str] = collections.Counter()
        self._blocks: dict[str, collections.Counter[int]] = {}
        # id(job) → (the job, its part): the reference keeps the id the job's until it is dropped
        self._counted: dict[int, tuple[Any, Counted]] = {}

    @classmethod
    def of(cls, jobs: Iterable[Any]) -> Holdings:
        """The holdings of these jobs as they are now (tests, a fresh view)."""
        h = cls()
        for j in jobs:
            h.update(j)
        return h

    def update(self, job: Any) -> None:
        """``job`` may have changed (placed, first token, re-run, ended): count it as it is now."""
        new = counted_as(job)
        old = self._counted.get(id(job), (job, NOTHING))[1]
        if new == old:
            return
        self._apply(old, -1)
        self._apply(new, +1)
        if new == NOTHING:
            self._counted.pop(id(job), None)
        else:
            self._counted[id(job)] = (job, new)

    def drop(self, job: Any) -> None:
        """``job`` ended (or left the router): it holds nothing any more."""
        self._apply(self._counted.pop(id(job), (job, NOTHING))[1], -1)

    def _apply(self, c: Counted, sign: int) -> None:
        if c.prefill_id:
            self._queued[c.prefill_id] += sign * c.queued
            if not self._queued[c.prefill_id]:
                del self._queued[c.prefill_id]
        for wid in c.holders:
            blocks = self._blocks.setdefault(wid, collections.Counter())
            for h in c.hashes:
                blocks[h] += sign
                if not blocks[h]:
                    del blocks[h]
            if not blocks:
                del self._blocks[wid]

    def queued(self, worker_id: str) -> int:
        """Uncached prompt tokens placed on ``worker_id`` that wait for their first token."""
        return self._queued.get(worker_id, 0)

    def in_use(self, hashes: Sequence[int], most: int) -> dict[str, int]:
        """Per worker, how many of the prompt's leading blocks (at most ``most``) live requests
        there hold; workers holding none are left out.

        Block hashes are chained (block i's names every token before it), so a request holding
        block i holds blocks 0..i-1 too: what a worker holds of the prompt is a leading run, and
        its length is found by bisection over the prompt's blocks.
        """
        hashes, out = hashes[:max(0, most)], {}
        for wid, blocks in self._blocks.items():
            lo, hi = 0, len(hashes)  # blocks[:lo] held, blocks[hi:] not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in blocks:
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                out[wid] = lo
        return out

    def __len__(self) -> int:
        """Requests counted (placed and live)."""
        return len(self._counted)
