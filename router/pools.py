"""Worker pools: the router's view of every prefill and decode actor, and their output stream.

Lifecycle of a worker here (``Worker.state``)::

    starting (actor created, model loading) ──up──► ready ──lost──► dead ──up again──► ready
                                                      │      (Ray restarts the actor; a fresh incarnation)
                                                      └──drain──► draining ──holds nothing──► retired (removed)
    Ray cannot bring it back (restarts exhausted, node gone), or lost while draining: gone.

``up`` means: its model info answered (same model as the others) and, for a decode worker,
every ready prefill worker has connected to its KV receiver (a prefill worker coming up
connects to every ready decode worker). ``lost`` is any of: Ray reports the actor RESTARTING
or DEAD after its heartbeat went quiet, a heartbeat arrives from a new incarnation, a call
to it failed with a Ray actor error, or it *stalled*: no report for ``router.stall_s`` while
Ray still says ALIVE (stopped, stuck in a kernel, swapping), or a call to it unanswered that
long (every call has that deadline), and then the router also kills the process so that Ray
starts a fresh one. A lost decode worker's KV address is forgotten by every prefill worker. The router re-runs that worker's requests elsewhere
(``on_lost``) and this module brings the restarted actor back.

Every worker pushes a ``worker.protocol.Report`` (its records and status) over zmq after each
step with outputs and at least every 50 ms (worker.step_loop); one PULL socket here receives
them all, and a message that does not decode as a Report is dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvtransfer.auth import new_secret
from router.config import ClusterConfig
from router.placement import WorkerLoad
from worker.protocol import MAX_REPORT_BYTES, Failed, ModelInfo, ProtocolError, Record, WorkerStatus, decode_report
from worker.step_loop import RouterLink, WorkerOptions

log = logging.getLogger("pdserve.router")

HEALTH_PERIOD_S = 0.25
QUIET_S = 1.0  # a heartbeat older than this makes the router ask Ray whether the actor lives
LOAD_TIMEOUT_S = 1800.0  # a worker whose model has not loaded in this long is stuck: replaced
MAX_GONE = 16  # workers Ray cannot bring back, kept for `pdserve status`; older ones are forgotten


@dataclass
class Worker:
    """One actor as the router sees it."""

    worker_id: str
    role: str  # prefill, decode or colocated
    actor: Any
    state: str = "starting"  # starting, ready, draining, dead, gone (module docstring)
    incarnation: str | None = None
    address: str | None = None  # decode and colocated: the KV receiver's address
    status: WorkerStatus | None = None  # its latest report's; None until one arrives
    last_seen: float = field(default_factory=time.monotonic)
    # Blocks the router promised this worker that its reports do not show yet: (the call's
    # number, blocks). A report drops those its status has admitted (``WorkerStatus.admitted``):
    # a report sent before the worker took a call must not erase that call's reservation.
    pending: list[tuple[int, int]] = field(default_factory=list)
    calls: int = 0  # admitting calls (reserve, submit) made to its current incarnation
    restarts: int = 0
    info: ModelInfo | None = None  # model_info() of its current incarnation
    seq: int = 0  # the latest report's Report.seq from its current incarnation (older: a replay)

    @property
    def reserved_blocks(self) -> int:
        return sum(b for _, b in self.pending)

    def reported(self, status: WorkerStatus | None) -> None:
        """A new status (None: none yet, a new incarnation); reservations it shows are dropped."""
        self.status = status
        if status is None:
            self.pending, self.calls = [], 0
        else:
            self.calls = max(self.calls, status.admitted)
            self.pending = [(n, b) for n, b in self.pending if n > status.admitted]

    def load(self) -> WorkerLoad:
        s = self.status
        if s is None:
            return WorkerLoad(self.worker_id, self.role, 0, 0, 16, 0, 0, accepting=False)
        free = s.kv_blocks_free - self.reserved_blocks
        return WorkerLoad(self.worker_id, self.role, max(0, free), s.kv_blocks_total, s.block_size,
                          s.queued_prompt_tokens, s.remaining_decode_tokens, accepting=self.state == "ready")


def engine_configs(cfg: ClusterConfig, model_path: str) -> tuple[EngineConfig, EngineConfig]:
    """(prefill, decode) engine configs from the cluster config."""
    p, d = cfg.prefill, cfg.decode
    common = dict(model=model_path, dtype=cfg.dtype, device=cfg.device)
    # A prefill worker never decodes: no compiled one-token path (its memory and compile time).
    prefill = EngineConfig(**common, compile_decode=False,
                           cache=CacheConfig(block_size=p.block_size, memory_gb=p.kv_cache_gb),
                           scheduler=SchedulerConfig(max_num_batched_tokens=p.max_batched_tokens))
    from engine.quant import split_quantization
    decode_model, quantization = split_quantization(d.quantization, model_path)  # a checkpoint replaces the model
    decode = EngineConfig(**{**common, "model": decode_model}, quantization=quantization,
                          compile_decode=d.compile_decode,
                          cache=CacheConfig(block_size=d.block_size, memory_gb=d.kv_cache_gb),
                          scheduler=SchedulerConfig(max_num_batched_tokens=d.max_batched_tokens,
                                                    max_num_seqs=d.max_num_seqs,
                                                    enable_chunked_prefill=d.chunked_prefill),
                          speculative=d.speculative.to_engine())
    return prefill, decode


class Pools:
    """Creates the actors, keeps their loads current, notices deaths and restarts.

    Args:
        cfg: the cluster config (pool sizes, transport).
        model_path: the model folder every worker loads (resolved by the router once).
        on_records: called with (worker, records) for every output batch of a ready worker.
        on_lost: called with the worker when it is lost; its requests must move elsewhere.
    """

    def __init__(self, cfg: ClusterConfig, model_path: str,
                 on_records: Callable[[Worker, list[Record]], None],
                 on_lost: Callable[[Worker], None]) -> None:
        self.cfg, self.model_path = cfg, model_path
        self.on_records, self.on_lost = on_records, on_lost
        self.workers: dict[str, Worker] = {}
        self.model_info: ModelInfo | None = None  # the first worker's; every other must match it
        self.bad_reports = 0  # messages on the report socket that were not a Report
        # The cluster key: the workers' reports and every KV message carry a MAC under it
        # (kvtransfer.auth). Made here, handed to each actor at creation (Ray's own channel).
        self.key = new_secret()
        self._changed = asyncio.Event()  # replaced on every notify: waiters wake once each
        self._tasks: set[asyncio.Task] = set()  # running background tasks (each removes itself)
        self._sock = None
        self._next_index = {"prefill": 0, "decode": 0, "colocated": 0}

    # ---- start / stop ------------------------------------------------------------------------
    async def start(self, progress: Callable[[str], None] = lambda s: None) -> None:
        """Create every actor and wait until all are ready (model loaded, connected)."""
        import ray
        import zmq
        import zmq.asyncio
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPORT_BYTES)
        port = self._sock.bind_to_random_port(f"tcp://{ray.util.get_node_ip_address()}")
        address = f"tcp://{ray.util.get_node_ip_address()}:{port}"
        self._spawn(self._receive(), "pools-receive")
        self._address = address
        cfg = self.cfg
        colocated = cfg.mode == "colocated"
        for _ in range(0 if colocated else cfg.prefill.replicas):
            self._create("prefill")
        for _ in range(cfg.decode.replicas):
            self._create("colocated" if colocated else "decode")
        progress(f"starting {len(self.workers)} workers ({cfg.mode}) ...")
        # Decode workers first: a prefill worker coming up connects to every ready decode worker.
        decode = [w for w in self.workers.values() if w.role != "prefill"]
        await asyncio.gather(*(self._bring_up(w) for w in decode))
        await asyncio.gather(*(self._bring_up(w) for w in self.workers.values() if w.role == "prefill"))
        bad = [w.worker_id for w in self.workers.values() if w.state != "ready"]
        if bad:
            raise RuntimeError(f"workers failed to start: {', '.join(bad)}")
        progress(f"{len(self.workers)} workers ready")
        self._spawn(self._health(), "pools-health")

    def _create(self, role: str) -> Worker:
        """Create one worker actor (not yet up). Ray places it by its resources; on a cluster
        with an autoscaler a pending actor makes it add a node of the right type."""
        from decode_worker.actor import DecodeActor
        from prefill_worker.actor import PrefillActor
        cfg, kt = self.cfg, self.cfg.kv_transfer
        prefill_cfg, decode_cfg = engine_configs(cfg, self.model_path)
        pool = cfg.prefill if role == "prefill" else cfg.decode
        wid = f"{'prefill' if role == 'prefill' else 'decode'}-{self._next_index[role]}"
        self._next_index[role] += 1
        metrics = None if cfg.metrics.worker_port is None else ("", cfg.metrics.worker_port)
        cls, engine_cfg = (PrefillActor, prefill_cfg) if role == "prefill" else (DecodeActor, decode_cfg)
        opts = WorkerOptions(kt.transport, kt.lease_s, pool.threads, RouterLink(self._address, wid), metrics,
                             role == "colocated", key=self.key, kv_integrity=kt.integrity,
                             faults=kt.fault_injection,
                             bundled_model=cfg.model is None and engine_cfg.model == self.model_path)
        actor = cls.options(resources={"prefill" if role == "prefill" else "decode": 1}, num_cpus=pool.threads,
                            max_restarts=-1, max_task_retries=0,
                            **({"num_gpus": 1} if cfg.device == "cuda" else {})).remote(engine_cfg, opts)
        w = self.workers[wid] = Worker(wid, role, actor)
        return w

    def grow(self, role: str) -> Worker:
        """Add a worker to a pool; it takes requests once up (model loaded, connected)."""
        w = self._create(role)
        self._spawn(self._bring_up(w), f"up-{w.worker_id}")
        return w

    def drain(self, role: str, holds: Callable[[Worker], bool]) -> Worker | None:
        """Stop placing on one worker of the pool (the least loaded) and retire it once it
        holds nothing: no request of the router's (``holds``), nothing running or waiting, no
        KV block (so its transfers ended). None if the pool has no ready worker."""
        ready = [w for w in self.workers.values() if w.role == role and w.state == "ready"]
        if not ready:
            return None
        w = min(ready, key=lambda w: (w.status.kv_blocks_used, w.status.running, w.worker_id) if w.status
                else (0, 0, w.worker_id))
        w.state = "draining"
        self._spawn(self._retire(w, holds), f"retire-{w.worker_id}")
        return w

    async def _retire(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        import ray
        since = time.monotonic()
        while True:
            s = w.status
            # A heartbeat after draining began shows what it still holds.
            if (w.last_seen > since and not holds(w) and s is not None and not s.running and not s.waiting
                    and not s.kv_blocks_used) or w.state == "gone":
                break
            await asyncio.sleep(HEALTH_PERIOD_S)
        log.info("worker %s drained; retiring it", w.worker_id)
        try:
            await asyncio.wait_for(w.actor.shutdown.remote(), 10)
        except Exception:  # already gone
            pass
        ray.kill(w.actor, no_restart=True)
        self.workers.pop(w.worker_id, None)
        self._forget_address(w)
        self._notify()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        """Run ``coro`` in the background until it ends or :meth:`stop` (which cancels it)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _forget_address(self, w: Worker) -> None:
        """A decode worker's KV receiver address is dead (lost, retired): every prefill worker
        forgets it, so their per-peer tables do not grow with restarts."""
        if w.role != "decode" or w.address is None:
            return
        for p in self.workers.values():
            if p.role == "prefill" and p.state in ("ready", "draining"):
                p.actor.disconnect.remote(w.address)
        w.address = None

    async def call(self, w: Worker, ref: Any) -> Any:
        """Await one call to ``w`` with the stall deadline: unanswered in ``router.stall_s``, the
        worker is stalled (lost, its process replaced) and TimeoutError is raised."""
        try:
            return await asyncio.wait_for(ref, self.cfg.router.stall_s)
        except TimeoutError:
            self.stalled(w, f"a call did not answer in {self.cfg.router.stall_s:g}s (router.stall_s)")
            raise

    def stalled(self, w: Worker, why: str) -> None:
        """Alive to Ray but not answering (stopped, stuck in a kernel, swapping): its requests
        move now, and a fresh process replaces it (a SIGSTOPped one cannot exit by itself)."""
        if w.state in ("ready", "draining"):
            self.lost(w, f"stalled: {why}")
            self._spawn(asyncio.to_thread(_kill, w.actor), f"kill-{w.worker_id}")

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        import ray
        for w in self.workers.values():
            try:
                await asyncio.wait_for(w.actor.shutdown.remote(), 10)
            except Exception:  # already dead or stuck: the kill below settles it
                pass
            ray.kill(w.actor, no_restart=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()

    # ---- views -------------------------------------------------------------------------------
    def loads(self, *roles: str) -> list[WorkerLoad]:
        return [w.load() for w in self.workers.values() if w.role in roles]

    def reserved(self, worker_id: str, blocks: int, new_call: bool = True) -> None:
        """The router is about to make an admitting call (reserve, colocated submit) for
        ``blocks`` there (``new_call=False``: more blocks for the call just made); they count
        until a report shows the worker took that call."""
        w = self.workers[worker_id]
        w.calls += new_call
        w.pending.append((w.calls, blocks))

    def any_alive(self, *roles: str) -> bool:
        """Some worker of these roles is ready or coming back (a request may wait for it)."""
        return any(w.state != "gone" for w in self.workers.values() if w.role in roles)

    def _notify(self) -> None:
        """Capacity may have grown (a request ended, a worker came or went): wake admission."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_change(self, timeout: float) -> None:
        """Until the next :meth:`_notify`, or ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    # ---- liveness ----------------------------------------------------------------------------
    def lost(self, w: Worker, why: str) -> None:
        """Mark ``w`` lost (idempotent per incarnation) and bring it back in the background;
        a draining worker is not brought back (it is gone, and its retirement completes)."""
        if w.state not in ("ready", "draining"):
            return
        log.warning("worker %s lost (%s); its requests move to other workers", w.worker_id, why)
        back = w.state == "ready"
        w.state = "dead" if back else "gone"
        w.reported(None)
        w.restarts += 1
        self.on_lost(w)
        self._forget_address(w)
        self._notify()
        if back:
            self._spawn(self._bring_up(w), f"up-{w.worker_id}")

    async def _bring_up(self, w: Worker) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
        while True:
            try:
                info = await self._connect(w)
                if info.incarnation == w.incarnation:
                    # The process outlived being lost (its kill failed): every request it holds
                    # was moved elsewhere, so its blocks are nobody's. Free them all now.
                    held = await self._ask(w, w.actor.held.remote())
                    freed = await self._ask(w, w.actor.release.remote(list(held)))
                    log.warning("worker %s came back as the same process; freed %d blocks of %d requests "
                                "it no longer runs", w.worker_id, freed, len(held))
                break
            except (ActorUnavailableError, TimeoutError):  # Ray is restarting it, or it stalled
                await asyncio.sleep(0.2)
            except RayTaskError as e:
                if not isinstance(e.cause, (ConnectionError, TimeoutError)):  # e.g. another model's layout
                    log.error("worker %s cannot serve: %s", w.worker_id, e)
                    self._gone(w)
                    return
                # A peer it connects to went away meanwhile (killed, restarting): try again.
                log.warning("worker %s: %s; trying again", w.worker_id, e.cause)
                await asyncio.sleep(1.0)
            except RayActorError as e:  # dead for good (restarts exhausted, node gone)
                log.error("worker %s is gone: %s", w.worker_id, e)
                self._gone(w)
                return
            except RuntimeError as e:  # another model or other weights than the other workers
                log.error("worker %s cannot serve: %s", w.worker_id, e)
                self._gone(w)
                return
        w.info, w.incarnation, w.last_seen, w.seq = info, info.incarnation, time.monotonic(), 0
        w.state = "ready"
        self._notify()

    def _gone(self, w: Worker) -> None:
        w.state = "gone"
        gone = [x for x in self.workers.values() if x.state == "gone"]
        for x in gone[:max(0, len(gone) - MAX_GONE)]:  # the oldest first (insertion order)
            del self.workers[x.worker_id]
        self._notify()

    async def _ask(self, w: Worker, ref: Any, timeout_s: float | None = None) -> Any:
        """A bring-up call with a deadline (``router.stall_s`` by default); a stalled worker is
        killed so that Ray starts a fresh one, and TimeoutError raised."""
        try:
            return await asyncio.wait_for(ref, timeout_s or self.cfg.router.stall_s)
        except TimeoutError:
            log.warning("worker %s did not answer while coming up; replacing its process", w.worker_id)
            await asyncio.to_thread(_kill, w.actor)
            raise

    async def _connect(self, w: Worker) -> ModelInfo:
        """Check the worker's model and wire its KV connections; returns its model info. A
        peer that does not connect (it died or restarts meanwhile) is skipped: when it comes
        back up, its own bring-up connects it to every ready worker of the other pool."""
        from ray.exceptions import RayActorError
        info = await self._ask(w, w.actor.model_info.remote(), LOAD_TIMEOUT_S)  # waits while its model loads
        if self.model_info and info.fingerprint != self.model_info.fingerprint:
            raise RuntimeError(f"{w.worker_id} serves another model: {info.model}")
        if self.model_info and info.weights != self.model_info.weights:
            raise RuntimeError(f"{w.worker_id} loaded other weights than the other workers ({info.model}, "
                               f"digest {info.weights} vs {self.model_info.weights}): its node's copy differs")
        self.model_info = self.model_info or info
        if w.role != "prefill":
            w.address = await self._ask(w, w.actor.address.remote())
            prefills = [p for p in self.workers.values() if p.role == "prefill" and p.state == "ready"]
            answers = await asyncio.gather(*(asyncio.wait_for(p.actor.connect.remote(w.address), self.cfg.router.stall_s)
                                             for p in prefills), return_exceptions=True)
            for p, a in zip(prefills, answers):
                if isinstance(a, TimeoutError):  # that prefill worker stalled, not this one; coming
                    self.stalled(p, "it did not connect to a new decode worker")  # back, it connects
                elif isinstance(a, BaseException):  # it died meanwhile: coming back, it connects
                    log.warning("prefill worker %s did not connect to %s: %r", p.worker_id, w.worker_id, a)
        else:
            decodes = [d for d in self.workers.values() if d.role == "decode" and d.state == "ready"]
            answers = await self._ask(w, asyncio.gather(*(w.actor.connect.remote(d.address) for d in decodes),
                                                        return_exceptions=True))
            for d, a in zip(decodes, answers):
                if isinstance(a, RayActorError):  # this worker itself died: the bring-up starts over
                    raise a
                if isinstance(a, BaseException):  # that decode worker went away meanwhile; when it
                    log.warning("%s did not connect to %s: %r", w.worker_id, d.worker_id, a)  # is back, it connects
        w.reported(None)
        w.reported(await self._ask(w, w.actor.status.remote()))  # placement needs a load now
        return info

    async def _health(self) -> None:
        """Ask Ray about workers whose heartbeat went quiet (a long step is not death)."""
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if w.state in ("ready", "draining") and now - w.last_seen > QUIET_S:
                    state = await asyncio.to_thread(_actor_state, w.actor)
                    if state in ("RESTARTING", "DEAD"):
                        self.lost(w, f"Ray reports it {state}")
                    elif now - w.last_seen > self.cfg.router.stall_s:
                        # Alive to Ray but silent (a step never takes this long). ``stalled``
                        # reads the state again: another path may have marked it lost while Ray
                        # answered, and a process already restarted must not be killed.
                        self.stalled(w, f"no report for {now - w.last_seen:.0f}s (router.stall_s)")

    async def _receive(self) -> None:
        while True:
            msg = await self._sock.recv()
            try:
                report = decode_report(msg, self.key)
            except ProtocolError as e:  # never from our workers; whatever it is, it ends nothing
                self.bad_reports += 1
                log.warning("dropped a message on the report socket: %s", e)
                continue
            w = self.workers.get(report.worker_id)
            if w is None:
                continue
            if w.state in ("ready", "draining") and report.incarnation != w.incarnation:
                self.lost(w, "it restarted")  # a new process: the old one's requests are gone
                continue
            if report.incarnation != w.incarnation:
                continue  # starting, or a late message of a lost incarnation
            if report.seq <= w.seq:  # zmq keeps a sender's order: this one was seen (a replay)
                self.bad_reports += 1
                continue
            w.seq = report.seq
            status = report.status
            freed = w.status is not None and status.kv_blocks_used < w.status.kv_blocks_used
            w.reported(status)
            w.last_seen = time.monotonic()
            if report.records:
                self.on_records(w, report.records)
            if freed or any(isinstance(r, Failed) or r.finish for r in report.records):
                self._notify()


def _kill(actor: Any) -> None:
    """Kill the actor's process; Ray restarts it (max_restarts=-1)."""
    import ray
    try:
        ray.kill(actor, no_restart=False)
    except Exception as e:  # already gone: Ray restarts it or reports it dead either way
        log.warning("could not kill a stalled worker: %s", e)


def _actor_state(actor: Any) -> str:
    """The actor's state in Ray's GCS (ALIVE, RESTARTING, DEAD...); "UNKNOWN" if unavailable."""
    try:
        from ray._private import state  # no public API answers this without the dashboard
        return state.actors(actor_id=actor._actor_id.hex()).get("State", "UNKNOWN")
    except Exception:  # an API change must not take the router down: heartbeats still work
        return "UNKNOWN"

