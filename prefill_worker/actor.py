"""Ray actor around PrefillWorker, stepped by engine.step_loop.StepLoop.

Created by the router's pools with ``PrefillActor.options(resources={"prefill": 1})`` so the
pool lands on nodes that advertise the ``prefill`` resource. Its first tokens (records with
finish ``prefilled``) and failed transfers (``error`` records) go to the router in per-step
batches over zmq.
"""

from __future__ import annotations

import dataclasses

import ray

from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.step_loop import StepLoop, WorkerOptions, error_record, output_record


@ray.remote
class PrefillActor(StepLoop):
    role = "prefill"

    def __init__(self, config: EngineConfig, options: WorkerOptions = WorkerOptions()) -> None:
        import torch

        from engine.llm_engine import LLMEngine
        from kvtransfer.base import TransferState, get_transport
        from prefill_worker.worker import PrefillWorker
        torch.set_num_threads(options.threads)  # several workers share a node's cores
        if options.metrics is not None and not options.metrics[0]:  # "": this node's address
            options = dataclasses.replace(options, metrics=(ray.util.get_node_ip_address(), options.metrics[1]))
        self._failed = TransferState.FAILED
        self._start(PrefillWorker(LLMEngine(config, progress=False), get_transport(options.transport),
                                  options.lease_s), options)

    def _records(self, step_result) -> list[dict]:
        outputs, ended = step_result  # the worker already freed the ended transfers' blocks
        return [output_record(o) for o in outputs] + [
            error_record(rid, "KV transfer to the decode worker failed")
            for rid, state in ended if state == self._failed]

    def _busy(self) -> bool:
        return self.worker.engine.scheduler.has_work() or bool(self.worker.transfers)

    def connect(self, decode_address: str) -> None:
        self._call(lambda: self.worker.connect(decode_address))

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               decode_address: str) -> None:
        self._post(lambda: self.worker.submit(request_id, prompt_ids, params, decode_address), request_id)

    def abort(self, request_id: str) -> None:
        self._post(lambda: self.worker.abort(request_id), request_id)
