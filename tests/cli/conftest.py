"""Fixtures of the command-line tests."""

from __future__ import annotations

import time

import psutil
import pytest


@pytest.fixture(scope="session")
def exit_later():
    """``exit_later(procs, deadline, what)``: these processes must have exited by ``deadline``
    (time.monotonic()), checked when the test session ends rather than waited for in the test.

    For processes whose exit takes a fixed, long wait that is not the product's own: Ray's
    agents outlive a SIGKILLed raylet by about 60 s (each publishes the raylet's death to the
    GCS, dead with it, under a 60 s timeout hard-coded in ray._private.utils). Waiting in the
    test cost a minute of the suite; the other tests run meanwhile, and the check is the same."""
    pending: list[tuple[list, float, str]] = []
    yield lambda procs, deadline, what: pending.append((list(procs), deadline, what))
    for procs, deadline, what in pending:
        _, alive = psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))
        assert not alive, f"{what}: still running past their deadline: {[(p.pid, p.name()) for p in alive]}"
