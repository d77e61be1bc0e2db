"""Ray actor around DecodeWorker, stepped by the shared worker runtime (``worker/``).

Created by the router's pools with ``DecodeActor.options(resources={"decode": 1})`` so the
pool lands on nodes that advertise the ``decode`` resource. In colocated mode the same actor
also prefills (``submit``: a normal request, chunked by the engine's token budget). Its calls
are ``DecodeCalls``, which the adaptive worker's actor shares.
"""

from __future__ import annotations

import ray

from decode_worker.worker import DecodeWorker
from engine.request import SamplingParams
from worker.actor import WorkerActor
from worker.protocol import Key, Record, Reservation


class DecodeCalls:
    """The decode side's calls (``DecodeActor``, and ``AdaptiveActor`` that also prefills for
    others), over a worker core with ``reserve``, ``address``, ``failed`` and ``engine``."""

    def _decode_records(self, outputs) -> list[Record | None]:
        failed, self.worker.failed = self.worker.failed, {}
        return [self._tokens(o, o.finished) for o in outputs] + [
            self._failed(rid, error) for rid, error in failed.items()]

    def address(self) -> str:
        return self.worker.address

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
                got = self.worker.reserve(self._admit(key, timeout_s), prompt_ids, params)
            finally:
                if got is None:  # not now, or bad input (raised to the router)
                    self.keys.pop(key.engine_id, None)
            return got
        return self._call(reserve)

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
        if max_uncached is None:
            self._post(lambda: self.worker.engine.add_request(prompt_ids, params,
                                                              request_id=self._admit(key, timeout_s)), key)
            return None

        def submit_if_cached() -> bool:
            rid = self._admit(key, timeout_s)  # (counted either way: the router's reservation waits for it)
            engine, taken = self.worker.engine, False
            try:
                if len(prompt_ids) - engine.cached_prefix_tokens(prompt_ids) <= max_uncached:
                    engine.add_request(prompt_ids, params, request_id=rid)
                    taken = True
            finally:
                if not taken:  # (its deadline entry goes with the key)
                    self.keys.pop(rid, None)
            return taken
        return self._call(submit_if_cached)


@ray.remote
class DecodeActor(DecodeCalls, WorkerActor):
    role = "decode"  # "colocated" when it also prefills

    def _make(self, engine, new_transport, lease_s, options, auth):
        self.role = "colocated" if options.colocated else "decode"
        return DecodeWorker(engine, new_transport(), lease_s, auth)

    def _records(self, step_result) -> list[Record | None]:
        return self._decode_records(step_result)

    def _drop(self, engine_id: str) -> None:
        self.worker.abort(engine_id)
        self.keys.pop(engine_id, None)
