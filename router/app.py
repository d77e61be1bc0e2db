"""Starting and stopping a whole cluster: Ray (local or joined), the pools, the gRPC server.

``serve`` is what ``pdserve serve`` runs (foreground, Ctrl-C stops it cleanly);
``BackgroundCluster`` runs the same in a thread, for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from collections.abc import Callable

from router.config import ClusterConfig


def _say(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def init_ray(cfg: ClusterConfig, address: str | None = None, temp_dir: str | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a private local one sized for ``cfg``.

    The local one: dashboard off, no auth token file, its own temp dir, on loopback, with the
    ``prefill``/``decode`` resources the pools are placed by.
    """
    import ray
    env = {"env_vars": {"UCX_WARN_UNUSED_ENV_VARS": "n"}}
    if address is not None:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local: no ~/.ray/auth_token
    colocated = cfg.mode == "colocated"
    auto = cfg.autoscale
    n_prefill = 0 if colocated else max(cfg.prefill.replicas, auto.prefill.max_replicas if auto.enabled else 0)
    n_decode = max(cfg.decode.replicas, auto.decode.max_replicas if auto.enabled else 0)
    threads = n_decode * cfg.decode.threads + n_prefill * cfg.prefill.threads
    ray.init(num_cpus=max(os.cpu_count() or 1, threads), include_dashboard=False, log_to_driver=False,
             resources={"prefill": n_prefill, "decode": n_decode},
             _temp_dir=temp_dir or tempfile.mkdtemp(prefix="pdserve-ray-"),
             _node_ip_address="127.0.0.1", runtime_env=env)


async def start_cluster(cfg: ClusterConfig, host: str, port: int, progress: Callable[[str], None] = _say):
    """Resolve the model (the bundled one is converted here once), start the pools, serve.

    Returns:
        (router, grpc server, bound port)
    """
    from engine.models.loader import resolve_model_path
    from router.server import Router, start_server
    model_path = str(await asyncio.to_thread(resolve_model_path, cfg.model, True))
    router = Router(cfg, model_path)
    await router.start(progress)
    server, bound = await start_server(router, host, port)
    progress(f"serving pdserve.v1.Generation on {host}:{bound} ({cfg.mode})")
    return router, server, bound


async def stop_cluster(router, server) -> None:
    await server.stop(grace=1.0)
    await router.stop()


def serve(cfg: ClusterConfig, address: str | None, host: str, port: int) -> int:
    """Foreground server until Ctrl-C (or SIGTERM)."""
    import logging
    import signal

    import ray
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    init_ray(cfg, address)

    async def main() -> None:
        router, server, _ = await start_cluster(cfg, host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        _say("shutting down ...")
        await stop_cluster(router, server)

    try:
        asyncio.run(main())
    finally:
        ray.shutdown()
    return 0


class BackgroundCluster:
    """The router and its pools on an event loop in a thread (Ray must be initialized).

    ``port`` is the bound gRPC port; ``call(coro_fn)`` runs a coroutine on the router's loop.
    """

    def __init__(self, cfg: ClusterConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.stopped = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="router", daemon=True)
        self.thread.start()
        self.router, self.server, self.port = self.call(lambda: start_cluster(cfg, host, port, lambda s: None))

    def call(self, coro_fn, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self) -> None:
        self.stopped = True
        self.call(lambda: stop_cluster(self.router, self.server))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
