"""A Ray cluster of separate nodes on one machine, as separate machines would be where it matters.

Three ``ray start`` processes joined into one cluster: a head (the router runs here; no worker
resource), a prefill node and a decode node. Each has its own node IP (loopback aliases: Linux
routes all of 127.0.0.0/8 to lo), its own HOME (so its own ``~/.cache/pdserve`` model cache)
and its own environment; they share only Ray. Used by the ``multinode`` tests, and by hand::

    python tests/multinode.py up [--root DIR]    # prints the address for `pdserve serve --address`
    python tests/multinode.py down [--root DIR]

Everything it starts runs under ``--root`` (a fresh temp dir by default), and ``down`` stops
exactly the processes whose command line names that dir: never another Ray on the machine
(``ray stop`` would stop them all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


@dataclass(frozen=True)
class Node:
    name: str
    ip: str
    resources: dict
    cpus: int = 2


NODES = (Node("head", "127.0.0.1", {}), Node("prefill", "127.0.0.2", {"prefill": 4}),
         Node("decode", "127.0.0.3", {"decode": 4}))


def _free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


@dataclass
class MultiNode:
    """The cluster under ``root``; :meth:`up` starts it, :meth:`down` stops it (idempotent)."""

    root: Path
    nodes: tuple[Node, ...] = NODES
    port: int = field(default_factory=_free_port)

    @property
    def address(self) -> str:
        return f"{self.nodes[0].ip}:{self.port}"

    def home(self, node: Node) -> Path:
        return self.root / node.name / "home"

    @property
    def token_path(self) -> Path:
        return self.root / "ray_auth_token"

    def env(self, node: Node) -> dict:
        """The node's own environment: its HOME (model cache), Ray's token auth (Ray resolves
        a head at 127.0.0.1 to the machine's own address: its ports are not only on loopback),
        UCX over TCP on loopback only (as between machines: no shared memory, which UCX would
        otherwise pick between processes of one host)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_CACHE", "UCX_"))}
        env.update(HOME=str(self.home(node)), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path),
                   UCX_NET_DEVICES="lo", UCX_TLS="tcp",
                   RAY_USAGE_STATS_ENABLED="0", PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}")
        return env

    def up(self, timeout: float = 180) -> MultiNode:
        (self.root / "ray").mkdir(parents=True, exist_ok=True)
        if not self.token_path.exists():
            import secrets
            self.token_path.write_text(secrets.token_hex(32))
            self.token_path.chmod(0o600)
        for node in self.nodes:
            self.home(node).mkdir(parents=True, exist_ok=True)
            head = node is self.nodes[0]
            args = [RAY, "start", f"--node-ip-address={node.ip}", f"--num-cpus={node.cpus}",
                    f"--resources={json.dumps(node.resources)}", "--disable-usage-stats"]
            args += ([f"--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.root / 'ray'}"]
                     if head else [f"--address={self.address}"])
            r = subprocess.run(args, env=self.env(node), capture_output=True, text=True, timeout=timeout)
            if r.returncode:
                self.down()
                raise RuntimeError(f"ray start ({node.name}) failed:\n{r.stdout}\n{r.stderr}")
        self.wait_nodes(len(self.nodes), timeout)
        return self

    def wait_nodes(self, n: int, timeout: float) -> None:
        """Until ``n`` nodes are alive in the cluster (asked from a fresh driver process)."""
        code = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run([sys.executable, "-c", code, self.address], env=self.env(self.nodes[0]),
                               capture_output=True, text=True, timeout=timeout)
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} nodes did not join within {timeout:g}s: {r.stdout} {r.stderr[-2000:]}")
            time.sleep(1)

    def processes(self) -> list[int]:
        """Pids of every process of this cluster: its command line names ``root`` (Ray's own
        servers), or its HOME is a node's (what they started; Ray renames workers' command
        lines to ``ray::...``)."""
        import psutil
        root, mine = str(self.root), []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(root in a for a in (p.info["cmdline"] or [])) or p.environ().get("HOME", "").startswith(root):
                    mine.append(p.info["pid"])
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        # Never this process or its ancestors (a shell or `timeout` whose command line names root).
        me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        return [p for p in mine if p not in me]

    def down(self, timeout: float = 30) -> None:
        import psutil
        procs = []
        for pid in self.processes():
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        # The GCS last: a raylet's graceful exit on SIGTERM talks to it, and with the GCS going
        # at the same moment the raylets sat out the whole timeout (30 s of every test module's
        # teardown); with it up, everything else exits within 2 s, then it does.
        gcs = [p for p in procs if _name(p) == "gcs_server"]
        for group in ([p for p in procs if p not in gcs], gcs):
            for p in group:
                try:
                    p.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    continue
            _, alive = psutil.wait_procs(group, timeout=timeout)
            for p in alive:
                p.kill()
        # Workers Ray forked before their command line named the session dir, if any.
        psutil.wait_procs([psutil.Process(p) for p in self.processes() if psutil.pid_exists(p)], timeout=5)


def _name(p) -> str:
    import psutil
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/multinode.py", description=(
        "A 3-node Ray cluster on this machine (head 127.0.0.1, prefill node 127.0.0.2, decode node "
        "127.0.0.3), each node with its own HOME and model cache. `up` prints the address for "
        "`pdserve serve --address`; `down` stops only what `up` started under --root."))
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("--root", default=None, help="directory for the nodes' homes and Ray's files "
                   "(up: default a new temp dir; down: the one up printed)")
    args = p.parse_args(argv)
    if args.action == "up":
        root = Path(args.root or tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))  # short: AF_UNIX paths under it
        c = MultiNode(root).up()
        print(f"cluster up: address {c.address}, root {root}")
        print(f"  serve: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={c.token_path} pdserve serve --address {c.address}")
        print(f"  stop:  python tests/multinode.py down --root {root}")
        return 0
    if not args.root:
        p.error("down needs --root (printed by up)")
    MultiNode(Path(args.root)).down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
