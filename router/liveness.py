"""Worker liveness for the router's pools: bring-up, loss, stalls, and the calls' deadlines.

``up`` means: its model info answered (same model and, per model folder, the same weights as
the others) and, for a decode worker, every ready prefill worker has connected to its KV
receiver (a prefill worker coming up connects to every ready decode worker; a peer that went
away meanwhile is skipped, and connects when it is back). ``lost`` is any of: Ray reports the
actor RESTARTING or DEAD, or restarted since its bring-up (its restart count grew), asked when
its heartbeat went quiet or when a report of another incarnation arrives (``check_restart``:
a report alone never says so, a captured one could be replayed), a call to it failed with a Ray actor error, or it *stalled*: no report for
``router.stall_s`` while Ray still says ALIVE (stopped, stuck in a kernel, swapping), or a
call the router awaits from it unanswered that long (``call``; fire-and-forget calls, abort,
disconnect and the prefill's ``prefill``, await nothing), and then the router also kills the
process so that Ray starts a fresh one. A lost decode worker's KV address is forgotten by
every prefill worker. The router re-runs that worker's requests elsewhere (``on_lost``) and
this module brings the restarted actor back.

With ``ha.enabled`` (router.ha, worker.fence) each bring-up begins with an adoption, the health
loop pings every serving worker (``ping_period``: a worker no router calls for ``ha.grace_s``
drops everything), a worker that gave up on this router is lost (and adopted again), one a
newer router adopted is left to it (GONE, never killed), and a router fenced off kills nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from router import ha
from router.aio import within
from router.config import ClusterConfig
from router.worker_state import Role, Worker, WorkerState
from worker.fence import FencedError
from worker.protocol import ModelInfo

log = logging.getLogger("pdserve.router")

HEALTH_PERIOD_S = 0.25
QUIET_S = 1.0  # a heartbeat older than this makes the router ask Ray whether the actor lives
HANDSHAKE_S = 10.0  # KVSender.connect's own bound on a KV handshake (a call may wait that long)
LOAD_TIMEOUT_S = 1800.0  # a worker whose model has not loaded in this long is stuck: replaced
MAX_GONE = 16  # workers Ray cannot bring back, kept for `pdserve status`; older ones are forgotten


class Liveness:
    """Keeps the pools' workers alive and their KV connected (owned by :class:`router.pools.Pools`).

    Args:
        cfg: the cluster config (``router.stall_s`` is read at each use).
        workers: the pools' workers by id (shared: liveness changes their state, and forgets
            the oldest gone ones).
        on_lost: called with the worker when it is lost; its requests must move elsewhere.
        spawn: runs a coroutine in the background under a name (the pools cancel it at stop).
        notify: capacity may have changed (a worker came or went): wakes admission.
        actor_state: (state, restart count) of an actor in Ray's GCS, blocking (tests replace it).
    """

    def __init__(self, cfg: ClusterConfig, workers: dict[str, Worker], on_lost: Callable[[Worker], None],
                 spawn: Callable[[Any, str], Any], notify: Callable[[], None],
                 actor_state: Callable[[Any], tuple[str, int | None]] | None = None) -> None:
        self.cfg, self.workers, self.on_lost = cfg, workers, on_lost
        self._spawn, self._notify = spawn, notify
        self.actor_state = actor_state or _actor_state
        # ha.enabled (set by the pools at start, router.ha): the first step of each bring-up, and
        # whether this router may end worker processes (blocking; a fenced-off one may not)
        self.adopt: Callable[[Worker], Awaitable[None]] | None = None
        self.may_kill: Callable[[], bool] = lambda: True
        self._pinged = 0.0  # (ha.enabled) when the last round of pings went
        self.model_info: ModelInfo | None = None  # the first worker's; every other must match it
        self._weights: dict[str, str] = {}  # model folder name -> the weights digest the first worker loaded

    def forget_address(self, w: Worker) -> None:
        """A decode (or adaptive) worker's KV receiver address is dead (lost, retired): every
        worker that sends KV forgets it, so their per-peer tables do not grow with restarts."""
        if w.role is Role.COLOCATED or w.address is None:
            return
        for p in self.workers.values():
            if p is not w and (p.role is Role.PREFILL or p.adaptive) and p.state.may_hold_blocks:
                p.actor.disconnect.remote(w.address)
        w.address = None

    async def call(self, w: Worker, ref: Any, timeout_s: float | None = None) -> Any:
        """Await one call to ``w`` with a deadline (``router.stall_s`` by default). Unanswered:
        the worker is stalled and TimeoutError is raised; a serving worker is lost (its
        requests move) and its process replaced, one coming up has its process replaced before
        its bring-up tries again. An error the call raised in the worker comes back as Ray's
        RayTaskError (which Ray also makes an instance of the error's own class, so a worker's
        TimeoutError is no stall)."""
        from ray.exceptions import RayTaskError  # (heavy: Ray, loaded when the cluster starts)
        timeout_s = timeout_s or self.cfg.router.stall_s
        try:
            return await within(ref, timeout_s)
        except RayTaskError:
            raise
        except TimeoutError:
            if w.state.may_hold_blocks:
                self.stalled(w, f"a call did not answer in {timeout_s:g}s")
            else:
                log.warning("worker %s did not answer while coming up; replacing its process", w.worker_id)
                await asyncio.to_thread(self._kill, w.actor)
            raise

    def stalled(self, w: Worker, why: str) -> None:
        """Alive to Ray but not answering (stopped, stuck in a kernel, swapping): its requests
        move now, and a fresh process replaces it (a SIGSTOPped one cannot exit by itself)."""
        if w.state.may_hold_blocks:
            self.lost(w, f"stalled: {why}")
            self._spawn(asyncio.to_thread(self._kill, w.actor), f"kill-{w.worker_id}")

    def lost(self, w: Worker, why: str) -> None:
        """Mark ``w`` lost (idempotent per incarnation) and bring it back in the background;
        a draining worker is not brought back (it is gone, and its retirement completes), but
        one switching roles is, in its new role."""
        if not w.state.may_hold_blocks:
            return
        log.warning("worker %s lost (%s); its requests move to other workers", w.worker_id, why)
        # (switching roles: it comes back in the new one)
        back = w.state is WorkerState.READY or w.next_role is not None
        if w.next_role is not None:
            w.role, w.next_role = w.next_role, None
        w.state = WorkerState.DEAD if back else WorkerState.GONE
        w.reported(None)
        w.restarts += 1
        self.on_lost(w)
        self.forget_address(w)
        self._notify()
        if back:
            self._spawn(self.bring_up(w), f"up-{w.worker_id}")

    async def bring_up(self, w: Worker) -> None:
        try:
            await self._bring_up(w)
        finally:
            w.kept = frozenset()  # (for an adoption tried again within this bring-up only: router.ha)

    async def _bring_up(self, w: Worker) -> None:
        # (heavy: Ray, loaded when the cluster starts)
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
        # The incarnation known before this bring-up, read once: a first adoption sets it
        # (router.ha ``adopt``), and a try after that one failed later on (a peer's handshake)
        # must not take the adopted worker for one that outlived being lost and free its blocks.
        known = w.incarnation
        while True:
            try:
                # Ray's restart count before its incarnation is read: a restart after this shows
                # as a higher count (``check_restart``), one before it as a new incarnation.
                restarts = (await asyncio.to_thread(self.actor_state, w.actor))[1]
                info = await self._connect(w)
                if info.incarnation == known:
                    # The process outlived being lost (its kill failed): every request it holds
                    # was moved elsewhere, so its blocks are nobody's. Free them all now.
                    held = await self.call(w, w.actor.held.remote())
                    freed = await self.call(w, w.actor.release.remote(list(held)))
                    log.warning("worker %s came back as the same process; freed %d blocks of %d requests "
                                "it no longer runs", w.worker_id, freed, len(held))
                break
            except RayTaskError as e:  # (before TimeoutError: Ray makes it one if the cause was)
                if isinstance(e.cause, FencedError) and not e.cause.orphaned:  # a newer router has it
                    self._fenced_off(w, e.cause)
                    return
                if not isinstance(e.cause, (ConnectionError, TimeoutError)):  # e.g. another model's layout
                    log.error("worker %s cannot serve: %s", w.worker_id, e)
                    self._gone(w)
                    return
                # A peer it connects to went away meanwhile (killed, restarting): try again.
                log.warning("worker %s: %s; trying again", w.worker_id, e.cause)
                await asyncio.sleep(1.0)
            except (ActorUnavailableError, TimeoutError):  # Ray is restarting it, or it stalled
                await asyncio.sleep(0.2)
            except RayActorError as e:  # dead for good (restarts exhausted, node gone)
                log.error("worker %s is gone: %s", w.worker_id, e)
                self._gone(w)
                return
            except RuntimeError as e:  # another model or other weights than the other workers
                log.error("worker %s cannot serve: %s", w.worker_id, e)
                self._gone(w)
                return
        if info.incarnation != w.incarnation:  # a new process: its reports count from 1
            w.seq = 0  # (the same one, back: never reset, or its earlier reports would replay)
        w.info, w.incarnation, w.last_seen, w.ray_restarts = info, info.incarnation, time.monotonic(), restarts
        w.state = WorkerState.READY
        self._notify()

    def _gone(self, w: Worker) -> None:
        """Ray cannot bring ``w`` back, or it cannot serve here (another model or weights): its
        process, if any, is ended, so that it holds no GPU, no pool resource and no memory."""
        w.state = WorkerState.GONE
        self.forget_address(w)
        self._spawn(asyncio.to_thread(self._kill, w.actor, False), f"kill-{w.worker_id}")
        gone = [x for x in self.workers.values() if x.state is WorkerState.GONE]
        for x in gone[:max(0, len(gone) - MAX_GONE)]:  # the oldest first (insertion order)
            del self.workers[x.worker_id]
        self._notify()

    def _kill(self, actor: Any, restart: bool = True) -> None:
        """``_kill``, unless this router may not (``may_kill``). Blocking."""
        if self.may_kill():
            _kill(ha.ray_handle(actor), restart)

    async def _connect(self, w: Worker) -> ModelInfo:
        """Check the worker's model and wire its KV connections; returns its model info. A
        peer that does not connect (it died or restarts meanwhile) is skipped: when it comes
        back up, its own bring-up connects it to every ready worker of the other pool."""
        if self.adopt is not None:  # (ha.enabled: it reports here and obeys this router from now on)
            await self.adopt(w)
        info = await self.call(w, w.actor.model_info.remote(), LOAD_TIMEOUT_S)  # waits while its model loads
        if self.model_info and info.fingerprint != self.model_info.fingerprint:
            raise RuntimeError(f"{w.worker_id} serves another model: {info.model}")
        # The same folder (by name: the bundled one sits in each node's own cache) must hold the
        # same weights everywhere; a decode pool's quantized checkpoint is another folder.
        want = self._weights.setdefault(Path(info.model).name, info.weights)
        if info.weights != want:
            raise RuntimeError(f"{w.worker_id} loaded other weights than the other workers ({info.model}, "
                               f"digest {info.weights} vs {want}): its node's copy differs")
        self.model_info = self.model_info or info
        if w.role is not Role.PREFILL or w.adaptive:  # (an adaptive worker may decode later)
            w.address = await self.call(w, w.actor.address.remote())
        await self.wire(w)
        w.reported(None)
        w.reported(await self.call(w, w.actor.status.remote()))  # placement needs a load now
        return info

    async def wire(self, w: Worker) -> None:
        """Connect ``w``'s KV for its role: every ready prefill worker to a decode worker, a
        prefill worker to every ready decode worker."""
        from ray.exceptions import RayTaskError  # (heavy: Ray, loaded when the cluster starts)
        deadline = self.cfg.router.stall_s + HANDSHAKE_S  # a connect waits for a handshake
        if w.role is not Role.PREFILL:
            prefills = [p for p in self.workers.values() if p.ready_as((Role.PREFILL,))]
            answers = await asyncio.gather(*(within(p.actor.connect.remote(w.address), deadline)
                                             for p in prefills), return_exceptions=True)
            for p, a in zip(prefills, answers):
                if isinstance(a, TimeoutError) and not isinstance(a, RayTaskError):  # that prefill worker
                    self.stalled(p, "it did not connect to a new decode worker")  # stalled; back, it connects
                elif isinstance(a, BaseException):  # it died or failed the handshake: back, it connects
                    log.warning("prefill worker %s did not connect to %s: %r", p.worker_id, w.worker_id, a)
        else:
            # One at a time (the worker takes them in turn anyway), each with its own deadline:
            # a stopped decode worker costs one handshake timeout, not this worker's bring-up.
            for d in [d for d in self.workers.values() if d.ready_as((Role.DECODE,))]:
                try:
                    await self.call(w, w.actor.connect.remote(d.address), deadline)
                except RayTaskError as e:  # that decode worker went away meanwhile; back, it connects
                    log.warning("%s did not connect to %s: %s", w.worker_id, d.worker_id, e.cause)

    async def health(self) -> None:
        """Ask Ray about workers whose heartbeat went quiet (a long step is not death); with
        ha.enabled, call every serving worker every ``ping_period`` (its grace period restarts)."""
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            now = time.monotonic()
            if self.adopt is not None and now - self._pinged >= ping_period(self.cfg.ha.grace_s):
                self._pinged = now
                for w in self.workers.values():
                    if w.state.may_hold_blocks:
                        self._spawn(self._ping(w), f"ping-{w.worker_id}")
            for w in list(self.workers.values()):
                if w.state.may_hold_blocks and now - w.last_seen > QUIET_S:
                    if await self.check_restart(w):
                        continue
                    if now - w.last_seen > self.cfg.router.stall_s:
                        # Alive to Ray but silent (a step never takes this long). ``stalled``
                        # reads the state again: another path may have marked it lost while Ray
                        # answered, and a process already restarted must not be killed.
                        self.stalled(w, f"no report for {now - w.last_seen:.0f}s (router.stall_s)")

    async def _ping(self, w: Worker) -> None:
        """One ping (ha.enabled). Refused because the worker gave up on this router (its
        grace period passed while this router was silent: stopped, or its pings lost): it is
        lost, and its bring-up adopts it again. Fenced off by a newer router: it is left to it.
        Any other failure is the stall and restart checks' to judge."""
        from ray.exceptions import RayTaskError  # (heavy: Ray, loaded when the cluster starts)
        try:
            await within(w.actor.ping.remote(), self.cfg.router.stall_s)
        except RayTaskError as e:
            if isinstance(e.cause, FencedError) and w.state.may_hold_blocks:
                if e.cause.orphaned:
                    self.lost(w, "it gave up on this router (ha.grace_s passed without a call)")
                else:
                    self._fenced_off(w, e.cause)
        except Exception:  # (lost, stalled: judged by the heartbeat checks)
            pass

    def _fenced_off(self, w: Worker, e: FencedError) -> None:
        """A newer router adopted ``w`` (ha.enabled): this one leaves it (GONE, its requests
        moved if it served them); its process is that router's, never ended here."""
        log.error("worker %s: %s; leaving it to that router", w.worker_id, e)
        serving = w.state.may_hold_blocks
        w.state = WorkerState.GONE
        if serving:
            self.on_lost(w)
        self._notify()

    async def check_restart(self, w: Worker) -> bool:
        """Ask Ray whether ``w``'s actor restarted (RESTARTING, DEAD, or a restart count above
        the one before its bring-up); if so it is lost. Returns whether it was."""
        state, restarts = await asyncio.to_thread(self.actor_state, w.actor)
        if not w.state.may_hold_blocks:  # (lost meanwhile by another path)
            return False
        if state in ("RESTARTING", "DEAD"):
            self.lost(w, f"Ray reports it {state}")
        elif restarts is not None and w.ray_restarts is not None and restarts > w.ray_restarts:
            self.lost(w, f"Ray reports it restarted ({restarts} restarts, {w.ray_restarts} at its bring-up)")
        else:
            return False
        return True


def ping_period(grace_s: float) -> float:
    """How often an HA router calls each worker: several times per grace period, at most once a second."""
    return min(1.0, grace_s / 4)


def _kill(actor: Any, restart: bool = True) -> None:
    """Kill the actor's process; Ray restarts it (max_restarts=-1) unless ``restart`` is False."""
    import ray  # (heavy: Ray, loaded when the cluster starts)
    try:
        ray.kill(actor, no_restart=not restart)
    except Exception as e:  # already gone: Ray restarts it or reports it dead either way
        log.warning("could not kill a stalled worker: %s", e)


def _actor_state(actor: Any) -> tuple[str, int | None]:
    """The actor's state in Ray's GCS (ALIVE, RESTARTING, DEAD...) and its restart count;
    ("UNKNOWN", None) if unavailable."""
    try:
        from ray._private import state  # (heavy: Ray) no public API answers this without the dashboard
        # Ray 2.60's ActorHandle has no public id accessor (``_actor_id`` is all it offers;
        # ``get_runtime_context().get_actor_id()`` answers only inside the actor itself).
        actor = ha.ray_handle(actor)  # (the Ray handle behind an HA router's FencedActor)
        info = state.actors(actor_id=actor._actor_id.hex())
        restarts = info.get("NumRestarts")
        return info.get("State", "UNKNOWN"), restarts if isinstance(restarts, int) else None
    except Exception:  # an API change must not take the router down: heartbeats still work
        return "UNKNOWN", None

