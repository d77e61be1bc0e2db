"""Ray actor around DecodeWorker, stepped by the shared worker runtime (``worker/``).

Created by the router's pools with ``DecodeActor.options(resources={"decode": 1})`` so the
pool lands on nodes that advertise the ``decode`` resource. In colocated mode the same actor
also prefills (``submit``: a normal request, chunked by the engine's token budget). Its calls
are a ``DecodeCalls``, which the adaptive worker's actor holds too.
"""

from __future__ import annotations

from typing import Any

import ray

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.request import SamplingParams
from worker.actor import WorkerActor, load
from worker.inbox import Inbox
from worker.protocol import Key, Record, Reservation, WorkerOptions
from worker.requests import Requests
from worker.step_loop import StepLoop


class DecodeCalls:
    """The decode side's calls (``DecodeActor``'s, and ``AdaptiveActor``'s that also prefills
    for others) and its step-loop hooks (``worker.step_loop.RoleHooks``).

    Args:
        core: a worker core with ``reserve``, ``abort``, ``address``, ``take_failed`` and
            ``engine`` (``DecodeWorker``, ``AdaptiveWorker``).
        requests: the live requests' table, shared with the step loop.
        inbox: where calls wait for the step loop.
        name: the role: "decode", or "colocated" when it also prefills.
    """

    def __init__(self, core: Any, requests: Requests, inbox: Inbox, name: str = "decode") -> None:
        self.core, self.requests, self.inbox, self.name = core, requests, inbox, name

    # ---- the step loop's hooks ---------------------------------------------------------------
    def records(self, outputs: list) -> list[Record | None]:
        """Tokens of the requests decoding here (each leaves when it finishes), and the
        requests whose KV never came."""
        return [self.requests.tokens(o, o.finished) for o in outputs] + [
            self.requests.failed(eid, error) for eid, error in self.core.take_failed().items()]

    def busy(self) -> bool:
        return False  # (all its work is in the engine's queues)

    def drop(self, engine_id: str) -> None:
        self.core.abort(engine_id)
        self.requests.forget(engine_id)

    # ---- the router's calls ------------------------------------------------------------------
    def address(self) -> str:
        return self.core.address

    def reserve(self, key: Key, prompt_ids: list[int], params: SamplingParams,
                timeout_s: float | None = None) -> Reservation | None:
        """Reserve blocks and expect the KV (and first token) from a prefill worker; dropped
        here after ``timeout_s`` (the client's deadline).

        Returns:
            For the prefill worker's ``submit``: the transfer's secret and the first prompt
            position to send (a prefix cached here is not sent); None: not now.
        """
        def reserve() -> Reservation | None:
            got = None
            try:
                got = self.core.reserve(self.requests.admit(key, timeout_s), prompt_ids, params)
            finally:
                if got is None:  # not now, or bad input (raised to the router)
                    self.requests.forget(key.engine_id)
            return got
        return self.inbox.call(reserve)

    def submit(self, key: Key, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
               max_uncached: int | None = None) -> bool | None:
        """Prefill and decode here: colocated mode, or a prompt the router keeps off the prefill
        pool in disaggregated mode (router.local_prefill_tokens).

        Args:
            max_uncached: take it only if at most this many of its tokens are not in this
                worker's prefix cache (the router guessed they were: its index is an estimate).
        Returns:
            None without ``max_uncached`` (queued, answered at once); else whether it was taken.
        """
        engine = self.core.engine
        if max_uncached is None:
            self.inbox.post(lambda: engine.add_request(prompt_ids, params,
                                                       request_id=self.requests.admit(key, timeout_s)), key)
            return None

        def submit_if_cached() -> bool:
            eid = self.requests.admit(key, timeout_s)  # (counted either way: the router's reservation waits for it)
            taken = False
            try:
                if len(prompt_ids) - engine.cached_prefix_tokens(prompt_ids) <= max_uncached:
                    engine.add_request(prompt_ids, params, request_id=eid)
                    taken = True
            finally:
                if not taken:  # (its deadline goes with it)
                    self.requests.forget(eid)
            return taken
        return self.inbox.call(submit_if_cached)


@ray.remote
class DecodeActor(WorkerActor):
    def __init__(self, config: EngineConfig, options: WorkerOptions = WorkerOptions()) -> None:
        # (a colocated worker holds a decode resource: the node's KV budget counts it as one)
        loaded = load(config, options, "decode")
        role = "colocated" if options.colocated else "decode"
        core = DecodeWorker(loaded.engine, loaded.new_transport(), loaded.lease_s, loaded.auth)
        requests, inbox = Requests(), Inbox()
        self.calls = DecodeCalls(core, requests, inbox, role)
        super().__init__(StepLoop(core, self.calls, requests, inbox, loaded.options))

    def address(self) -> str:
        return self.calls.address()

    def reserve(self, key: Key, prompt_ids: list[int], params: SamplingParams,
                timeout_s: float | None = None) -> Reservation | None:
        return self.calls.reserve(key, prompt_ids, params, timeout_s)

    def submit(self, key: Key, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
               max_uncached: int | None = None) -> bool | None:
        return self.calls.submit(key, prompt_ids, params, timeout_s, max_uncached)
