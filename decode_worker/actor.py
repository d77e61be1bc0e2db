"""Ray actor around DecodeWorker, stepped by engine.step_loop.StepLoop.

Created by the router's pools with ``DecodeActor.options(resources={"decode": 1})`` so the
pool lands on nodes that advertise the ``decode`` resource. In colocated mode the same actor
also prefills (``submit``: a normal request, chunked by the engine's token budget).
"""

from __future__ import annotations

import dataclasses

import ray

from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.step_loop import StepLoop, WorkerOptions, error_record, output_record


@ray.remote
class DecodeActor(StepLoop):
    def __init__(self, config: EngineConfig, options: WorkerOptions = WorkerOptions()) -> None:
        import torch

        from decode_worker.worker import DecodeWorker
        from engine.llm_engine import LLMEngine
        from kvtransfer.base import get_transport
        torch.set_num_threads(options.threads)  # several workers share a node's cores
        if options.metrics is not None and not options.metrics[0]:  # "": this node's address
            options = dataclasses.replace(options, metrics=(ray.util.get_node_ip_address(), options.metrics[1]))
        self.role = "colocated" if options.colocated else "decode"
        self._start(DecodeWorker(LLMEngine(config, progress=False), get_transport(options.transport),
                                 options.lease_s), options)

    def _records(self, step_result) -> list[dict]:
        failed, self.worker.failed = self.worker.failed, {}
        return [output_record(o) for o in step_result] + [error_record(r, m) for r, m in failed.items()]

    def address(self) -> str:
        return self.worker.address

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> bool:
        return self._call(lambda: self.worker.reserve(request_id, prompt_ids, params))

    def first_token(self, request_id: str, token: int) -> None:
        def relay() -> None:
            if request_id in self.worker.engine.scheduler.receiving:  # else aborted meanwhile
                self.outbox.extend(output_record(o) for o in self.worker.first_token(request_id, token))
        self._post(relay, request_id)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Colocated mode: prefill and decode here."""
        self._post(lambda: self.worker.engine.add_request(prompt_ids, params, request_id=request_id), request_id)

    def abort(self, request_id: str) -> None:
        self._post(lambda: self.worker.abort(request_id), request_id)
