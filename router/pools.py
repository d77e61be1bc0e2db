"""Worker pools: the router's view of every prefill and decode actor, and their output stream.

Lifecycle of a worker here (``Worker.state``, a ``WorkerState``: router.worker_state)::

    STARTING (actor created, model loading) ──up──► READY ──lost──► DEAD ──up again──► READY
                                                      │      (Ray restarts the actor; a fresh incarnation)
                                                      └──drain──► DRAINING ──holds nothing──► retired (removed)
                                                      └──switch─► DRAINING ──holds nothing──► READY (adaptive: the
                                                                  other role; lost meanwhile: DEAD, back in it)
    Ray cannot bring it back (restarts exhausted, node gone), it cannot serve here (another
    model, other weights than the other workers), or lost while draining: GONE (its process is
    ended; the last ``liveness.MAX_GONE`` gone workers stay listed for `pdserve status`).

Liveness (``up``, ``lost``, stalls, bring-up): router.liveness, owned here (``pools.liveness``).

With ``ha.enabled`` (router.ha) the workers are detached, named actors: at start the pools adopt
the running ones (bring-up ``adopt``s first; what they decode: router.resume), create the
missing ones; every call carries the epoch.

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
from typing import Any

import zmq
import zmq.asyncio

from engine.errors import InvalidRequestError
from kvtransfer.auth import new_secret
from router import ha
from router.aio import within
from router.config import ClusterConfig
from router.engine_configs import engine_configs  # (also imported from here)
from router.liveness import HEALTH_PERIOD_S, LOAD_TIMEOUT_S, QUIET_S, Liveness
from router.placement import WorkerLoad
from router.worker_state import UNREACHABLE, Role, Unreachable, Worker, WorkerState
from worker.protocol import (MAX_REPORT_BYTES, Failed, Key, ModelInfo, ProtocolError, Record, Reservation, RouterLink,
                             WorkerOptions, decode_report, join_pieces, report_key, report_origin)

log = logging.getLogger("pdserve.router")

REPORT_HWM = 64  # messages queued per worker connection on the report socket (module docstring)
RESTART_CHECK_S = QUIET_S  # a worker's reports of another incarnation ask Ray at most this often


def report_socket(ctx: Any, host: str) -> tuple[Any, str]:
    """The router's report socket on ``host`` (a zmq PULL, bounded: module docstring) and its address."""
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
        self.on_records = on_records
        self.workers: dict[str, Worker] = {}
        self.bad_reports = 0  # messages on the report socket that were not a Report of a worker (or a replay)
        self.stale_reports = 0  # reports of another incarnation than a worker's current one (ignored)
        self.clock = time.monotonic  # (injectable: tests)
        # The cluster key: the workers' reports and every KV message carry a MAC under it
        # (kvtransfer.auth). Made here, handed to each actor at creation (Ray's own channel).
        self.key = new_secret()
        self._changed = asyncio.Event()  # replaced on every notify: waiters wake once each
        self._tasks: set[asyncio.Task] = set()  # running background tasks (each removes itself)
        self._sock = None
        self._next_index = dict.fromkeys(Role, 0)
        self.epoch: int | None = None  # ha.enabled: this router's (router.ha), taken at start
        self.handover: Callable[[Worker, Any], set[str]] = lambda w, a: set()  # ha.enabled: router.resume's
        self.liveness = Liveness(cfg, self.workers, on_lost, self._spawn, self._notify)

    @property
    def model_info(self) -> ModelInfo | None:
        """The first worker's model info (every other must match it); None before one is up."""
        return self.liveness.model_info

    # ---- start / stop ------------------------------------------------------------------------
    async def start(self, progress: Callable[[str], None] = lambda s: None) -> None:
        """Create every actor and wait until all are ready (model loaded, connected)."""
        import ray  # (heavy: Ray, loaded when the cluster starts)
        self._ctx = zmq.asyncio.Context()
        self._sock, address = report_socket(self._ctx, ray.util.get_node_ip_address())
        self._spawn(self._receive(), "pools-receive")
        self._address = address
        cfg = self.cfg
        colocated = cfg.mode == "colocated"
        if cfg.ha.enabled:  # this router's epoch, the cluster key, the running workers (STARTING)
            self.epoch, self.key = await asyncio.to_thread(ha.find, cfg, self.workers, self._next_index)
            # each bring-up adopts the worker first; a router fenced off ends no process (router.ha)
            self.liveness.adopt = lambda w: ha.adopt(w, RouterLink(address, w.worker_id), cfg.ha.grace_s,
                                                     self.liveness.call, LOAD_TIMEOUT_S, self.handover,
                                                     self.take_report)
            self.liveness.may_kill = lambda: ha.may_kill(cfg.ha.cluster_name, self.epoch)
        have = {pool: sum(w.role.pool == pool for w in self.workers.values()) for pool in ("prefill", "decode")}
        for _ in range((0 if colocated else cfg.prefill.replicas) - have["prefill"]):  # (adaptive: begin as prefill)
            self._create(Role.PREFILL)
        for _ in range(cfg.decode.replicas - have["decode"]):
            self._create(Role.COLOCATED if colocated else Role.DECODE)
        progress(f"starting {len(self.workers)} workers ({cfg.mode}; {len(self.workers) - sum(have.values())} new) ...")
        # Decode workers first: a prefill worker coming up connects to every ready decode worker.
        decode = [w for w in self.workers.values() if w.role is not Role.PREFILL]
        await asyncio.gather(*(self.liveness.bring_up(w) for w in decode))
        await asyncio.gather(*(self.liveness.bring_up(w) for w in self.workers.values() if w.role is Role.PREFILL))
        bad = [w.worker_id for w in self.workers.values() if not w.state.accepting]
        if bad:
            raise RuntimeError(f"workers failed to start: {', '.join(bad)}")
        progress(f"{len(self.workers)} workers ready")
        self._spawn(self.liveness.health(), "pools-health")

    def _create(self, role: str) -> Worker:
        """Create one worker actor (not yet up), placed by Ray (a pending one makes an autoscaler add a node)."""
        # (heavy: torch, the engines: only the pools' owner creates actors)
        from adaptive_worker.actor import AdaptiveActor
        from decode_worker.actor import DecodeActor
        from prefill_worker.actor import PrefillActor
        cfg, kt, role = self.cfg, self.cfg.kv_transfer, Role(role)
        adaptive, prefill = cfg.mode == "adaptive", role is Role.PREFILL
        prefill_cfg, decode_cfg = engine_configs(cfg, self.model_path)
        pool = cfg.prefill if prefill else cfg.decode
        # (an adaptive worker's role changes: its name says the pool it began in, its index is unique)
        wid = f"{role.pool}-{self._next_index[role]}"
        self._next_index[role] += 1
        metrics = None if cfg.metrics.worker_port is None else ("", cfg.metrics.worker_port)
        # An adaptive worker runs the decode pool's engine in both roles: one engine, one cache.
        cls, engine_cfg = (AdaptiveActor, decode_cfg) if adaptive else \
            (PrefillActor, prefill_cfg) if prefill else (DecodeActor, decode_cfg)
        opts = WorkerOptions(kt.transport, kt.lease_s, pool.threads, RouterLink(self._address, wid), metrics,
                             role is Role.COLOCATED, key=self.key, kv_integrity=kt.integrity,
                             faults=kt.fault_injection,
                             transfer_cpus=cfg.prefill.transfer_cpus if prefill else (),
                             # (a decode pool's quantized checkpoint is its own folder: as given)
                             resolve_model=engine_cfg.model == self.model_path, model=cfg.model,
                             # (an adaptive worker runs the decode pool's engine)
                             kv_cache_auto=(cfg.prefill if prefill and not adaptive else cfg.decode
                                            ).kv_cache_gb == "auto",
                             epoch=self.epoch, grace_s=cfg.ha.grace_s)
        cpus = pool.threads + (len(cfg.prefill.transfer_cpus) if prefill else 0)  # (the transfer's own)
        actor = cls.options(resources={role.pool: 1}, num_cpus=cpus,
                            max_restarts=-1, max_task_retries=0, **ha.actor_options(cfg.ha, wid),
                            **({"num_gpus": 1} if cfg.device == "cuda" else {})).remote(engine_cfg, opts)
        w = self.workers[wid] = Worker(wid, role, ha.fenced(actor, self.epoch), adaptive=adaptive)
        return w

    def grow(self, role: str) -> Worker:
        """Add a worker to a pool; it takes requests once up (model loaded, connected)."""
        w = self._create(role)
        self._spawn(self.liveness.bring_up(w), f"up-{w.worker_id}")
        return w

    def drain(self, role: str, holds: Callable[[Worker], bool]) -> Worker | None:
        """Stop placing on one worker of the pool (the least loaded) and retire it once it
        holds nothing: no request of the router's (``holds``), nothing running or waiting, no
        KV block (so its transfers ended). None if the pool has no ready worker."""
        w = _least_loaded(w for w in self.workers.values() if w.ready_as((role,)))
        if w is None:
            return None
        w.state = WorkerState.DRAINING
        self._spawn(self._retire(w, holds), f"retire-{w.worker_id}")
        return w

    def switch(self, old: str, new: str, holds: Callable[[Worker], bool], worker_id: str | None = None
               ) -> Worker | None:
        """Move an adaptive worker from role ``old`` to ``new`` (router.roles): ``worker_id``, or the
        least loaded ready one. It takes no new work at once (draining), and joins the other pool, the
        same process, once it holds nothing (as for retiring). None: no such worker."""
        w = _least_loaded(w for w in self.workers.values() if w.adaptive and w.ready_as((old,))
                          and worker_id in (None, w.worker_id))
        if w is None:
            return None
        w.state, w.next_role = WorkerState.DRAINING, Role(new)
        self._spawn(self._switch(w, holds), f"switch-{w.worker_id}")
        return w

    async def _switch(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        await self._drained(w, holds)
        if w.state is not WorkerState.DRAINING:  # lost meanwhile: it comes back in its new role (``lost``)
            return
        w.role = w.next_role  # (``next_role`` stays until wired: lost meanwhile, it comes back in it)
        try:
            await self.liveness.wire(w)
        except Exception as e:  # it died or stalled while connecting: replaced, back in the new role
            if w.state is WorkerState.DRAINING:
                self.liveness.lost(w, f"connecting in its new role failed: {e!r}")
            return
        if w.state is WorkerState.DRAINING:  # (not lost while it was wired)
            w.state, w.next_role = WorkerState.READY, None
            log.info("worker %s is a %s worker now", w.worker_id, w.role)
        self._notify()

    async def _drained(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        """Until ``w`` holds nothing: no request of the router's (``holds``), no admitting call
        unreported, nothing running or waiting, no KV block (so its transfers ended); or it is
        no longer draining."""
        since = time.monotonic()
        while w.state is WorkerState.DRAINING:
            s = w.status
            # A heartbeat after draining began shows what it still holds.
            # (``pending``: a call that admits a request there is in flight, or not yet reported)
            if (w.last_seen > since and not holds(w) and not w.pending and s is not None and not s.running
                    and not s.waiting and not s.kv_blocks_used):
                return
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _retire(self, w: Worker, holds: Callable[[Worker], bool]) -> None:
        import ray  # (heavy: Ray, loaded when the cluster starts)
        await self._drained(w, holds)
        log.info("worker %s drained; retiring it", w.worker_id)
        try:
            await within(w.actor.shutdown.remote(), 10)
        except Exception:  # already gone
            pass
        if await asyncio.to_thread(self.liveness.may_kill):
            ray.kill(ha.ray_handle(w.actor), no_restart=True)
        self.workers.pop(w.worker_id, None)
        self.liveness.forget_address(w)
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
        import ray  # (heavy: Ray, loaded when the cluster starts)
        # (ha.enabled: detached workers end only here; a router fenced off leaves them to the newer one)
        for w in self.workers.values() if self.workers and await asyncio.to_thread(self.liveness.may_kill) else ():
            try:
                await within(w.actor.shutdown.remote(), 10)
            except Exception:  # already dead or stuck: the kill below settles it
                pass
            ray.kill(ha.ray_handle(w.actor), no_restart=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()

    # ---- views -------------------------------------------------------------------------------
    def loads(self, *roles: str) -> list[WorkerLoad]:
        return [w.load() for w in self.workers.values() if w.role in roles]

    def still_ready(self, w: Worker | None, roles: tuple[str, ...]) -> bool:
        """``w`` still takes requests in one of ``roles`` (after a call's round trip: it may
        have been lost, retired, or begun to drain or switch roles meanwhile)."""
        return w is not None and w.ready_as(roles)

    def worker(self, worker_id: str) -> Worker:
        return self.workers[worker_id]

    def get(self, worker_id: str) -> Worker | None:
        """The worker, or None if it was retired (or forgotten, gone)."""
        return self.workers.get(worker_id)

    def staffed(self, role: str) -> bool:
        """Some worker of ``role`` is in its pool: serving or coming (back) up, not leaving."""
        return any(w.role == role and w.state.in_pool for w in self.workers.values())

    # ---- calls to workers: each Ray call the router makes to place, free or sweep a request ---
    async def submit(self, w: Worker, key: Key, ids: list[int], params: Any, time_left: float | None,
                     check: int | None) -> bool | Unreachable:
        """``w`` prefills and decodes the request itself (colocated, or a local prefill). False: it
        caches less of the prompt than ``check`` (it took nothing)."""
        return await self._admitting(w, key, "submit",
                                     lambda: w.actor.submit.remote(key, ids, params, time_left, check))

    async def reserve(self, w: Worker, key: Key, ids: list[int], params: Any, time_left: float | None
                      ) -> Reservation | None | Unreachable:
        """``w`` reserves the request's KV; returns what to send there (the transfer's secret, the
        first prompt position it lacks), or None: it is full (not now)."""
        return await self._admitting(w, key, "reserve", lambda: w.actor.reserve.remote(key, ids, params, time_left))

    async def _admitting(self, w: Worker, key: Key, what: str, make: Callable[[], Any]) -> Any:
        """Await an admitting call with the stall deadline (``call``), mapping Ray's errors: a
        lost or stalled worker is ``UNREACHABLE`` (try the others), bad input the worker found
        is its InvalidRequestError, any other error a bug (raised)."""
        from ray.exceptions import RayActorError, RayTaskError  # (heavy: Ray, loaded once the router serves)
        try:
            return await self.liveness.call(w, make())
        except asyncio.CancelledError:
            # The client gave up while the worker takes the call: it would hold the blocks (for
            # the lease, or a whole generation) with nobody left to free them. The abort queues
            # behind the call on the worker (calls run in order).
            self.abort(w, key)
            raise
        except RayActorError as e:
            self.liveness.lost(w, f"{what} failed: {e}")
            return UNREACHABLE
        except RayTaskError as e:  # (before TimeoutError: Ray makes it one if the cause was)
            if isinstance(e.cause, InvalidRequestError):
                raise e.cause from None
            raise
        except TimeoutError:  # stalled (``call``): it is being replaced; try the others
            return UNREACHABLE

    def prefill(self, w: Worker, key: Key, ids: list[int], params: Any, decode_address: str | None,
                reservation: Reservation, time_left: float | None) -> None:
        """``w`` prefills the prompt and sends its KV to the decode worker that reserved it."""
        w.actor.prefill.remote(key, ids, params, decode_address, reservation, time_left)

    def abort(self, w: Worker, key: Key) -> None:
        """Free ``key``'s blocks on ``w`` if its process may hold any (idempotent there)."""
        if w.state.may_hold_blocks:
            w.actor.abort.remote(key)

    async def held(self, timeout_s: float = 10.0) -> list[tuple[Worker, dict[str, int]]] | None:
        """Per worker whose process may hold blocks, the requests holding KV blocks there
        (engine id → blocks); None if one did not answer within ``timeout_s``."""
        ready = [w for w in self.workers.values() if w.state.may_hold_blocks]
        try:
            held = await within(asyncio.gather(*(w.actor.held.remote() for w in ready)), timeout_s)
        except Exception:  # a worker died or stalled meanwhile: no verdict this time
            return None
        return list(zip(ready, held))

    async def release(self, w: Worker, engine_ids: list[str]) -> int:
        """Free these requests' blocks on ``w``; returns the blocks freed."""
        return await self.liveness.call(w, w.actor.release.remote(engine_ids))

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
        return any(w.state.alive for w in self.workers.values() if w.role in roles)

    def _notify(self) -> None:
        """Capacity may have grown (a request ended, a worker came or went): wake admission."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_change(self, timeout: float) -> None:
        """Until the next :meth:`_notify`, or ``timeout`` seconds."""
        try:
            await within(self._changed.wait(), timeout)
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
        if w is not None and w.keep_early(msg):  # (this router adopts it: router.ha ``adopt``)
            return
        self.stale_reports += 1
        if w is None or not w.state.may_hold_blocks or self.clock() - w.checked_at < RESTART_CHECK_S:
            return
        try:
            decode_report(msg, self.key)
        except ProtocolError as e:
            self._bad(e)
            return
        w.checked_at = self.clock()
        log.warning("worker %s: a report of incarnation %s, not its current %s, ignored (%d such so far); "
                    "asking Ray whether it restarted", w.worker_id, incarnation, w.incarnation, self.stale_reports)
        self._spawn(self.liveness.check_restart(w), f"check-{w.worker_id}")
