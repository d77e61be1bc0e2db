"""Worker pools: the router's view of every prefill and decode actor, and their output stream.

Lifecycle of a worker here (``Worker.state``)::

    starting (actor created, model loading) ──up──► ready ──lost──► dead ──up again──► ready
                                                      │      (Ray restarts the actor; a fresh incarnation)
                                                      └──drain──► draining ──holds nothing──► retired (removed)
                                                      └──switch─► draining ──holds nothing──► ready (adaptive: the
                                                                  other role; lost meanwhile: dead, back in it)
    Ray cannot bring it back (restarts exhausted, node gone), it cannot serve here (another
    model, other weights than the other workers), or lost while draining: gone (its process is
    ended; the last ``liveness.MAX_GONE`` gone workers stay listed for `pdserve status`).

Liveness (``up``, ``lost``, stalls, bring-up): router.liveness, which :class:`Pools` builds on.

Every worker pushes a ``worker.protocol.Report`` (its records and status) over zmq after each
step with outputs and at least every 50 ms (worker.step_loop); one PULL socket here receives
them all. What is taken (``take_report``), in order of cost:

- no readable origin (worker id, incarnation), a bad MAC, or a malformed body: dropped and
  counted (``bad_reports``);
- an origin other than a worker's current incarnation: dropped before any MAC is computed and
  counted (``stale_reports``). Only Ray says a worker restarted (router.liveness): such a
  report, if its MAC is valid, at most makes the router ask Ray (once per ``RESTART_CHECK_S``
  per worker), so a captured report of an earlier process re-runs nothing and frees nothing;
- a ``seq`` not above the last one taken from that incarnation (a replay): dropped, counted.

The socket holds at most ``REPORT_HWM`` messages per connection (zmq's high-water marks are
per pipe; past it zmq stops reading that connection, and the worker's own queue holds the
rest: nothing is dropped) of at most ``MAX_REPORT_BYTES`` each (a bigger one ends its
connection): 256 MiB per connection at worst, a few hundred KB in practice. MACs are checked
on the event loop: HMAC-SHA256 of a typical report (~1 KB) takes ~2 us, of the largest ~3 ms.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvtransfer.auth import new_secret
from router.config import ClusterConfig
from router.liveness import HEALTH_PERIOD_S, QUIET_S, Liveness
from router.placement import WorkerLoad
from worker.protocol import (MAX_REPORT_BYTES, Failed, Key, ModelInfo, ProtocolError, Record, WorkerStatus,
                             decode_report, join_pieces, report_key, report_origin)
from worker.step_loop import RouterLink, WorkerOptions

log = logging.getLogger("pdserve.router")

REPORT_HWM = 64  # messages queued per worker connection on the report socket (module docstring)
RESTART_CHECK_S = QUIET_S  # a worker's reports of another incarnation ask Ray at most this often


@dataclass
class Worker:
    """One actor as the router sees it."""

    worker_id: str
    role: str  # prefill, decode or colocated; an adaptive worker's changes (router.roles)
    actor: Any
    state: str = "starting"  # starting, ready, draining, dead, gone (module docstring)
    adaptive: bool = False  # an AdaptiveActor: answers both roles' calls
    next_role: str | None = None  # draining to switch to this role (router.roles), not to retire
    incarnation: str | None = None
    address: str | None = None  # decode and colocated: the KV receiver's address
    status: WorkerStatus | None = None  # its latest report's; None until one arrives
    last_seen: float = field(default_factory=time.monotonic)
    # Blocks the router promised this worker that its reports do not show yet: (the call's
    # number, blocks, prompt tokens it will prefill). A report drops those its status has
    # admitted (``WorkerStatus.admitted``): a report sent before the worker took a call must
    # not erase that call's reservation.
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    calls: int = 0  # admitting calls (reserve, submit) made to its current incarnation
    restarts: int = 0
    info: ModelInfo | None = None  # model_info() of its current incarnation
    seq: int = 0  # the latest report's Report.seq from its current incarnation (older: a replay)
    ray_restarts: int | None = None  # Ray's restart count of the actor before its bring-up (None: unknown)
    checked_at: float = float("-inf")  # when a report of another incarnation last made the router ask Ray
    # (incarnation, its report key): worker.protocol.report_key, derived once per incarnation
    rkey: tuple[str, bytes] | None = field(default=None, repr=False)
    pieces: dict[Key, list] = field(default_factory=dict, repr=False)  # worker.protocol.join_pieces

    @property
    def reserved_blocks(self) -> int:
        return sum(b for _, b, _ in self.pending)

    def reported(self, status: WorkerStatus | None) -> None:
        """A new status (None: none yet, a new incarnation); reservations it shows are dropped."""
        self.status = status
        if status is not None and status.kv_address and self.address is not None:
            self.address = status.kv_address  # the newest (a replaced UCX worker's); older ones still reach it a while
        if status is None:
            self.pending, self.calls = [], 0
            self.pieces.clear()  # (records of a process whose requests moved elsewhere)
        else:
            self.calls = max(self.calls, status.admitted)
            self.pending = [(n, b, t) for n, b, t in self.pending if n > status.admitted]

    def load(self) -> WorkerLoad:
        s = self.status
        if s is None:
            return WorkerLoad(self.worker_id, self.role, 0, 0, 16, 0, 0, accepting=False)
        free = s.kv_blocks_free - self.reserved_blocks
        queued = s.queued_prompt_tokens + sum(t for _, _, t in self.pending)
        return WorkerLoad(self.worker_id, self.role, max(0, free), s.kv_blocks_total, s.block_size,
                          queued, s.remaining_decode_tokens, accepting=self.state == "ready")


def report_socket(ctx: Any, host: str) -> tuple[Any, str]:
    """The router's report socket on ``host`` (a zmq PULL, bounded: module docstring) and its address."""
    import zmq
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, REPORT_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPORT_BYTES)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


def _least_loaded(workers: Iterable[Worker]) -> Worker | None:
    """The worker holding the fewest KV blocks, then running the fewest requests (the cheapest
    to drain); None if there is none."""
    return min(workers, key=lambda w: (w.status.kv_blocks_used, w.status.running, w.worker_id) if w.status
               else (0, 0, w.worker_id), default=None)


def _fixed_gb(kv_cache_gb: float | str) -> float:
    """A pool's KV cache GiB; for ``auto`` the engine's default, which the worker replaces with
    its node's figure when it starts (``WorkerOptions.kv_cache_auto``, worker.actor)."""
    return CacheConfig().memory_gb if kv_cache_gb == "auto" else kv_cache_gb


def engine_configs(cfg: ClusterConfig, model_path: str) -> tuple[EngineConfig, EngineConfig]:
    """(prefill, decode) engine configs from the cluster config."""
    p, d = cfg.prefill, cfg.decode
    common = dict(model=model_path, dtype=cfg.dtype, dequantize=cfg.dequantize, device=cfg.device)
    # A prefill worker never decodes: no compiled one-token path (its memory and compile time).
    prefill = EngineConfig(**common, compile_decode=False,
                           cache=CacheConfig(block_size=p.block_size, memory_gb=_fixed_gb(p.kv_cache_gb)),
                           scheduler=SchedulerConfig(max_num_batched_tokens=p.max_batched_tokens))
    from engine.quant import split_quantization
    decode_model, quantization = split_quantization(d.quantization, model_path)  # a checkpoint replaces the model
    decode = EngineConfig(**{**common, "model": decode_model}, quantization=quantization,
                          compile_decode=d.compile_decode, compile_decode_rows=d.compile_decode_rows,
                          cache=CacheConfig(block_size=d.block_size, memory_gb=_fixed_gb(d.kv_cache_gb)),
                          scheduler=SchedulerConfig(max_num_batched_tokens=d.max_batched_tokens,
                                                    max_num_seqs=d.max_num_seqs,
                                                    enable_chunked_prefill=d.chunked_prefill),
                          speculative=d.speculative.to_engine())
    return prefill, decode


class Pools(Liveness):
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
        self._weights: dict[str, str] = {}  # model folder name -> the weights digest the first worker loaded
        self.bad_reports = 0  # messages on the report socket that were not a Report of a worker (or a replay)
        self.stale_reports = 0  # reports of another incarnation than a worker's current one (ignored)
        self.clock = time.monotonic  # (injectable: tests)
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
        import zmq.asyncio
        self._ctx = zmq.asyncio.Context()
        self._sock, address = report_socket(self._ctx, ray.util.get_node_ip_address())
        self._spawn(self._receive(), "pools-receive")
        self._address = address
        cfg = self.cfg
        colocated = cfg.mode == "colocated"
        for _ in range(0 if colocated else cfg.prefill.replicas):  # (adaptive: the workers that begin as prefill)
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
        from adaptive_worker.actor import AdaptiveActor
        from decode_worker.actor import DecodeActor
        from prefill_worker.actor import PrefillActor
        cfg, kt = self.cfg, self.cfg.kv_transfer
        adaptive = cfg.mode == "adaptive"
        prefill_cfg, decode_cfg = engine_configs(cfg, self.model_path)
        pool = cfg.prefill if role == "prefill" else cfg.decode
        # (an adaptive worker's role changes: its name says the pool it began in, its index is unique)
        wid = f"{'prefill' if role == 'prefill' else 'decode'}-{self._next_index[role]}"
        self._next_index[role] += 1
        metrics = None if cfg.metrics.worker_port is None else ("", cfg.metrics.worker_port)
        # An adaptive worker runs the decode pool's engine in both roles: one engine, one cache.
        cls, engine_cfg = (AdaptiveActor, decode_cfg) if adaptive else \
            (PrefillActor, prefill_cfg) if role == "prefill" else (DecodeActor, decode_cfg)
        opts = WorkerOptions(kt.transport, kt.lease_s, pool.threads, RouterLink(self._address, wid), metrics,
                             role == "colocated", key=self.key, kv_integrity=kt.integrity,
                             faults=kt.fault_injection,
                             transfer_cpus=cfg.prefill.transfer_cpus if role == "prefill" else (),
                             # (a decode pool's quantized checkpoint is its own folder: as given)
                             resolve_model=engine_cfg.model == self.model_path, model=cfg.model,
                             # (an adaptive worker runs the decode pool's engine)
                             kv_cache_auto=(cfg.prefill if role == "prefill" and not adaptive else cfg.decode
                                            ).kv_cache_gb == "auto")
        cpus = pool.threads + (len(cfg.prefill.transfer_cpus) if role == "prefill" else 0)  # (the transfer's own)
        actor = cls.options(resources={"prefill" if role == "prefill" else "decode": 1}, num_cpus=cpus,
                            max_restarts=-1, max_task_retries=0,
                            **({"num_gpus": 1} if cfg.device == "cuda" else {})).remote(engine_cfg, opts)
        w = self.workers[wid] = Worker(wid, role, actor, adaptive=adaptive)
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
        w = _least_loaded(w for w in self.workers.values() if w.role == role and w.state == "ready")
        if w is None:
            return None
        w.state = "draining"
        self._spawn(self._retire(w, holds), f"retire-{w.worker_id}")
        return w

    def switch(self, old: str, new: str, holds: Callable[[Worker], bool], worker_id: str | None = None
               ) -> Worker | None:
        """Move an adaptive worker from role ``old`` to ``new`` (router.roles): ``worker_id``,
        or the least loaded ready one. It takes no new work at once (draining), and joins the
        other pool, the same process, once it holds nothing (as for retiring). None: no such
        worker."""
        w = _least_loaded(w for w in self.workers.values() if w.adaptive and w.role == old and w.state == "ready"
                          and worker_id in (None, w.worker_id))
        if w is None:
            return None
        w.state, w.next_role = "draining", new
        self._spawn(self._switch(w, holds), f"switch-{w.worker_id}")
        return w

    async def _switch(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        await self._drained(w, holds)
        if w.state != "draining":  # lost meanwhile: it comes back in its new role (``lost``)
            return
        w.role = w.next_role  # (``next_role`` stays until wired: lost meanwhile, it comes back in it)
        try:
            await self._wire(w)
        except Exception as e:  # it died or stalled while connecting: replaced, back in the new role
            if w.state == "draining":
                self.lost(w, f"connecting in its new role failed: {e!r}")
            return
        if w.state == "draining":  # (not lost while it was wired)
            w.state, w.next_role = "ready", None
            log.info("worker %s is a %s worker now", w.worker_id, w.role)
        self._notify()

    async def _drained(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        """Until ``w`` holds nothing: no request of the router's (``holds``), no admitting call
        unreported, nothing running or waiting, no KV block (so its transfers ended); or it is
        no longer draining."""
        since = time.monotonic()
        while w.state == "draining":
            s = w.status
            # A heartbeat after draining began shows what it still holds.
            # (``pending``: a call that admits a request there is in flight, or not yet reported)
            if (w.last_seen > since and not holds(w) and not w.pending and s is not None and not s.running
                    and not s.waiting and not s.kv_blocks_used):
                return
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _retire(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        import ray
        await self._drained(w, holds)
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

    def reserved(self, worker_id: str, blocks: int, new_call: bool = True, prompt_tokens: int = 0) -> None:
        """The router is about to make an admitting call (reserve, a submit that prefills there)
        for ``blocks`` there (``new_call=False``: more blocks for the call just made), and
        ``prompt_tokens`` it will prefill; they count until a report shows the worker took that
        call (so placements in the call's round trip see that queue too)."""
        w = self.workers[worker_id]
        w.calls += new_call
        w.pending.append((w.calls, blocks, prompt_tokens))

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

    # ---- reports ---------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            self.take_report(await self._sock.recv())

    def take_report(self, msg: bytes) -> None:
        """One message from the report socket (the module docstring says what is taken)."""
        try:
            worker_id, incarnation = report_origin(msg)
        except ProtocolError as e:  # never from our workers; whatever it is, it ends nothing
            self._bad(e)
            return
        w = self.workers.get(worker_id)
        if w is None or w.incarnation is None or incarnation != w.incarnation:
            self._stale(w, incarnation, msg)
            return
        if w.rkey is None or w.rkey[0] != incarnation:
            w.rkey = (incarnation, report_key(self.key, worker_id, incarnation))
        try:
            report = decode_report(msg, rkey=w.rkey[1])
        except ProtocolError as e:
            self._bad(e)
            return
        if report.seq <= w.seq:  # zmq keeps a sender's order: this one was seen (a replay)
            self._bad(f"a replayed report of {worker_id} (seq {report.seq} after {w.seq})")
            return
        w.seq = report.seq
        status = report.status
        freed = w.status is not None and status.kv_blocks_used < w.status.kv_blocks_used
        w.reported(status)
        w.last_seen = time.monotonic()
        records = join_pieces(w.pieces, report.records) if report.records else []
        if records:
            self.on_records(w, records)
        if freed or any(isinstance(r, Failed) or r.finish for r in records):
            self._notify()

    def _bad(self, why: object) -> None:
        self.bad_reports += 1
        if self.bad_reports & (self.bad_reports - 1) == 0:  # the 1st, 2nd, 4th, 8th...: no log flood
            log.warning("dropped a message on the report socket (%d so far): %s", self.bad_reports, why)

    def _stale(self, w: Worker | None, incarnation: str, msg: bytes) -> None:
        """A report of no current incarnation: ignored. A serving worker's, with a valid MAC of
        its claimed incarnation, has the router ask Ray (at most every RESTART_CHECK_S) whether
        the actor restarted; a starting (or dead) worker's new process reports before its
        bring-up adopts it, which is expected."""
        self.stale_reports += 1
        if w is None or w.state not in ("ready", "draining") or self.clock() - w.checked_at < RESTART_CHECK_S:
            return
        try:
            decode_report(msg, self.key)
        except ProtocolError as e:
            self._bad(e)
            return
        w.checked_at = self.clock()
        log.warning("worker %s: a report of incarnation %s, not its current %s, ignored (%d such so far); "
                    "asking Ray whether it restarted", w.worker_id, incarnation, w.incarnation, self.stale_reports)
        self._spawn(self.check_restart(w), f"check-{w.worker_id}")
