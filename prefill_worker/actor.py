"""Ray actor around PrefillWorker, stepped by the shared worker runtime (``worker/``).

Created by the router's pools with ``PrefillActor.options(resources={"prefill": 1})`` so the
pool lands on nodes that advertise the ``prefill`` resource. Its first tokens (``Tokens``
records with finish ``prefilled``) and failed transfers (``Failed`` records) go to the router
in per-step batches over zmq. Its calls are a ``PrefillCalls``, which the adaptive worker's
actor holds too.
"""

from __future__ import annotations

from typing import Any

import ray

from engine import PREFILL_ONEDNN_CACHE_ENTRIES
from engine.config import EngineConfig
from engine.request import SamplingParams
from kvtransfer.base import TransferState
from prefill_worker.worker import PrefillWorker
from worker.actor import WorkerActor, load
from worker.inbox import Inbox
from worker.protocol import Key, Record, Reservation, WorkerOptions
from worker.requests import Requests
from worker.step_loop import StepLoop


class PrefillCalls:
    """The prefill side's calls (``PrefillActor``'s, and ``AdaptiveActor``'s that also
    decodes) and its step-loop hooks (``worker.step_loop.RoleHooks``).

    Args:
        core: a worker core with ``submit``, ``connect``, ``disconnect``, ``transfers``,
            ``abort`` and ``engine`` (``PrefillWorker``, ``AdaptiveWorker``).
        requests: the live requests' table, shared with the step loop.
        inbox: where calls wait for the step loop.
        name: the role.
    """

    def __init__(self, core: Any, requests: Requests, inbox: Inbox, name: str = "prefill") -> None:
        self.core, self.requests, self.inbox, self.name = core, requests, inbox, name

    # ---- the step loop's hooks ---------------------------------------------------------------
    def records(self, step_result: tuple[list, list[tuple[str, TransferState]]]) -> list[Record | None]:
        """First tokens, and the transfers that failed (the core already freed the blocks of
        every transfer that ended).

        A request leaves here when its transfer ends, not when its first token is out: the
        transfer may still fail, and the router must hear of it."""
        outputs, ended = step_result
        records: list[Record | None] = [self.requests.tokens(o, leaves=False) for o in outputs]
        for eid, state in ended:
            if state == TransferState.FAILED:
                records.append(self.requests.failed(eid, "KV transfer to the decode worker failed"))
            else:
                self.requests.forget(eid)
        return records

    def busy(self) -> bool:
        return bool(self.core.transfers)

    def drop(self, engine_id: str) -> None:
        self.core.abort(engine_id)
        if engine_id not in self.core.transfers:  # else it leaves when the transfer ends
            self.requests.forget(engine_id)

    # ---- the router's calls ------------------------------------------------------------------
    def connect(self, decode_address: str) -> None:
        self.inbox.call(lambda: self.core.connect(decode_address))

    def disconnect(self, decode_address: str) -> None:
        """Forget a decode worker that is gone (its transfers fail; its tables go)."""
        self.inbox.call(lambda: self.core.disconnect(decode_address))

    def prefill(self, key: Key, prompt_ids: list[int], params: SamplingParams, decode_address: str,
                reservation: Reservation | None = None, timeout_s: float | None = None) -> None:
        """Prefill and send the KV to ``decode_address`` as the decode worker's ``reserve``
        asked (its ``reservation``: the transfer's secret, the first position it lacks; the
        router hands it over); dropped after ``timeout_s``."""
        self.inbox.post(lambda: self.core.submit(self.requests.admit(key, timeout_s), prompt_ids, params,
                                                 decode_address, reservation), key)


@ray.remote
class PrefillActor(WorkerActor):
    def __init__(self, config: EngineConfig, options: WorkerOptions = WorkerOptions()) -> None:
        # its row counts are prompt lengths: oneDNN's small cache size (engine/__init__.py)
        loaded = load(config, options, "prefill", PREFILL_ONEDNN_CACHE_ENTRIES)
        cpus = set(options.transfer_cpus)
        core = PrefillWorker(loaded.engine, loaded.new_transport(), loaded.lease_s, loaded.auth,
                             transfer_thread=bool(cpus), transfer_cpus=cpus or None)
        requests, inbox = Requests(), Inbox()
        self.calls = PrefillCalls(core, requests, inbox)
        super().__init__(StepLoop(core, self.calls, requests, inbox, loaded.options))

    def connect(self, decode_address: str) -> None:
        self.calls.connect(decode_address)

    def disconnect(self, decode_address: str) -> None:
        self.calls.disconnect(decode_address)

    def prefill(self, key: Key, prompt_ids: list[int], params: SamplingParams, decode_address: str,
                reservation: Reservation | None = None, timeout_s: float | None = None) -> None:
        self.calls.prefill(key, prompt_ids, params, decode_address, reservation, timeout_s)
