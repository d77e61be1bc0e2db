"""A real cluster per test module: local Ray actors, gRPC on a socket, KV over UCX."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdserve.v1 import pdserve_pb2 as pb

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"


@pytest.fixture(scope="module")
def make_cluster(ray_session):
    """Start a cluster from deploy/local.yaml with overrides; stopped after the module."""
    from router.app import BackgroundCluster
    from router.config import load_config
    started = []

    def make(**overrides):
        overrides.setdefault("metrics__port", 0)  # a free port: clusters may overlap across modules
        c = BackgroundCluster(load_config(CONFIG, {k.replace("__", "."): v for k, v in overrides.items()}))
        started.append(c)
        return c

    yield make
    for c in started:
        if not c.stopped:
            c.stop()


@pytest.fixture(scope="session")
def wait_idle():
    return _wait_idle


def _wait_idle(stub, cluster, timeout: float = 120.0) -> list:
    """Until no worker holds a KV block and the router tracks no request; returns the workers.

    The timeout only guards against a hang (a leak never frees): it returns as soon as idle.
    """
    deadline = time.monotonic() + timeout
    while True:
        workers = stub.GetClusterStatus(pb.GetClusterStatusRequest()).workers
        if all(w.kv_blocks_used == 0 and w.state == "ready" for w in workers) and not cluster.router.jobs:
            return list(workers)
        assert time.monotonic() < deadline, f"blocks still held: {workers}"
        time.sleep(0.05)
