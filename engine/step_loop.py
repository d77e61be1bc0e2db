"""A worker core stepped by a background thread, with one lock for every outside call.

Both worker kinds' Ray actors build on it: the loop keeps stepping (engine and network)
while actor methods (reserve, submit, abort, poll...) run between steps under the same lock.
Outputs leave in per-step batches through :meth:`poll`, never one call per token.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class StepLoop:
    """Drives ``worker.step()`` in a thread. ``worker`` needs ``engine``, ``step``, ``close``.

    Subclasses turn ``step()``'s result into a list of outputs (``_outputs``) and may say when
    there is work beyond the engine's own (``_busy``).
    """

    def _start(self, worker: Any) -> None:
        self.worker = worker
        self.lock = threading.Lock()
        self.outbox: list = []
        self.running = True
        self.loop = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self.loop.start()

    def _outputs(self, step_result: Any) -> list:
        return step_result

    def _busy(self) -> bool:
        return self.worker.engine.scheduler.has_work()

    def _run(self) -> None:
        while self.running:
            with self.lock:
                busy = self._busy()
                self.outbox.extend(self._outputs(self.worker.step()))
            if not busy:
                time.sleep(0.0005)  # idle: keep polling the network, give the core back

    def poll(self) -> list:
        """Outputs since the last call (per-step batches)."""
        with self.lock:
            out, self.outbox = self.outbox, []
        return out

    def status(self) -> dict:
        """KV blocks and queue sizes, for placement and ``GetClusterStatus``."""
        with self.lock:
            bm, sch = self.worker.engine.block_manager, self.worker.engine.scheduler
            return {"kv_blocks_used": bm.num_used_blocks, "kv_blocks_total": bm.num_blocks,
                    "block_size": bm.block_size, "running": len(sch.running), "waiting": len(sch.waiting)}

    def shutdown(self) -> None:
        self.running = False
        self.loop.join(timeout=5)
        self.worker.close()
