"""Ray actor around PrefillWorker, stepped by engine.step_loop.StepLoop.

Created with ``PrefillActor.options(resources={"prefill": 1}).remote(...)``.
"""

from __future__ import annotations

import ray

from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.step_loop import StepLoop


@ray.remote
class PrefillActor(StepLoop):
    def __init__(self, config: EngineConfig, transport: str = "ucx", lease_s: float = 30.0,
                 threads: int = 1) -> None:
        import torch

        from engine.llm_engine import LLMEngine
        from kvtransfer.base import get_transport
        from prefill_worker.worker import PrefillWorker
        torch.set_num_threads(threads)  # several workers share a node's cores
        self._start(PrefillWorker(LLMEngine(config, progress=False), get_transport(transport), lease_s))

    def _outputs(self, step_result):
        return step_result[0]  # (outputs, ended transfers): the worker already freed the latter

    def _busy(self) -> bool:
        return self.worker.engine.scheduler.has_work() or bool(self.worker.transfers)

    def connect(self, decode_address: str) -> None:
        with self.lock:
            self.worker.connect(decode_address)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               decode_address: str) -> None:
        with self.lock:
            self.worker.submit(request_id, prompt_ids, params, decode_address)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.worker.abort(request_id)
