"""Ray actor around DecodeWorker, stepped by engine.step_loop.StepLoop.

Created by the router with ``DecodeActor.options(resources={"decode": 1}).remote(...)`` so the
pool lands on nodes that advertise the ``decode`` resource.
"""

from __future__ import annotations

import ray

from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.step_loop import StepLoop


@ray.remote
class DecodeActor(StepLoop):
    def __init__(self, config: EngineConfig, transport: str = "ucx", lease_s: float = 30.0,
                 threads: int = 1) -> None:
        import torch

        from decode_worker.worker import DecodeWorker
        from engine.llm_engine import LLMEngine
        from kvtransfer.base import get_transport
        torch.set_num_threads(threads)  # several workers share a node's cores
        self._start(DecodeWorker(LLMEngine(config, progress=False), get_transport(transport), lease_s))

    def address(self) -> str:
        return self.worker.address

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> bool:
        with self.lock:
            return self.worker.reserve(request_id, prompt_ids, params)

    def first_token(self, request_id: str, token: int) -> None:
        with self.lock:
            self.outbox.extend(self.worker.first_token(request_id, token))

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.worker.abort(request_id)
