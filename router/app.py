"""Starting and stopping a whole cluster: Ray (local or joined), the pools, the gRPC server.

``serve`` is what ``pdserve serve`` runs (foreground); ``BackgroundCluster`` runs the same in
a thread, for tests and benchmarks.

Stopping (SIGTERM or Ctrl-C; ``stop_cluster``): the router drains first (router.drain): health
turns NOT_SERVING on both ports, new requests are refused with a retry hint (HTTP 503 +
``Retry-After``, gRPC UNAVAILABLE), and the running ones get ``front_door.shutdown_grace_s``
(30 s) to finish. Then the servers stop, aborting what still runs, and the pools are shut down.
A second signal ends the wait at once.

With ``ha.enabled``, ``pdserve serve`` is one of the cluster's routers (``serve_ha``): it stands
by (router.standby: its ports refuse) until it holds the leader lease (router.leader), then
leads: starts or adopts the workers and serves. A leader whose lease is lost (it stalled, or
could not renew) stops serving at once, ends no worker (the next leader adopts them) and stands
by again. A leader stopped by a signal drains, gives the lease up, and ends the workers only
if no standby asked for the lease lately (else it leaves them to the one that takes over).

Reloading (SIGHUP; ``reload_security``): the tokens file and the policy file
(``security.policy_file``) are read again and take effect for the next call: a token no longer
in the file is refused from then on (its requests already running may finish), new limits
apply to new requests. A file that cannot be read or parsed changes nothing (the error is
logged); neither does a reload that would turn tokens off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from router.auth import front_door, load_tokens
from router.config import ClusterConfig
from router.drain import Gate
from router.leader import Elector, lease_actor
from router.nodes import check_model
from router.policy import load_policy
from router.server import Router, start_server
from router.standby import StandbyPorts

log = logging.getLogger("pdserve.router")

def _say(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


# Every actor's, on any cluster. RAY_worker_niceness: Ray starts its worker processes at nice 15
# by default (its driver and daemons first); pdserve's workers are the engines, and at 15 any
# nice-0 process (the router, a client, Ray's daemons) preempts a step, a thread of its team left
# waiting at the next barrier. The raylet reads it from the worker's env. Measured (colocated,
# SmolLM2, the headline mix, 2 rounds each): chats' TPOT p50 32 -> 27-29 ms, TTFT p50 241 -> 196-218.
ACTOR_ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "RAY_worker_niceness": "0"}


def local_ray_env() -> dict:
    """For a private local Ray: set this process's environment (its Ray children inherit it)
    and return the runtime env for the actors.

    A local cluster talks to no other machine: Ray's own servers (GCS, raylet, each worker's,
    the agents) then bind loopback as Ray does on macOS, instead of every interface, and so do
    pdserve's control socket, worker /metrics and KV endpoints, which listen on the node IP;
    UCX's TCP transport listens on ``lo`` only (``UCX_NET_DEVICES``, unless set). No
    ``~/.ray/auth_token`` is written: nothing beyond this machine can reach the cluster.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's children read it at start
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        # ... and Ray reads it once, when first imported: in this process it may already be.
        from ray._private import ray_constants  # (heavy: Ray, loaded when the cluster starts)
        ray_constants.ENABLE_RAY_CLUSTER = False
    return {"env_vars": {**ACTOR_ENV, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}}


def init_ray(cfg: ClusterConfig, address: str | None = None, temp_dir: str | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a private local one sized for ``cfg``.

    The local one (``local_ray_env``): every listener on loopback, dashboard off, no auth token
    file, its own temp dir, with the ``prefill``/``decode`` resources the pools are placed by.
    """
    import ray  # (heavy: Ray, loaded when the cluster starts)
    if address is not None:
        ray.init(address=address, runtime_env={"env_vars": ACTOR_ENV}, log_to_driver=False)
        return
    colocated = cfg.mode == "colocated"
    auto = cfg.autoscale
    n_prefill = 0 if colocated else max(cfg.prefill.replicas, auto.prefill.max_replicas if auto.enabled else 0)
    n_decode = max(cfg.decode.replicas, auto.decode.max_replicas if auto.enabled else 0)
    threads = n_decode * cfg.decode.threads + n_prefill * cfg.prefill.threads
    start_local_ray(max(os.cpu_count() or 1, threads), {"prefill": n_prefill, "decode": n_decode}, temp_dir)


_own_ray: set[str] = set()  # the GCS addresses of the Rays this process started (start_local_ray)


def start_local_ray(num_cpus: int, resources: dict[str, float], temp_dir: str | None = None) -> None:
    """Start a private local Ray (``local_ray_env``) with ``resources`` for the pools; its
    temp dir ``temp_dir`` or a fresh one."""
    import ray  # (heavy: Ray, loaded when the cluster starts)
    env = local_ray_env()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, resources=resources,
             _temp_dir=temp_dir or tempfile.mkdtemp(prefix="pdserve-ray-"),
             _node_ip_address="127.0.0.1", runtime_env=env)
    _own_ray.add(ray.get_runtime_context().gcs_address)


def _check_nodes() -> bool:
    """Whether the worker nodes' models need checking against the head's: not on a Ray this
    process started, whose one node is this machine and whose workers inherit this process's
    environment (its HOME, so its model cache): they resolve what the head resolved. (The check
    runs a Ray task in a new process that loads torch: seconds of every local start.)"""
    import ray  # (heavy: Ray, loaded when the cluster starts)
    return not (ray.is_initialized() and ray.get_runtime_context().gcs_address in _own_ray)


async def start_cluster(cfg: ClusterConfig, host: str, port: int, progress: Callable[[str], None] = _say,
                        door=None, http_port: int | None = -1):
    """Resolve the model (the bundled one is converted here once), start the pools, serve gRPC
    and (``http_port``; -1: ``router.http_port``; None: off) the OpenAI HTTP API.

    Returns:
        (router, grpc server, bound port); ``router.http`` is the HTTP server (or None) and
        ``router.http_port`` its bound port.
    """
    from engine.models.loader import resolve_model_path, weights_digest  # (heavy: torch, through the engine)
    door = door or front_door(cfg.security, host)  # a bad file or an open door stops the start here
    model_path = str(await asyncio.to_thread(resolve_model_path, cfg.model, True))
    # Each worker node resolves the model itself (its own cache, its own folder): all must hold
    # the head's weights, or serving does not start (one error naming each node that differs).
    nodes = await asyncio.to_thread(check_model, cfg.model, weights_digest(Path(model_path))) if _check_nodes() else []
    if len(nodes) > 1:
        progress(f"model checked on {len(nodes)} worker nodes: {', '.join(n.node_ip for n in nodes)}")
    router = Router(cfg, model_path, door)
    await router.start(progress)
    server, bound = await start_server(router, host, port)
    http_port = cfg.router.http_port if http_port == -1 else http_port
    if http_port is not None:
        from router.openai_http import start_http  # (optional: fastapi and uvicorn load only when it serves)
        try:
            router.http, router.http_port = await start_http(router, host, http_port, cfg.security)
        except BaseException:
            await stop_cluster(router, server)
            raise
    how = ", ".join(x for x, on in (("TLS", door.tls), ("client certificates", door.tls and door.tls.client_ca),
                                    (f"{len(door.auth.tokens)} tokens", door.auth.enabled)) if on)
    progress(f"serving pdserve.v1.Generation on {host}:{bound} ({cfg.mode}; {how or 'plaintext, no auth'})")
    if router.http is not None:
        scheme = "https" if door.tls else "http"
        progress(f"serving the OpenAI API on {scheme}://{host}:{router.http_port}/v1 "
                 f"(model {router.served_model_name!r})")
    return router, server, bound


async def stop_cluster(router, server, grace_s: float = 0.0, progress: Callable[[str], None] | None = None) -> None:
    """Drain (see the module doc; running requests get ``grace_s``), then stop the servers and
    the pools."""
    await _drain(router.door.gate, grace_s, progress)
    if router.http is not None:
        await router.http.stop()
    await server.stop(grace=1.0)
    await router.stop()


async def _drain(gate: Gate, grace_s: float, progress: Callable[[str], None] | None) -> int:
    """``gate.drain(grace_s)``, saying what runs and what is left; returns what is left."""
    if progress is not None and gate.active:
        progress(f"draining: {gate.active} requests running get up to {grace_s:g} s to finish "
                 "(a second signal stops now) ...")
    left = await gate.drain(grace_s)
    if progress is not None and left:
        progress(f"aborting {left} requests still running")
    return left


def _shutting_down(loop: asyncio.AbstractEventLoop, gate: Gate) -> None:
    """Say so; from now on a second SIGINT or SIGTERM stops waiting for running requests."""
    _say("shutting down: health NOT_SERVING, new requests refused ...")
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, gate.hurry)


def reload_security(router, sec, env: dict[str, str] | None = None) -> bool:
    """Read the tokens and the policy again (SIGHUP) and swap them in; False (and nothing
    changed) if either file is bad, or tokens would turn off. ``sec``: router.config.SecurityConfig."""
    auth = router.door.auth
    try:
        tokens = load_tokens(sec.tokens_file, env)
        policy = load_policy(sec.policy_file)
    except ValueError as e:  # (SecurityError, PolicyError)
        log.error("reload refused, the tokens and policy stay as they were: %s", e)
        return False
    if auth.enabled and not tokens:
        log.error("reload refused: no token left would serve without authentication (restart to do that)")
        return False
    gone = len(set(auth.tokens) - set(tokens))
    auth.tokens = tokens
    router.admission.reload(policy)
    log.info("reloaded %d tokens (%d revoked) and the policy of %d token names", len(tokens), gone,
             len(policy.tokens))
    return True


def install_signals(loop: asyncio.AbstractEventLoop, router, sec, stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop``; SIGHUP reloads the tokens and the policy (``reload_security``)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_security, router, sec)


def serve(cfg: ClusterConfig, address: str | None, host: str, port: int) -> int:
    """Foreground server until Ctrl-C (or SIGTERM); SIGHUP reloads tokens and policy."""
    import ray  # (heavy: Ray, loaded when the cluster starts)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    door = front_door(cfg.security, host)  # before Ray starts: a bad file or an open door stops here
    init_ray(cfg, address)

    async def main() -> None:
        if cfg.ha.enabled:
            return await serve_ha(cfg, host, port, door)
        router, server, _ = await start_cluster(cfg, host, port, door=door)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        install_signals(loop, router, cfg.security, stop)
        await stop.wait()
        _shutting_down(loop, router.door.gate)
        await stop_cluster(router, server, cfg.front_door.shutdown_grace_s, _say)

    try:
        asyncio.run(main())
    finally:
        ray.shutdown()
    return 0


async def serve_ha(cfg: ClusterConfig, host: str, port: int, door) -> None:
    """``serve`` with ``ha.enabled`` (the module docstring): stand by, lead while the lease
    lasts, stand by again; until SIGINT or SIGTERM."""
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _standby_hup(loop)
    lease = await asyncio.to_thread(lease_actor, cfg.ha.cluster_name, cfg.ha.lease_s)
    await asyncio.to_thread(_warm, cfg)
    elector = Elector(lease, f"{host}:{port}/pid {os.getpid()}", cfg.ha.lease_s)
    while not stop.is_set():
        ports = StandbyPorts(host, port, cfg.router.http_port)
        await ports.start()
        _say(f"standby of cluster {cfg.ha.cluster_name!r} on {host}:{ports.port}: its ports refuse until it leads")
        taking, stopping = asyncio.ensure_future(elector.acquire()), asyncio.ensure_future(stop.wait())
        await asyncio.wait([taking, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        await ports.stop()
        if not taking.done():
            taking.cancel()
            await elector.release()  # (no longer a standby a leader may leave its workers to)
            return
        _say(f"leading cluster {cfg.ha.cluster_name!r} (lease term {elector.term})")
        await _lead(cfg, host, port, door, elector, stop)


def _standby_hup(loop: asyncio.AbstractEventLoop) -> None:
    """SIGHUP while not leading: nothing to reload (and not the default action: ending the process)."""
    loop.add_signal_handler(signal.SIGHUP, _say, "SIGHUP ignored: a standby serves nothing (send it to the leader)")


def _warm(cfg: ClusterConfig) -> None:
    """Load now what a term's start would load on the event loop (seconds of imports, the
    model's folder): a standby that takes over starts sooner."""
    import transformers  # noqa: F401  (heavy: the tokenizer's, imported by the Router)

    from engine.models.loader import resolve_model_path  # (heavy: torch, through the engine)
    if cfg.router.http_port is not None:
        import router.openai_http  # noqa: F401  (optional: fastapi and uvicorn, for the OpenAI API)
    resolve_model_path(cfg.model, True)


async def _lead(cfg: ClusterConfig, host: str, port: int, door, elector: Elector, stop: asyncio.Event) -> None:
    """One term as the leader: serve until ``stop`` (drain, give the lease up) or the lease is lost."""
    keeping = asyncio.create_task(elector.hold(), name="lease")
    door = dataclasses.replace(door, gate=Gate())  # (a drained gate stays drained: each term its own)
    door.gate.holds = elector.leading  # every call asks: a router whose lease passed serves nothing
    try:
        router, server, _ = await start_cluster(cfg, host, port, door=door)
    except BaseException:
        if keeping.done():  # (lost the lease while starting: stand by again)
            log.exception("lost the lease while starting: %s", keeping.result())
            return
        keeping.cancel()
        await elector.release()
        raise
    liveness = router.pools.liveness
    may_kill = liveness.may_kill  # (router.ha: unless fenced off) ... and only while it leads
    liveness.may_kill = lambda: elector.leading() and may_kill()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reload_security, router, cfg.security)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([keeping, stopping], return_when=asyncio.FIRST_COMPLETED)
    _standby_hup(loop)
    if keeping.done():  # the lease is lost: another router may lead the workers already
        stopping.cancel()
        _say(f"lost the leader lease ({keeping.result()}): serving nothing, leaving the workers to the next leader")
        await stop_cluster(router, server)  # (no kill: it leads no more)
        return
    _shutting_down(loop, door.gate)
    await _drain(door.gate, cfg.front_door.shutdown_grace_s, _say)
    lost = keeping.done()  # (while draining: another router may lead them already)
    keeping.cancel()
    handed = await elector.release()
    if handed:
        _say("a standby waits for the lease: the workers are left to it")
    liveness.may_kill = (lambda: False) if handed or lost else may_kill
    await stop_cluster(router, server)


class BackgroundCluster:
    """The router and its pools on an event loop in a thread (Ray must be initialized).

    ``port`` is the bound gRPC port, ``http_port`` the OpenAI API's (a free one unless given;
    None: off); ``call(coro_fn)`` runs a coroutine on the router's loop.
    """

    def __init__(self, cfg: ClusterConfig, host: str = "127.0.0.1", port: int = 0, http_port: int | None = 0) -> None:
        self.stopped = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="router", daemon=True)
        self.thread.start()
        self.router, self.server, self.port = self.call(
            lambda: start_cluster(cfg, host, port, lambda s: None, http_port=http_port))
        self.http_port = self.router.http_port  # the OpenAI API's bound port (None: off)

    def call(self, coro_fn, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop as ``pdserve serve`` does on SIGTERM, with ``grace_s`` for running requests."""
        self.stopped = True
        self.call(lambda: stop_cluster(self.router, self.server, grace_s), timeout=300 + grace_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
