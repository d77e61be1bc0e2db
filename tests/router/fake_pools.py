"""A pool of workers without Ray, for placement orchestration tests (router.place).

It has the methods the placer calls on router.pools.Pools; each call is recorded in ``calls``
and answered from ``answers[worker id]`` (a value, an exception to raise, or a function of
the worker run during the call: a loss or a drain in the call's round trip), else by default:
submit takes the request, reserve answers a reservation. Every reservation it answered that
was neither prefilled nor aborted is a leak (``leaked``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from router.placement import WorkerLoad
from router.worker_state import Worker
from worker.protocol import Reservation


class FakePools:
    def __init__(self, *workers: tuple[str, str, int]) -> None:
        """``workers``: (worker id, role, free KV blocks of 16 tokens) each."""
        self.workers = {wid: Worker(wid, role, actor=None, state="ready", address=f"kv://{wid}")
                        for wid, role, _ in workers}
        self.free = {wid: free for wid, _, free in workers}
        self.calls: list[tuple] = []
        self.answers: dict[str, list[Any]] = {}
        self.waits = 0
        self.submitted: list[tuple[str, int, list[int], int]] = []  # (request id, attempt, prompt, max_tokens)

    def any_alive(self, *roles: str) -> bool:
        return any(w.state.alive for w in self.workers.values() if w.role in roles)

    def staffed(self, role: str) -> bool:
        return any(w.role == role and w.state.in_pool for w in self.workers.values())

    def loads(self, *roles: str) -> list[WorkerLoad]:
        return [WorkerLoad(w.worker_id, w.role.value, max(0, self.free[w.worker_id]), 64, 16,
                           accepting=w.state.accepting) for w in self.workers.values() if w.role in roles]

    def still_ready(self, w: Worker | None, roles) -> bool:
        return w is not None and w.ready_as(roles)

    def worker(self, worker_id: str) -> Worker:
        return self.workers[worker_id]

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    def reserved(self, worker_id: str, blocks: int, new_call: bool = True, prompt_tokens: int = 0) -> None:
        self.free[worker_id] -= blocks
        self.calls.append(("reserved", worker_id, blocks, prompt_tokens))

    async def _answer(self, what: str, w: Worker, default: Any) -> Any:
        self.calls.append((what, w.worker_id))
        await asyncio.sleep(0)  # (the call's round trip)
        queue = self.answers.get(w.worker_id)
        a = queue.pop(0) if queue else default
        if isinstance(a, BaseException):
            raise a
        return a(w) if callable(a) else a

    async def submit(self, w, key, ids, params, time_left, check) -> Any:
        self.submitted.append((key.request_id, key.attempt, list(ids), params.max_tokens))
        return await self._answer("submit", w, True)

    async def reserve(self, w, key, ids, params, time_left) -> Any:
        got = await self._answer("reserve", w, Reservation(b"s" * 32, 0))
        if isinstance(got, Reservation):
            self.calls.append(("reservation", w.worker_id))
        return got

    def prefill(self, w, key, ids, params, decode_address, reservation, time_left) -> None:
        self.calls.append(("prefill", w.worker_id, decode_address))

    def abort(self, w, key) -> None:
        if w.state.may_hold_blocks:
            self.calls.append(("abort", w.worker_id))

    async def wait_change(self, timeout: float) -> None:
        self.waits += 1
        await asyncio.sleep(min(timeout, 0.001))

    def of(self, what: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == what]

    @property
    def leaked(self) -> int:
        """Reservations answered that no prefill nor abort followed (the remote path's leak check)."""
        return len(self.of("reservation")) - len(self.of("prefill")) - len(self.of("abort"))
