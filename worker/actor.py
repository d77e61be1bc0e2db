"""What every worker actor shares: load the engine and make the KV transports (``load``), and
answer the calls every role answers (``WorkerActor``, over the actor's ``StepLoop``).

An actor class wires its parts with explicit arguments, each built once::

    loaded = load(config, options, role)                 # this process set up, the engine up
    core = DecodeWorker(loaded.engine, loaded.new_transport(), ...)
    requests, inbox = Requests(), Inbox()                # shared by the role's calls and the loop
    calls = DecodeCalls(core, requests, inbox, role)     # the role's calls and the loop's hooks
    StepLoop(core, calls, requests, inbox, loaded.options)

Ray-specific setup lives here once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch

from engine import ONEDNN_CACHE_ENTRIES, bound_onednn_caches
from engine.config import EngineConfig
from engine.kv_budget import estimate_weights_bytes, host_workers, kv_budget, node_available_bytes
from engine.llm_engine import LLMEngine
from engine.models.loader import resolve_model_path
from kvtransfer.auth import PlaneAuth
from kvtransfer.base import LEASE_S, FrameTransport, get_transport
from worker.fence import Adopted
from worker.protocol import Key, ModelInfo, Record, RouterLink, WorkerOptions, WorkerStatus
from worker.step_loop import StepLoop


@dataclass(frozen=True)
class Loaded:
    """What a worker core is built from (``load``)."""

    engine: LLMEngine
    new_transport: Callable[[], FrameTransport]  # a new KV transport: one per sender or receiver
    lease_s: float  # the KV transfer lease
    auth: PlaneAuth | None  # the KV plane's keys (None: trust the network)
    options: WorkerOptions  # as given, with this node's address for /metrics filled in


def load(config: EngineConfig, options: WorkerOptions, role: str,
         onednn_cache_entries: int = ONEDNN_CACHE_ENTRIES) -> Loaded:
    """Set up this process for a ``role`` worker and load its engine.

    Args:
        onednn_cache_entries: oneDNN's per-shape caches (engine/__init__.py): the role's size,
            set before the engine makes its first primitive.
    """
    bound_onednn_caches(onednn_cache_entries)
    torch.set_num_threads(options.threads)  # several workers share a node's cores
    if options.transfer_cpus:  # the KV transfer's cores: the forward keeps off them
        _pin_forward(set(options.transfer_cpus))
    if options.metrics is not None and not options.metrics[0]:  # "": this node's address
        options = dataclasses.replace(options, metrics=(ray.util.get_node_ip_address(), options.metrics[1]))
    if options.resolve_model:
        config = dataclasses.replace(config, model=str(resolve_model_path(options.model, progress=False)))
    if options.kv_cache_auto:  # this node's memory, before this worker's load takes any of it
        config = _auto_kv_cache(config, role)
    lease_s = LEASE_S if options.lease_s is None else options.lease_s
    auth = PlaneAuth(options.key, options.kv_integrity) if options.key else None
    # KV endpoints listen on this node's address: peers on other nodes reach them there.
    where = {"host": ray.util.get_node_ip_address()} if options.transport == "zmq" else {}
    if options.transfer_cpus and options.transport == "ucx":  # its progress thread copies every message
        where = {"progress_cpus": set(options.transfer_cpus)}
    if options.key and options.transport == "ucx":  # sealed headers: strangers make it allocate nothing
        where = {**where, "key": options.key}
    return Loaded(LLMEngine(config, progress=False), lambda: get_transport(options.transport, **where), lease_s,
                  auth, options)


class WorkerActor:
    """The calls every worker answers, forwarded to its step loop. Each actor class
    (``PrefillActor``, ``DecodeActor``, ``AdaptiveActor``, each wrapped by ``ray.remote``)
    wires a core, its role's calls object and the loop together, and adds the role's calls."""

    # Not callable through ``call``: they are the fence's own entries.
    _UNFENCED = frozenset({"call", "adopt"})

    def __init__(self, loop: StepLoop) -> None:
        self.loop = loop

    # ---- HA (worker.fence): the routers of an HA cluster reach every other call through these --
    def call(self, epoch: int, method: str, *args, **kwargs):
        """``method(*args, **kwargs)`` for the router of ``epoch``: the one place a worker checks
        who calls (worker.fence.Fence.admit; FencedError if it may not)."""
        if method.startswith("_") or method in self._UNFENCED:
            raise ValueError(f"no such call: {method}")
        if self.loop.fence is None:
            raise ValueError("this worker has no fence (ha.enabled was off when it was made)")
        self.loop.fence.admit(epoch)
        return getattr(self, method)(*args, **kwargs)

    def adopt(self, epoch: int, link: RouterLink, grace_s: float | None = None) -> Adopted:
        """A router of ``epoch`` (>= the one followed) takes this worker over (StepLoop.adopt)."""
        return self.loop.adopt(epoch, link, grace_s)

    def ping(self) -> None:
        """Nothing: through ``call``, it tells the fence the router is alive (router.liveness)."""

    def abort(self, key: Key) -> None:
        self.loop.abort(key)

    def release(self, engine_ids: list[str]) -> int:
        return self.loop.release(engine_ids)

    def poll(self) -> list[Record]:
        return self.loop.poll()

    def status(self) -> WorkerStatus:
        return self.loop.status()

    def inject(self, kind: str) -> None:
        self.loop.inject(kind)

    def held(self) -> dict[str, int]:
        return self.loop.held()

    def model_info(self) -> ModelInfo:
        return self.loop.model_info()

    def shutdown(self) -> None:
        self.loop.shutdown()


def _auto_kv_cache(config: EngineConfig, role: str) -> EngineConfig:
    """``config`` with the KV cache ``kv_cache_gb: auto`` gives a ``role`` worker on this node
    (engine/kv_budget.py); the workers the node hosts are those its ``prefill``/``decode``
    resources admit (the most it can hold), summed over every Ray node of this machine (several
    Ray nodes on one host, as in deploy/onprem-loopback.yaml, share its memory: each counting
    only its own workers would promise the same memory twice). Raises KVBudgetError when
    nothing is left."""
    counts = host_workers(ray.nodes(), ray.get_runtime_context().get_node_id())
    if role == "adaptive":  # every worker here runs the same engine in either role
        workers = {"adaptive": max(1, sum(counts.values()))}
    else:
        counts[role] = max(1, counts.get(role, 0))
        workers = {r: n for r, n in counts.items() if n}
    budget = kv_budget(node_available_bytes(), estimate_weights_bytes(config.model, config.dtype, config.dequantize),
                       role, workers)
    print(f"pdserve worker ({role}, node hosts {workers}): {budget.describe()}", file=sys.stderr, flush=True)
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, memory_gb=budget.kv_cache_gib))


def _pin_forward(transfer_cpus: set[int]) -> None:
    """Run this thread, and every thread it starts from now on (torch's, the step loop), on
    the process's cores but ``transfer_cpus``. Raises ValueError naming the cores when that
    leaves none, or names a core the process cannot use."""
    have = os.sched_getaffinity(0)
    if not transfer_cpus <= have or not have - transfer_cpus:
        raise ValueError(f"prefill.transfer_cpus {sorted(transfer_cpus)}: this worker may use cores "
                         f"{sorted(have)}; the transfer's must be among them and leave the forward at least one")
    os.sched_setaffinity(0, have - transfer_cpus)
