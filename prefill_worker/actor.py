"""Ray actor around PrefillWorker, stepped by the shared worker runtime (``worker/``).

Created by the router's pools with ``PrefillActor.options(resources={"prefill": 1})`` so the
pool lands on nodes that advertise the ``prefill`` resource. Its first tokens (``Tokens``
records with finish ``prefilled``) and failed transfers (``Failed`` records) go to the router
in per-step batches over zmq. Its calls are ``PrefillCalls``, which the adaptive worker's
actor shares.
"""

from __future__ import annotations

import ray

from engine import PREFILL_ONEDNN_CACHE_ENTRIES
from engine.request import SamplingParams
from kvtransfer.base import TransferState
from prefill_worker.worker import PrefillWorker
from worker.actor import WorkerActor
from worker.protocol import Key, Record, Reservation


class PrefillCalls:
    """The prefill side's calls (``PrefillActor``, and ``AdaptiveActor`` that also decodes),
    over a worker core with ``submit``, ``connect``, ``sender``, ``transfers`` and ``abort``."""

    def _prefill_records(self, outputs, ended) -> list[Record | None]:
        # (the worker already freed the ended transfers' blocks)
        # A request leaves here when its transfer ends (its blocks are freed then), not when
        # its first token is out: the transfer may still fail, and the router must hear of it.
        records: list[Record | None] = [self._tokens(o, leaves=False) for o in outputs]
        for rid, state in ended:
            if state == TransferState.FAILED:
                records.append(self._failed(rid, "KV transfer to the decode worker failed"))
            else:
                self.keys.pop(rid, None)
        return records

    def _busy(self) -> bool:
        return self.worker.engine.scheduler.has_work() or bool(self.worker.transfers)

    def connect(self, decode_address: str) -> None:
        self._call(lambda: self.worker.connect(decode_address))

    def disconnect(self, decode_address: str) -> None:
        """Forget a decode worker that is gone (its transfers fail; its tables go)."""
        self._call(lambda: self.worker.sender.disconnect(decode_address))

    def prefill(self, key: Key, prompt_ids: list[int], params: SamplingParams, decode_address: str,
                reservation: Reservation | None = None, timeout_s: float | None = None) -> None:
        """Prefill and send the KV to ``decode_address`` as the decode worker's ``reserve``
        asked (its ``reservation``: the transfer's secret, the first position it lacks; the
        router hands it over); dropped after ``timeout_s``."""
        self._post(lambda: self.worker.submit(self._admit(key, timeout_s), prompt_ids, params, decode_address,
                                              reservation), key)

    def _drop(self, engine_id: str) -> None:
        self.worker.abort(engine_id)
        if engine_id not in self.worker.transfers:  # else it leaves when the transfer ends
            self.keys.pop(engine_id, None)


@ray.remote
class PrefillActor(PrefillCalls, WorkerActor):
    role = "prefill"
    onednn_cache_entries = PREFILL_ONEDNN_CACHE_ENTRIES  # its row counts are prompt lengths

    def _make(self, engine, new_transport, lease_s, options, auth):
        cpus = set(options.transfer_cpus)
        return PrefillWorker(engine, new_transport(), lease_s, auth, transfer_thread=bool(cpus),
                             transfer_cpus=cpus or None)

    def _records(self, step_result) -> list[Record | None]:
        return self._prefill_records(*step_result)
