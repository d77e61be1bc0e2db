"""`ray down` drains the router first: Ray runs `ray stop` on the head over SSH through
`bash --login -i` with ~/.bashrc sourced; the line the `ray up` files' setup adds there makes that
`ray stop` send SIGTERM to `pdserve serve` (its pid from the head's start command) and wait for it
to exit before Ray stops. Run here with a fake HOME, a stand-in `pdserve serve` and a stub `ray`."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from cli.shell import invocations

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# a stand-in for `pdserve serve` (its command line says so): on SIGTERM it takes 0.5 s, as running
# requests finishing would, writes when it finished, then exits; with "stubborn" it ignores SIGTERM
FAKE_SERVE = """
import signal, sys, time
out = sys.argv[1]
def term(*_):
    time.sleep(0.5)
    open(out, "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if "stubborn" in sys.argv else term)
open(out + ".ready", "w").write("")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def node(tmp_path):
    """A HOME with ~/pdserve (deploy/ scripts, a stub .venv/bin/ray that logs its calls) and an empty
    ~/.bashrc; yields (home, start) where start() runs a fake `pdserve serve` and writes its pid file."""
    home = tmp_path / "home"
    (home / "pdserve" / ".venv" / "bin").mkdir(parents=True)
    shutil.copytree(DEPLOY, home / "pdserve" / "deploy", ignore=shutil.ignore_patterns("secrets"))
    ray = home / "pdserve" / ".venv" / "bin" / "ray"
    now = f"{sys.executable} -c 'import time; print(time.time())'"
    ray.write_text(f"#!/bin/sh\necho \"$* $({now})\" >> {home}/ray.log\n")
    ray.chmod(0o755)
    (home / ".bashrc").write_text("")
    (tmp_path / "fake_serve.py").write_text(FAKE_SERVE)
    procs = []

    def start(*extra: str) -> subprocess.Popen:
        out = home / "drained"
        p = subprocess.Popen([sys.executable, str(tmp_path / "fake_serve.py"), str(out), "pdserve", "serve", *extra])
        threading.Thread(target=p.wait, daemon=True).start()  # reaped at exit, as init would
        deadline = time.time() + 20
        while not Path(str(out) + ".ready").exists() and time.time() < deadline:
            time.sleep(0.02)
        (home / "pdserve.pid").write_text(f"{p.pid}\n")
        procs.append(p)
        return p

    yield home, start
    for p in procs:
        if p.poll() is None:
            p.kill()


def _bash(home: Path, command: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env={"PATH": os.environ["PATH"], "HOME": str(home), **(env or {})},
                          capture_output=True, text=True, timeout=60, **kw)


def test_ray_down_drains_pdserve_serve_before_ray_stops(node):
    home, start = node
    setup = yaml.safe_load((DEPLOY / "cluster-aws.yaml").read_text())["setup_commands"]
    line = next(c for c in setup if "ray-shell.sh" in c)
    for _ in range(2):  # `ray up` again adds nothing
        assert _bash(home, line).returncode == 0
    assert (home / ".bashrc").read_text().count("ray-shell.sh") == 1
    serve = start()
    # what `ray down` runs on the head (ray.autoscaler._private.command_runner._with_interactive)
    from ray.autoscaler._private.command_runner import _with_interactive
    r = _bash(home, " ".join(_with_interactive("ray stop")), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert serve.wait(timeout=10) == 0
    drained = float((home / "drained").read_text())
    stop_line = (home / "ray.log").read_text().split()
    assert stop_line[0] == "stop" and drained < float(stop_line[-1])
    assert not (home / "pdserve.pid").exists()


def test_the_ray_shell_gives_rays_tls_settings():
    r = subprocess.run(["bash", "-c", f"source {DEPLOY}/ray-shell.sh && env"], capture_output=True, text=True,
                       env={"PATH": os.environ["PATH"], "HOME": "/h"})
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert env["RAY_USE_TLS"] == "1" and env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_TLS_SERVER_CERT"] == "/h/.pdserve-ray/node.pem"
    assert env["RAY_TLS_CA_CERT"] == f"{DEPLOY}/secrets/nodes/ray-ca.pem"


def test_the_head_start_drains_before_ray_stop():
    """`ray up` on a running cluster restarts Ray on the head: the router drains first."""
    head = yaml.safe_load((DEPLOY / "cluster-aws.yaml").read_text())["head_start_ray_commands"]
    argv = [i.argv for i in invocations(head[0])]
    assert argv == [("~/pdserve/deploy/drain.sh",), ("~/pdserve/.venv/bin/ray", "stop")]
    serve = next(c for c in head if "pdserve serve" in c)
    assert serve.rstrip().endswith("& echo $! > ~/pdserve.pid")  # the pid drain.sh signals


def test_a_router_that_outlives_the_wait_is_left_to_ray(node):
    home, start = node
    serve = start("stubborn")
    t0 = time.time()
    r = _bash(home, f"{DEPLOY}/drain.sh", env={"PDSERVE_DRAIN_S": "1"})
    assert r.returncode == 1 and "still running" in r.stderr and 1 <= time.time() - t0 < 10
    assert serve.poll() is None


def test_a_stale_pid_file_signals_nothing(node, tmp_path):
    home, _ = node
    other = subprocess.Popen(["sleep", "30"])  # not a pdserve serve: a pid reused since
    try:
        (home / "pdserve.pid").write_text(f"{other.pid}\n")
        r = _bash(home, shlex.quote(str(DEPLOY / "drain.sh")))
        assert r.returncode == 0 and other.poll() is None and not (home / "pdserve.pid").exists()
    finally:
        other.kill()
        other.wait()
