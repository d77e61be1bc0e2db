"""What every part of the front door's probe (bench/probe.py) shares: where it aims
(``Target``), what came back (``Tally``), HTTP written by hand (status codes as they are, no
client library between), and a ``pdserve serve`` of its own with two tokens."""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from router.aio import within

GREEDY = "greedy-" + "g" * 25  # the tokens of a server the probe starts (>= 16 characters)
VICTIM = "victim-" + "v" * 25
PROMPT = "The capital of France is"


def log(msg: str) -> None:
    print(f"[probe] {msg}", file=sys.stderr, flush=True)


@dataclass
class Target:
    """Where the probe aims: gRPC and HTTP ``host:port``, the two tokens, and the router's
    ``/metrics`` ``host:port`` where known."""

    grpc: str
    http: str
    greedy: str
    victim: str
    metrics: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)  # the server the probe started


@dataclass
class Tally:
    """What came back: per attack, outcome -> count; the victim's latencies."""

    outcomes: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    latency: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    victim_failures: list[str] = field(default_factory=list)

    def add(self, attack: str, outcome: str) -> None:
        self.outcomes[attack][outcome] += 1

    def bad(self) -> int:
        """HTTP 500s and gRPC INTERNAL/UNKNOWN, everywhere."""
        return sum(n for c in self.outcomes.values() for k, n in c.items()
                   if k.startswith("5") and k != "503" or k in ("INTERNAL", "UNKNOWN", "500"))


# ---- HTTP, by hand (status codes as they are, no client library between) -------------------

def split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def http_request(method: str, path: str, host: str, token: str | None, body: bytes = b"",
                 ctype: str | None = "application/json", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    if token:
        head += f"Authorization: Bearer {token}\r\n"
    if ctype:
        head += f"Content-Type: {ctype}\r\n"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return (head + extra + "\r\n").encode() + body


async def http_call(addr: str, raw: bytes, timeout: float = 120.0) -> tuple[int, bytes]:
    """(status, body) of one request on its own connection (``Connection: close``)."""
    host, port = split(addr)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        data = await within(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return (int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0), body


def completion(model: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()


async def served_model(t: Target) -> str:
    status, body = await http_call(t.http, http_request("GET", "/v1/models", t.http, t.victim, ctype=None))
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


# ---- a server of its own ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(greedy_cap: int, sets: list[str], workdir: str, policy_yaml: str | None = None):
    """``pdserve serve`` with the two tokens and the greedy token's cap (or ``policy_yaml``, the
    whole policy file); yields the Target."""
    tokens = os.path.join(workdir, "tokens")
    with open(tokens, "w") as f:
        f.write(f"{GREEDY} greedy\n{VICTIM} victim\n")
    os.chmod(tokens, 0o600)
    policy = os.path.join(workdir, "policy.yaml")
    with open(policy, "w") as f:
        f.write(policy_yaml or f"tokens:\n  greedy: {{max_concurrent: {greedy_cap}}}\n")
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    pdserve = os.path.join(os.path.dirname(sys.executable), "pdserve")
    cmd = [pdserve if os.path.exists(pdserve) else "pdserve", "serve", "--port", str(port), "--http-port",
           str(http_port), "--metrics-port", str(metrics_port), "--tokens-file", tokens, "--set", f"security.policy_file={policy}"]
    for s in sets:
        cmd += ["--set", s]
    log(f"starting {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300  # hang guard only
        while not any("serving the OpenAI API" in line for line in lines):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("pdserve serve did not start:\n" + "".join(lines))
            lines.append(proc.stderr.readline())
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
        yield Target(f"127.0.0.1:{port}", f"127.0.0.1:{http_port}", GREEDY, VICTIM, f"127.0.0.1:{metrics_port}", proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def aim(args, stack: contextlib.ExitStack, sets: list[str], greedy_cap: int = 0, policy_yaml: str | None = None,
        need_http: bool = True) -> Target | None:
    """The probe's Target: the server named by ``--server`` (with ``--http`` where the probe
    needs it, and both tokens), or ``pdserve serve`` started with ``--set`` (else ``sets``) and
    stopped when ``stack`` closes. None (after saying why on stderr): ``--server`` without what
    it needs."""
    if args.server:
        if not ((args.http or not need_http) and args.greedy_token and args.victim_token):
            print(f"--server needs {'--http, ' if need_http else ''}--greedy-token and --victim-token", file=sys.stderr)
            return None
        return Target(args.server, args.http or "", args.greedy_token, args.victim_token, args.metrics or "")
    return stack.enter_context(serve(greedy_cap, args.set or sets, stack.enter_context(tempfile.TemporaryDirectory()),
                                     policy_yaml))


def report(text: str, tally: Tally, summary: dict) -> None:
    """A probe's stdout: its table, the first victim failures, and last the JSON line."""
    print(text)
    for f in tally.victim_failures[:10]:
        print(f"victim failure: {f}")
    print(json.dumps(summary))
