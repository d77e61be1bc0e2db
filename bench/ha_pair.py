"""Routers of one HA cluster as real ``pdserve serve`` processes (router.leader, router.standby),
for the router faults of bench/chaos_router.py and tests/cluster/test_leader.py: start one
(on given ports, so a client's ``--server a,b`` list stays valid across a restart), ask which
one serves, read the worker processes the leader holds (``in_ray``: from a driver of their own).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc

from pdserve.v1 import pdserve_pb2 as pb
from router.client import connect


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """One ``pdserve serve`` process, its ports and a stub on its gRPC port alone."""

    def __init__(self, config, gcs: str, log, port: int | None = None, http_port: int | None = None,
                 env: dict | None = None) -> None:
        self.port, self.http_port = port or free_port(), http_port or free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", "serve", "--config",
                                      str(config), "--address", gcs, "--port", str(self.port),
                                      "--http-port", str(self.http_port)], stdout=log, stderr=log, env=env)

    @property
    def stub(self):
        return connect(f"127.0.0.1:{self.port}")  # (a new channel: see ``serves``)

    def serves(self) -> bool:
        """Whether it answers on a new channel (one refused a moment ago would be backing off)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            try:
                ch.unary_unary("/pdserve.v1.Generation/GetModelInfo", pb.GetModelInfoRequest.SerializeToString,
                               pb.ModelInfo.FromString)(pb.GetModelInfoRequest(), timeout=1)
                return True
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                return False

    def http_status(self) -> int | None:
        """The OpenAI port's answer (None: it refused the connection, between two states)."""
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v1/models", timeout=2).status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return None

    def stands_by(self) -> bool:
        """Up, and refusing on both ports (router.standby) rather than serving."""
        return self.proc.poll() is None and self.http_status() == 503 and not self.serves()


class NoLeader(RuntimeError):
    """No router of the pair served within the time given, or two did at once."""


def leader(routers: list[Router], timeout: float) -> Router:
    """The one router that serves, once one does (the others must refuse)."""
    deadline = time.monotonic() + timeout
    while True:
        if any(r.proc.poll() is not None for r in routers):
            raise NoLeader("a pdserve serve exited")
        serving = [r for r in routers if r.serves()]
        if len(serving) > 1:
            raise NoLeader("two routers serve at once")
        if serving:
            return serving[0]
        if time.monotonic() > deadline:
            raise NoLeader(f"no router leads after {timeout} s")
        time.sleep(0.1)


def in_ray(gcs: str, env: dict | None, fn: str, name: str):
    """``fn(name)`` of this module, run by a driver process of its own on the Ray at ``gcs``:
    this one stays off Ray, whose driver would exit with a head it was attached to."""
    code = ("import json, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
            "from bench import ha_pair; print(json.dumps(getattr(ha_pair, sys.argv[2])(sys.argv[3])))")
    r = subprocess.run([sys.executable, "-c", code, gcs, fn, name], env=env, capture_output=True, text=True,
                       timeout=180)
    if r.returncode:
        raise RuntimeError(f"{fn}({name}) on the Ray at {gcs} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def end_workers(name: str) -> int:
    """End HA cluster ``name``'s workers and lease that outlived its routers; how many workers."""
    # (heavy: Ray, joined by the caller)
    import ray
    from router import ha, leader as lease
    left = ha.find_workers(name)
    for handle in left.values():
        ray.kill(handle, no_restart=True)
    try:
        ray.kill(ray.get_actor(lease.lease_name(name), namespace=ha.NAMESPACE), no_restart=True)
    except ValueError:
        pass
    return len(left)


def worker_pids(name: str) -> dict[str, int]:
    """Each worker of HA cluster ``name`` and its process id, asked under the current epoch
    (the caller must have joined the cluster's Ray)."""
    # (heavy: Ray, joined by the caller)
    import ray
    from router import ha
    epoch = ha.current_epoch(name)
    return {wid: ray.get(h.call.remote(epoch, "status"), timeout=30).pid for wid, h in ha.find_workers(name).items()}
