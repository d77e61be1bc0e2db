"""Ray actor around AdaptiveWorker (``mode: adaptive``), stepped by the shared worker runtime.

It answers both sides' calls (a ``DecodeCalls``: ``reserve``, ``submit`` for a local prefill,
``address``; a ``PrefillCalls``: ``prefill`` to another worker, ``connect``, ``disconnect``),
both over the one core, request table and inbox: which ones the router makes is its current
role, a router-side fact (``router/roles.py``), so a role switch is no call here at all.
Records: a request prefilled for another worker leaves when its transfer ends (as on a
prefill worker), any other when it finishes.
"""

from __future__ import annotations

import ray

from adaptive_worker.worker import AdaptiveWorker
from decode_worker.actor import DecodeCalls
from engine.config import EngineConfig
from engine.request import SamplingParams
from prefill_worker.actor import PrefillCalls
from worker.actor import WorkerActor, load
from worker.inbox import Inbox
from worker.protocol import Key, Record, Reservation, WorkerOptions
from worker.requests import Requests
from worker.step_loop import StepLoop


class AdaptiveHooks:
    """The step loop's hooks (``worker.step_loop.RoleHooks``) over both sides' calls."""

    name = "adaptive"

    def __init__(self, decode: DecodeCalls, prefill: PrefillCalls) -> None:
        self.decode, self.prefill = decode, prefill

    def records(self, step_result: tuple) -> list[Record | None]:
        decoded, prefilled, ended = step_result
        return self.decode.records(decoded) + self.prefill.records((prefilled, ended))

    def busy(self) -> bool:
        return self.prefill.busy()

    def drop(self, engine_id: str) -> None:
        # (the core aborts it on whichever side holds it; one sending its KV leaves when the transfer ends)
        self.prefill.drop(engine_id)


@ray.remote
class AdaptiveActor(WorkerActor):
    def __init__(self, config: EngineConfig, options: WorkerOptions = WorkerOptions()) -> None:
        loaded = load(config, options, "adaptive")
        cpus = set(options.transfer_cpus)
        core = AdaptiveWorker(loaded.engine, loaded.new_transport(), loaded.new_transport(), loaded.lease_s,
                              loaded.auth, transfer_thread=bool(cpus), transfer_cpus=cpus or None)
        requests, inbox = Requests(), Inbox()
        self.decode_calls = DecodeCalls(core, requests, inbox, "adaptive")
        self.prefill_calls = PrefillCalls(core, requests, inbox, "adaptive")
        super().__init__(StepLoop(core, AdaptiveHooks(self.decode_calls, self.prefill_calls), requests, inbox,
                                  loaded.options))

    # ---- decode side -------------------------------------------------------------------------
    def address(self) -> str:
        return self.decode_calls.address()

    def reserve(self, key: Key, prompt_ids: list[int], params: SamplingParams,
                timeout_s: float | None = None) -> Reservation | None:
        return self.decode_calls.reserve(key, prompt_ids, params, timeout_s)

    def submit(self, key: Key, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
               max_uncached: int | None = None) -> bool | None:
        return self.decode_calls.submit(key, prompt_ids, params, timeout_s, max_uncached)

    # ---- prefill side ------------------------------------------------------------------------
    def connect(self, decode_address: str) -> None:
        self.prefill_calls.connect(decode_address)

    def disconnect(self, decode_address: str) -> None:
        self.prefill_calls.disconnect(decode_address)

    def prefill(self, key: Key, prompt_ids: list[int], params: SamplingParams, decode_address: str,
                reservation: Reservation | None = None, timeout_s: float | None = None) -> None:
        self.prefill_calls.prefill(key, prompt_ids, params, decode_address, reservation, timeout_s)
