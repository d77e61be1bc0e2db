"""The leak sweep: the last line of "no stranded KV block, ever" (router.server's docstring).

Every ``router.sweep_s`` the router asks each worker which requests hold KV blocks there and
frees those that are no live attempt of its own. A request found stranded by two sweeps in a
row is dropped: once could be a request that ended while the workers answered (its own abort
is on the way); twice cannot. Nothing here is expected to fire: every path that reserves has
its own path that frees; each sweep that frees is logged and counted
(pdserve_router_swept_blocks), so that a missed path shows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pdserve.router")


class Sweeper:
    """Finds and frees KV blocks no live request owns.

    Args:
        pools: router.pools.Pools (its ``held`` and ``release`` calls).
        live: the engine ids of the router's live attempts, read after the workers answer.
        swept: the counter of blocks freed (``RouterMetrics.swept_blocks``).
    """

    def __init__(self, pools: Any, live: Callable[[], set[str]], swept: Any) -> None:
        self.pools, self.live, self.swept = pools, live, swept
        self._before: dict[str, set[str]] = {}  # the last sweep's finds (worker → engine ids)

    async def stranded(self) -> dict[str, dict[str, int]] | None:
        """Per ready worker (by id), the requests that hold KV blocks there (engine id → blocks) but
        are no live attempt of the router's: a leak, that nothing would free but the lease,
        or nothing at all. None if a worker did not answer within 10 s."""
        held = await self.pools.held()
        if held is None:
            return None
        live = self.live()  # read after the answers: a job that started meanwhile is live; one
        # that ended meanwhile may count once (see the proto)
        return {w.worker_id: {eid: b for eid, b in h.items() if eid not in live} for w, h in held}

    async def stranded_blocks(self) -> dict[str, int] | None:
        """Per ready worker, the KV blocks :meth:`stranded` finds (None: no verdict)."""
        found = await self.stranded()
        return None if found is None else {wid: sum(h.values()) for wid, h in found.items()}

    async def sweep(self) -> int:
        """Free the KV blocks found stranded twice in a row (module docstring); returns the blocks freed."""
        found = await self.stranded()
        if found is None:
            return 0
        total = 0
        for wid, held in found.items():
            ids = sorted(set(held) & self._before.get(wid, set()))
            w = self.pools.get(wid)
            if not ids or w is None:
                continue
            try:
                freed = await self.pools.release(w, ids)
            except Exception as e:  # lost meanwhile: its blocks went with it
                log.warning("sweep of %s failed: %r", w.worker_id, e)
                continue
            log.warning("sweep freed %d KV blocks of %d requests no live request owns on %s: %s",
                        freed, len(ids), w.worker_id, ", ".join(ids[:8]))
            self.swept.inc(freed)
            total += freed
        self._before = {wid: set(h) for wid, h in found.items()}
        return total

    async def run(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.sweep()
            except Exception:  # a bug must not end the sweeping for good
                log.exception("sweep failed")
