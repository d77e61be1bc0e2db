"""Which prompt prefixes each worker holds, as the router estimates them (prefix-aware placement).

Why the router keeps it rather than the workers publishing their caches: every prompt a
worker prefills was placed there by this router, so it already knows what each worker
computed; no new worker→router message, nothing to order against the reports, and a
restarted router starts blind and learns again. It is an estimate: a worker evicts cached
blocks under memory pressure that the router does not see. Being wrong costs a miss (the
worker computes the prompt, as it would have without the index), never a wrong answer:
the worker's own prefix cache decides what is reused.

The unit is the worker's: a full block of ``block_size`` prompt tokens, named by a chained
hash (block i's hash covers tokens 0..(i+1)*block_size, as the engine's prefix cache names
blocks), so a hit is always a *leading* run of blocks. Per worker the index keeps at most
its KV capacity in blocks, least recently placed evicted first (the engine's cache also
evicts least recently used blocks first).

Tables (exactly these): ``_held`` worker id → its block hashes in recency order (an
``OrderedDict`` used as an LRU set).

An entry is made only once a placement succeeded (the worker took the call): a reservation
refused, timed out or cut short by a lost worker leaves no phantom prefix that later prompts
would be drawn to. It is corrected by what the workers say: a local prefill refused because
the worker does not hold the prefix (``cache_miss``) removes the prompt's blocks there
(``discard``), and a prefill that found fewer cached tokens than the index expected shows the
worker evicted blocks the index still lists: as many of its least recent entries go
(``evicted``; the engine evicts least recently used blocks first).

:func:`prefix_view` turns it, with what the live requests hold (router.holdings), into what
placement scores a prompt by (``placement.PrefixView``); :func:`expect_prefix` is what a
placement expects to find cached.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from router.holdings import Holdings
from router.jobs import Job
from router.placement import PrefixView, WorkerLoad


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a partial last block is never shared)."""
    out, h = [], 0
    for i in range(len(token_ids) // block_size):
        # Tuples of ints hash the same in every process (no PYTHONHASHSEED salt): reproducible.
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class PrefixIndex:
    """Estimated cached prompt blocks per worker (module doc)."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[int, None]] = {}

    def hit_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its ``block_hashes``) the worker likely holds."""
        held = self._held.get(worker_id)
        n = 0
        if held:
            for h in hashes:
                if h not in held:
                    break
                n += 1
        return n

    def record(self, worker_id: str, hashes: Sequence[int], capacity_blocks: int) -> None:
        """The worker was given this prompt: it will hold these blocks (most recent now);
        beyond ``capacity_blocks`` the least recently placed are forgotten."""
        held = self._held.setdefault(worker_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(0, capacity_blocks):
            held.popitem(last=False)

    def discard(self, worker_id: str, hashes: Sequence[int]) -> None:
        """The worker does not hold these blocks after all (it said so: a ``cache_miss``)."""
        held = self._held.get(worker_id)
        for h in hashes if held else ():
            held.pop(h, None)

    def evicted(self, worker_id: str, blocks: int, keep: Sequence[int] = ()) -> None:
        """The worker evicted at least ``blocks`` blocks the index lists: its ``blocks`` least
        recently placed entries go (but not ``keep``: the prompt it just took)."""
        held, keep = self._held.get(worker_id), set(keep)
        for h in [h for h in held if h not in keep][:max(0, blocks)] if held else ():
            del held[h]

    def forget(self, worker_id: str) -> None:
        """The worker lost its cache (restarted, lost, retired, or switched roles)."""
        self._held.pop(worker_id, None)

    def prune(self, worker_ids: set[str]) -> None:
        """Forget every worker not in ``worker_ids`` (retired: the table follows the pools)."""
        for wid in [w for w in self._held if w not in worker_ids]:
            del self._held[wid]

    def size(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))


def prefix_view(index: PrefixIndex, live: Holdings, loads: list[WorkerLoad], hashes: list[int],
                prompt_tokens: int, block_size: int) -> tuple[list[WorkerLoad], PrefixView]:
    """What prefix-aware placement knows of one prompt: (loads whose queued prompt tokens are
    the uncached tokens the router placed there that wait for their first token, the view).
    O(workers x log(prompt blocks) + prompt blocks): ``live`` keeps what the live requests
    hold as they change (router.holdings), no request is walked here.

    Why not the workers' reported queues: they count whole prompts (a waiting prompt has not
    looked its prefix up yet), so a worker holding a prefix would look busy with the very
    prompts its cache makes cheap, and they lag a report behind a burst.
    """
    # The engine looks up at most the blocks before the prompt's last token (it computes that
    # one to sample from): a prompt of whole blocks finds one block less.
    most = (prompt_tokens - 1) // block_size
    in_use = {wid: n * block_size for wid, n in live.in_use(hashes, most).items()}
    view = PrefixView(
        cached={w.worker_id: min(most, index.hit_blocks(w.worker_id, hashes)) * block_size for w in loads},
        held={w.worker_id: index.size(w.worker_id) for w in loads}, in_use=in_use)
    # (a copy only where the queue differs: this runs for every worker on every placement try)
    return [w if w.queued_prompt_tokens == (q := live.queued(w.worker_id))
            else dataclasses.replace(w, queued_prompt_tokens=q) for w in loads], view


def expect_prefix(index: PrefixIndex, job: Job, w: WorkerLoad, hashes: list[int], prompt_tokens: int,
                  block_size: int) -> int:
    """The job's prompt is about to go to ``w`` to prefill: the prompt tokens it likely finds
    cached there (kept on the job, with its hashes, for router.holdings). Nothing is recorded
    yet: ``index.record`` once the placement succeeded (module doc)."""
    hit = min((prompt_tokens - 1) // block_size, index.hit_blocks(w.worker_id, hashes)) * block_size
    job.uncached, job.prefix_hashes = prompt_tokens - hit, hashes
    return hit


def prefilled(index: PrefixIndex, worker_id: str, hashes: Sequence[int], expected: int, cached: int,
              block_size: int) -> None:
    """A prefill on ``worker_id`` found ``cached`` prompt tokens in its cache where the index
    expected ``expected``: fewer means the worker evicted blocks the index lists (module doc).
    More (blocks the index did not know of, e.g. a restarted router's) needs nothing: the
    prompt's blocks are recorded with the placement."""
    if cached < expected:
        index.evicted(worker_id, (expected - cached) // block_size, keep=hashes)
