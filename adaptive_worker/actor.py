"""Ray actor around AdaptiveWorker (``mode: adaptive``), stepped by the shared worker runtime.

It answers both sides' calls (``DecodeCalls``: ``reserve``, ``submit`` for a local prefill,
``address``; ``PrefillCalls``: ``prefill`` to another worker, ``connect``, ``disconnect``):
which ones the router makes is its current role, a router-side fact (``router/roles.py``), so
a role switch is no call here at all. Records: a request prefilled for another worker leaves
when its transfer ends (as on a prefill worker), any other when it finishes.
"""

from __future__ import annotations

import ray

from adaptive_worker.worker import AdaptiveWorker
from decode_worker.actor import DecodeCalls
from prefill_worker.actor import PrefillCalls
from worker.actor import WorkerActor
from worker.protocol import Record


@ray.remote
class AdaptiveActor(DecodeCalls, PrefillCalls, WorkerActor):
    role = "adaptive"

    def _make(self, engine, new_transport, lease_s, options, auth):
        cpus = set(options.transfer_cpus)
        return AdaptiveWorker(engine, new_transport(), new_transport(), lease_s, auth, transfer_thread=bool(cpus),
                              transfer_cpus=cpus or None)

    def _records(self, step_result) -> list[Record | None]:
        decoded, prefilled, ended = step_result
        return self._decode_records(decoded) + self._prefill_records(prefilled, ended)
