"""The front door's black-box probe (issue 42's "done when"): attacks on a live ``pdserve serve``
while a second token's requests are measured.

Starts ``pdserve serve`` on the bundled SmolLM2 with a tokens file of two tokens (``greedy``
and ``victim``) and a policy file (``greedy`` capped at ``--greedy-cap`` requests in progress),
or attaches to one (``--server``, ``--http``, ``--greedy-token``, ``--victim-token``; the
server's gRPC without TLS). Then:

1. **idle**: the victim's requests on the idle server (``--victim-requests`` each over the
   OpenAI HTTP API and gRPC, one at a time): the latency baseline.
2. **attacks**, all held open at once, none of them with the victim's token:
   ``--idle-conns`` TCP connections to the HTTP port that send nothing (no token);
   ``--slowloris`` that trickle a request's headers a byte every ``--trickle-s`` (no token);
   ``--grpc-idle`` TCP connections to the gRPC port that send nothing (no token);
   ``--watches`` gRPC health ``Watch`` streams that never end (health is open: no token);
   ``--unread`` streamed completions of the greedy token that it never reads past their
   first bytes (a small receive buffer: the server's writes block).
3. **under attack**: the victim's requests again, while the attacks are held; then the
   malformed ones (greedy token): ``--nesting-kb`` KB of ``[``, lone surrogates in
   ``prompt``, ``content`` and ``stop``, a text/plain body, a foreign ``Host``, and a gRPC
   ``Generate`` whose prompt is not UTF-8.

``--fairness`` measures instead two tokens at 3:1 weights (one priority class) under overload:
each token's generated tokens per second and their ratio (class ``Fairness``).

Asserts (exit 1 otherwise) no HTTP 500 and no gRPC INTERNAL/UNKNOWN anywhere, and every
victim request served; reports the victim's p50 under attack against idle (the issue's bar is
1.5x) and when the server closed each kind of idle connection. Prints a table on stdout and,
last, one flat JSON line. Defaults are the issue's counts (1,024 idle connections, 1,000 Watch
streams, 500 unread streams, 100 KB of nesting); the issue names none for slowloris and idle
gRPC connections (256 each). All connections come from one address (loopback), so the HTTP
port's per-address cap (``front_door.connections_per_client``, 256, oldest idle closed first)
is what the idle floods meet first. Not probed here (needs the cluster key, not black-box): a
replayed report from an old incarnation (tests/router/test_report_replay.py).
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

GREEDY = "greedy-" + "g" * 25  # the tokens of a server the probe starts (>= 16 characters)
VICTIM = "victim-" + "v" * 25
PROMPT = "The capital of France is"


def log(msg: str) -> None:
    print(f"[probe] {msg}", file=sys.stderr, flush=True)


@dataclass
class Target:
    """Where the probe aims: gRPC and HTTP ``host:port``, and the two tokens."""

    grpc: str
    http: str
    greedy: str
    victim: str
    proc: subprocess.Popen | None = field(default=None, repr=False)  # the server the probe started


@dataclass
class Counts:
    """How hard each attack is (the flags)."""

    idle_conns: int = 1024
    slowloris: int = 256
    trickle_s: float = 1.0
    grpc_idle: int = 256
    watches: int = 1000
    unread: int = 500
    unread_max_tokens: int = 512
    nesting_kb: int = 100
    victim_requests: int = 8
    victim_max_tokens: int = 16
    hold_s: float = 12.0  # attacks held this long before the victim measures (past the header timeout)
    reopen: bool = False  # idle HTTP connections reconnect when the server closes them


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
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return (int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0), body


def completion(model: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()


# ---- the attacks ------------------------------------------------------------------------------

class Attacks:
    """The attacks of the module doc, started by ``start`` and held until ``stop``."""

    def __init__(self, t: Target, c: Counts, tally: Tally, model: str) -> None:
        self.t, self.c, self.tally, self.model = t, c, tally, model
        self.tasks: list[asyncio.Task] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.socks: list[socket.socket] = []
        self.channels: list = []
        self.closed_after: dict[str, list[float]] = collections.defaultdict(list)
        self.opened_at = 0.0

    async def start(self) -> None:
        self.opened_at = time.monotonic()
        for name, n, fn in (("http idle", self.c.idle_conns, self._idle_http),
                            ("slowloris", self.c.slowloris, self._slowloris),
                            ("grpc idle", self.c.grpc_idle, self._idle_grpc)):
            for _ in range(n):
                self.tasks.append(asyncio.create_task(fn(name)))
            await asyncio.sleep(0)
        await self._watches()
        await self._unread()

    async def _held(self, name: str, reader: asyncio.StreamReader) -> None:
        """Wait for the server to close a connection (an HTTP answer counted by its status; what
        else comes, e.g. gRPC's SETTINGS frame, read and dropped); note after how long."""
        first = b""
        try:
            while data := await reader.read(4096):
                first = first or data
        except (ConnectionError, OSError):
            pass
        self.tally.add(name, first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed")
        self.closed_after[name].append(time.monotonic() - self.opened_at)

    async def _idle_http(self, name: str) -> None:
        while True:
            await self._idle(name, self.t.http)
            if not self.c.reopen:
                return
            await asyncio.sleep(0.05)  # (a reconnecting flood; not a busy loop on this side)

    async def _idle_grpc(self, name: str) -> None:
        await self._idle(name, self.t.grpc)

    async def _idle(self, name: str, addr: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(*split(addr))
        except OSError as e:
            self.tally.add(name, f"connect failed: {e.strerror}")
            return
        self.writers.append(writer)
        self.tally.add(name, "opened")
        await self._held(name, reader)

    async def _slowloris(self, name: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(*split(self.t.http))
        except OSError as e:
            self.tally.add(name, f"connect failed: {e.strerror}")
            return
        self.writers.append(writer)
        self.tally.add(name, "opened")
        held = asyncio.create_task(self._held(name, reader))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.t.http}\r\nX-Slow: ".encode() + b"a" * 100000
        for i in range(len(head)):
            if held.done() or writer.is_closing():
                break
            try:
                writer.write(head[i:i + 1])
                await writer.drain()
            except (ConnectionError, OSError):
                break
            await asyncio.sleep(self.c.trickle_s)
        await held

    async def _watches(self) -> None:
        # (heavy: gRPC, loaded only by what uses them)
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        per_channel = 200  # below the server's streams per connection: each channel its own connection
        for k in range(0, self.c.watches, per_channel):
            ch = grpc.aio.insecure_channel(self.t.grpc, options=[("grpc.probe_channel", k)])
            self.channels.append(ch)
            health = health_pb2_grpc.HealthStub(ch)

            async def watch(health=health) -> None:
                call = health.Watch(health_pb2.HealthCheckRequest())
                try:
                    first = await call.read()
                    self.tally.add("watch", health_pb2.HealthCheckResponse.ServingStatus.Name(first.status))
                    await call.read()  # never ends while the server serves
                except grpc.aio.AioRpcError as e:
                    self.tally.add("watch", e.code().name)
                except asyncio.CancelledError:
                    call.cancel()
                    raise
            for _ in range(min(per_channel, self.c.watches - k)):
                self.tasks.append(asyncio.create_task(watch()))

    async def _unread(self) -> None:
        """The greedy token's streams: the status line read, nothing after it."""
        host, port = split(self.t.http)
        body = json.dumps({"model": self.model, "prompt": PROMPT, "max_tokens": self.c.unread_max_tokens,
                           "stream": True, "logprobs": 5, "ignore_eos": True}).encode()
        raw = http_request("POST", "/v1/completions", self.t.http, self.t.greedy, body)

        async def one() -> None:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server's writes block soon
            s.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(s, (host, port))
                await asyncio.get_running_loop().sock_sendall(s, raw)
                first = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(s, 16), 300)
            except (OSError, asyncio.TimeoutError) as e:
                self.tally.add("unread", f"failed: {type(e).__name__}")
                s.close()
                return
            self.socks.append(s)
            self.tally.add("unread", first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed")
        for _ in range(self.c.unread):
            self.tasks.append(asyncio.create_task(one()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for w in self.writers:
            w.close()
        for s in self.socks:
            s.close()
        for ch in self.channels:
            await ch.close()


async def malformed(t: Target, tally: Tally, model: str, nesting_kb: int) -> None:
    """The bodies that used to be 500s, and the requests a web page could make (greedy token)."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc
    p = "/v1/completions"
    chat = "/v1/chat/completions"
    bodies = {
        "nesting": (p, b"[" * (nesting_kb * 1024), "application/json", t.http),
        "surrogate prompt": (p, b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % model.encode(),
                             "application/json", t.http),
        "surrogate content": (chat, b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}], '
                                    b'"max_tokens": 2}' % model.encode(), "application/json", t.http),
        "surrogate stop": (p, b'{"model": "%s", "prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}' % model.encode(),
                           "application/json", t.http),
        "text/plain": (p, completion(model, 2), "text/plain", t.http),
        "foreign host": (p, completion(model, 2), "application/json",
                         "attacker.example:80"),
    }
    for name, (path, body, ctype, host) in bodies.items():
        raw = http_request("POST", path, host, t.greedy, body, ctype)
        status, _ = await http_call(t.http, raw)
        tally.add(name, str(status))
    # gRPC: a prompt (field 2) that is not UTF-8 (a lone surrogate as CESU-8 bytes), hand-encoded
    bad = b"\xed\xa0\x80"
    raw = b"\x12" + bytes([len(bad)]) + bad
    async with grpc.aio.insecure_channel(t.grpc) as ch:
        call = ch.unary_stream("/pdserve.v1.Generation/Generate")
        try:
            async for _ in call(raw, metadata=(("authorization", f"Bearer {t.greedy}"),), timeout=60):
                pass
            tally.add("grpc not utf-8", "OK")
        except grpc.aio.AioRpcError as e:
            tally.add("grpc not utf-8", e.code().name)


# ---- the victim -------------------------------------------------------------------------------

async def victim_round(t: Target, c: Counts, tally: Tally, phase: str, model: str) -> None:
    """``victim_requests`` HTTP completions and as many gRPC Generates, one at a time."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc

    # (heavy: gRPC, loaded only by what uses them)
    from router.client import make_request
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": c.victim_max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    raw = http_request("POST", "/v1/completions", t.http, t.victim, body)
    async with grpc.aio.insecure_channel(t.grpc) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for _ in range(c.victim_requests):
            t0 = time.perf_counter()
            try:
                status, out = await http_call(t.http, raw)
            except (OSError, asyncio.TimeoutError) as e:
                status, out = 0, str(e).encode()
            tally.add(f"victim http ({phase})", str(status))
            if status == 200:
                tally.latency[f"http {phase}"].append(time.perf_counter() - t0)
            else:
                tally.victim_failures.append(f"http {phase}: {status} {out[:200]!r}")
            t0 = time.perf_counter()
            try:
                n = 0
                async for r in stub.Generate(make_request(PROMPT, max_tokens=c.victim_max_tokens, ignore_eos=True),
                                             metadata=(("authorization", f"Bearer {t.victim}"),), timeout=120):
                    n += len(r.token_ids)
                tally.add(f"victim grpc ({phase})", "OK")
                tally.latency[f"grpc {phase}"].append(time.perf_counter() - t0)
            except grpc.aio.AioRpcError as e:
                tally.add(f"victim grpc ({phase})", e.code().name)
                tally.victim_failures.append(f"grpc {phase}: {e.code().name} {e.details()}")


async def served_model(t: Target) -> str:
    status, body = await http_call(t.http, http_request("GET", "/v1/models", t.http, t.victim, ctype=None))
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


async def probe(t: Target, c: Counts) -> tuple[Tally, dict]:
    """The probe's core: baseline, attacks held, victim again, malformed requests; returns the
    tally and the summary (flat JSON-able)."""
    tally = Tally()
    model = await served_model(t)
    log(f"idle: {c.victim_requests} victim requests each over HTTP and gRPC ...")
    await victim_round(t, c, tally, "idle", model)
    attacks = Attacks(t, c, tally, model)
    log(f"attacks: {c.idle_conns} idle HTTP, {c.slowloris} slowloris, {c.grpc_idle} idle gRPC connections, "
        f"{c.watches} Watch streams, {c.unread} unread greedy streams; held {c.hold_s:.0f} s ...")
    await attacks.start()
    try:
        await asyncio.sleep(c.hold_s)
        log("under attack: the victim's requests again, then the malformed ones ...")
        await victim_round(t, c, tally, "attack", model)
        await malformed(t, tally, model, c.nesting_kb)
    finally:
        await attacks.stop()

    def p50(key: str) -> float | None:
        xs = tally.latency.get(key)
        return statistics.median(xs) * 1e3 if xs else None
    summary: dict = {}
    for proto in ("http", "grpc"):
        idle, attack = p50(f"{proto} idle"), p50(f"{proto} attack")
        summary[f"victim_{proto}_p50_ms_idle"] = idle
        summary[f"victim_{proto}_p50_ms_attack"] = attack
        summary[f"victim_{proto}_p50_ratio"] = attack / idle if idle and attack else None
    for name in ("http idle", "slowloris", "grpc idle"):
        after = attacks.closed_after.get(name, [])
        summary[f"{name.replace(' ', '_')}_closed_by_server"] = len(after)
        summary[f"{name.replace(' ', '_')}_held_max_s"] = max(after) if after else None
    summary["victim_failures"] = len(tally.victim_failures)
    summary["http_500_or_grpc_internal"] = tally.bad()
    for attack, counter in tally.outcomes.items():
        for outcome, n in counter.items():
            summary[f"{attack.replace(' ', '_').replace('(', '').replace(')', '')}.{outcome.replace(' ', '_')}"] = n
    return tally, summary


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
    port, http_port = free_port(), free_port()
    pdserve = os.path.join(os.path.dirname(sys.executable), "pdserve")
    cmd = [pdserve if os.path.exists(pdserve) else "pdserve", "serve", "--port", str(port), "--http-port",
           str(http_port), "--metrics-port", "0", "--tokens-file", tokens, "--set", f"security.policy_file={policy}"]
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
        yield Target(f"127.0.0.1:{port}", f"127.0.0.1:{http_port}", GREEDY, VICTIM, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- fairness: two tokens at 3:1 weights under overload ---------------------------------------

@dataclass
class Fairness:
    """``--fairness``: both tokens in one priority class at ``weights`` (greedy, victim), each
    keeping ``outstanding`` gRPC streams of ``max_tokens`` (EOS ignored) in flight, far more than
    a KV cache of ``kv_cache_gb`` holds at once (the server it starts), so both always wait in the
    router's placement queue, where admission's fair share (router.admission) decides. Tokens are
    counted as they arrive, in the ``duration_s`` after ``warmup_s``."""

    weights: tuple[float, float] = (3.0, 1.0)
    outstanding: int = 12
    max_tokens: int = 32
    kv_cache_gb: float = 0.02  # SmolLM2-135M, fp32: ~29 blocks of 16 tokens, ~9 requests of 38 tokens at once
    warmup_s: float = 5.0
    duration_s: float = 30.0

    def policy(self) -> str:
        return f"tokens:\n  greedy: {{weight: {self.weights[0]:g}}}\n  victim: {{weight: {self.weights[1]:g}}}\n"


async def fairness(t: Target, f: Fairness) -> dict:
    """Each token's generated tokens per second while both overload the server; flat summary."""
    # (heavy: gRPC, loaded only by what uses them)
    import grpc

    # (heavy: gRPC, loaded only by what uses them)
    from router.client import make_request
    from pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    names = {"greedy": t.greedy, "victim": t.victim}
    tokens = collections.Counter()
    done = collections.Counter()
    errors = collections.Counter()
    t0 = time.monotonic()
    start, end = t0 + f.warmup_s, t0 + f.warmup_s + f.duration_s

    async def client(stub, name: str) -> None:
        meta = (("authorization", f"Bearer {names[name]}"),)
        while time.monotonic() < end:
            try:
                async for r in stub.Generate(make_request(PROMPT, max_tokens=f.max_tokens, ignore_eos=True),
                                             metadata=meta, timeout=120):
                    if start <= time.monotonic() < end:
                        tokens[name] += len(r.token_ids)
                if start <= time.monotonic() < end:
                    done[name] += 1
            except grpc.aio.AioRpcError as e:
                errors[f"{name} {e.code().name}"] += 1
                await asyncio.sleep(1.0)  # (the retry hint of a full queue or a queue timeout)

    log(f"fairness: greedy and victim at weights {f.weights[0]:g}:{f.weights[1]:g}, {f.outstanding} streams "
        f"each of {f.max_tokens} tokens, {f.warmup_s:g} s warm-up, {f.duration_s:g} s measured ...")
    async with grpc.aio.insecure_channel(t.grpc) as ch:
        stub = pb_grpc.GenerationStub(ch)
        tasks = [asyncio.create_task(client(stub, name)) for name in names for _ in range(f.outstanding)]
        await asyncio.sleep(end - time.monotonic())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate = {name: tokens[name] / f.duration_s for name in names}
    expected = f.weights[0] / f.weights[1]
    ratio = rate["greedy"] / rate["victim"] if rate["victim"] else None
    summary = {"fairness_weights": list(f.weights), "fairness_throughput_ratio": ratio,
               "fairness_expected_ratio": expected,
               "fairness_within_15pct": ratio is not None and abs(ratio / expected - 1) <= 0.15,
               "fairness_duration_s": f.duration_s, "fairness_outstanding": f.outstanding,
               "fairness_max_tokens": f.max_tokens}
    for name in names:
        summary[f"fairness_tokens_per_s_{name}"] = rate[name]
        summary[f"fairness_requests_{name}"] = done[name]
    for k, n in errors.items():
        summary[f"fairness_errors.{k.replace(' ', '_')}"] = n
    return summary


def fairness_table(s: dict) -> str:
    w = s["fairness_weights"]
    r = s["fairness_throughput_ratio"]
    head = ("weights (greedy:victim)", "greedy tok/s", "victim tok/s", "ratio", "expected", "within 15%")
    row = (f"{w[0]:g}:{w[1]:g}", f"{s['fairness_tokens_per_s_greedy']:.1f}", f"{s['fairness_tokens_per_s_victim']:.1f}",
           "-" if r is None else f"{r:.2f}", f"{s['fairness_expected_ratio']:.2f}", str(s["fairness_within_15pct"]))
    return "\n".join("  ".join(f"{c:>{len(h)}}" for c, h in zip(line, head)) for line in (head, row))


# ---- the command --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    d = Counts()
    p = argparse.ArgumentParser(prog="python bench/probe.py", description=__doc__.split("\n\n")[0] + (
        " Exit status 1 when any answer was a 500 or INTERNAL, or a victim request failed."))
    p.add_argument("--server", help="attach: a running server's gRPC host:port (with --http and both tokens)")
    p.add_argument("--http", help="attach: its OpenAI HTTP host:port")
    p.add_argument("--greedy-token", default=os.environ.get("PROBE_GREEDY_TOKEN"),
                   help="attach: the token that holds unread streams and sends malformed bodies ($PROBE_GREEDY_TOKEN)")
    p.add_argument("--victim-token", default=os.environ.get("PROBE_VICTIM_TOKEN"),
                   help="attach: the token whose requests are measured ($PROBE_VICTIM_TOKEN)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the server it starts (repeatable; default: mode=colocated, "
                        "decode.compile_decode=false: one worker on this machine's 2 cores, quick to start)")
    p.add_argument("--greedy-cap", type=int, default=2,
                   help="the server it starts: the greedy token's max_concurrent in its policy file (default 2: "
                        "on 2 cores each admitted stream shares the decode batch with the victim's; measured "
                        "here, 8 of them doubled its p50, 2 added ~20%%)")
    a = p.add_argument_group("attacks (counts)")
    a.add_argument("--idle-conns", type=int, default=d.idle_conns,
                   help=f"idle HTTP connections (default {d.idle_conns})")
    a.add_argument("--reopen", action="store_true",
                   help="idle HTTP connections reconnect (after 50 ms) whenever the server closes them")
    a.add_argument("--slowloris", type=int, default=d.slowloris,
                   help=f"slowloris HTTP connections (default {d.slowloris}: the issue names no count; each "
                        "trickles a byte every --trickle-s)")
    a.add_argument("--trickle-s", type=float, default=d.trickle_s,
                   help=f"slowloris: seconds between bytes (default {d.trickle_s})")
    a.add_argument("--grpc-idle", type=int, default=d.grpc_idle,
                   help=f"idle TCP connections to the gRPC port (default {d.grpc_idle})")
    a.add_argument("--watches", type=int, default=d.watches,
                   help=f"never-ending health Watch streams (default {d.watches})")
    a.add_argument("--unread", type=int, default=d.unread,
                   help=f"the greedy token's streamed completions left unread (default {d.unread})")
    a.add_argument("--unread-max-tokens", type=int, default=d.unread_max_tokens,
                   help=f"max_tokens of each (default {d.unread_max_tokens}, logprobs 5: ~1 KB a token)")
    a.add_argument("--nesting-kb", type=int, default=d.nesting_kb,
                   help=f"KB of '[' in one body (default {d.nesting_kb})")
    a.add_argument("--hold-s", type=float, default=d.hold_s,
                   help=f"seconds the attacks are held before the victim measures (default {d.hold_s}: past "
                        "the 10 s header timeout)")
    fa = p.add_argument_group("fairness (--fairness: this instead of the attacks)")
    df = Fairness()
    fa.add_argument("--fairness", action="store_true",
                    help="measure the two tokens' throughput at --weights under overload (the server it starts: "
                         "their policy, a small KV cache) instead of probing the attacks")
    fa.add_argument("--weights", default=f"{df.weights[0]:g}:{df.weights[1]:g}",
                    help="greedy:victim weights in one priority class (default %(default)s; attached: what the "
                         "server's policy says, for the expected ratio)")
    fa.add_argument("--outstanding", type=int, default=df.outstanding,
                    help=f"streams each token keeps in flight (default {df.outstanding})")
    fa.add_argument("--fair-max-tokens", type=int, default=df.max_tokens,
                    help=f"max_tokens of each (default {df.max_tokens}, EOS ignored)")
    fa.add_argument("--kv-cache-gb", type=float, default=df.kv_cache_gb,
                    help=f"the server it starts: decode.kv_cache_gb (default {df.kv_cache_gb}: ~9 requests at once)")
    fa.add_argument("--warmup-s", type=float, default=df.warmup_s, help=f"default {df.warmup_s}")
    fa.add_argument("--duration-s", type=float, default=df.duration_s, help=f"measured (default {df.duration_s})")
    v = p.add_argument_group("the victim")
    v.add_argument("--victim-requests", type=int, default=d.victim_requests,
                   help=f"requests per protocol and phase (default {d.victim_requests})")
    v.add_argument("--victim-max-tokens", type=int, default=d.victim_max_tokens,
                   help=f"max_tokens of each (default {d.victim_max_tokens})")
    return p


def table(tally: Tally, summary: dict) -> str:
    rows = [("attack / request", "outcomes")]
    for attack, counter in tally.outcomes.items():
        rows.append((attack, ", ".join(f"{k}: {n}" for k, n in sorted(counter.items()))))
    for proto in ("http", "grpc"):
        i, a, r = (summary[f"victim_{proto}_p50_{x}"] for x in ("ms_idle", "ms_attack", "ratio"))
        fmt = lambda x: "-" if x is None else f"{x:.0f} ms"  # noqa: E731
        rows.append((f"victim {proto} p50", f"idle {fmt(i)}, under attack {fmt(a)}, ratio "
                                            f"{'-' if r is None else f'{r:.2f}x'}"))
    for name in ("http_idle", "slowloris", "grpc_idle"):
        n, last = summary[f"{name}_closed_by_server"], summary[f"{name}_held_max_s"]
        rows.append((f"{name} closed by server", f"{n}, the last after {last:.1f} s" if n else "0"))
    rows.append(("500 / INTERNAL", str(summary["http_500_or_grpc_internal"])))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's TERM stops the server it started too)
    c = Counts(idle_conns=args.idle_conns, slowloris=args.slowloris, trickle_s=args.trickle_s,
               grpc_idle=args.grpc_idle, watches=args.watches, unread=args.unread,
               unread_max_tokens=args.unread_max_tokens, nesting_kb=args.nesting_kb,
               victim_requests=args.victim_requests, victim_max_tokens=args.victim_max_tokens, hold_s=args.hold_s,
               reopen=args.reopen)
    if args.fairness:
        return main_fairness(args)
    with contextlib.ExitStack() as stack:
        if args.server:
            if not (args.http and args.greedy_token and args.victim_token):
                print("--server needs --http, --greedy-token and --victim-token", file=sys.stderr)
                return 2
            t = Target(args.server, args.http, args.greedy_token, args.victim_token)
        else:
            sets = args.set or ["mode=colocated", "decode.compile_decode=false"]
            t = stack.enter_context(serve(args.greedy_cap, sets, stack.enter_context(tempfile.TemporaryDirectory())))
        tally, summary = asyncio.run(probe(t, c))
    print(table(tally, summary))
    for f in tally.victim_failures[:10]:
        print(f"victim failure: {f}")
    print(json.dumps(summary))
    return 1 if summary["http_500_or_grpc_internal"] or tally.victim_failures else 0


def main_fairness(args: argparse.Namespace) -> int:
    gw, vw = (float(x) for x in args.weights.split(":"))
    f = Fairness((gw, vw), args.outstanding, args.fair_max_tokens, args.kv_cache_gb, args.warmup_s, args.duration_s)
    with contextlib.ExitStack() as stack:
        if args.server:
            if not (args.greedy_token and args.victim_token):
                print("--server needs --greedy-token and --victim-token", file=sys.stderr)
                return 2
            t = Target(args.server, args.http or "", args.greedy_token, args.victim_token)
        else:
            sets = args.set or ["mode=colocated", "decode.compile_decode=false", f"decode.kv_cache_gb={f.kv_cache_gb}"]
            t = stack.enter_context(serve(0, sets, stack.enter_context(tempfile.TemporaryDirectory()), f.policy()))
        summary = asyncio.run(fairness(t, f))
    print(fairness_table(summary))
    print(json.dumps(summary))
    return 0 if summary["fairness_within_15pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
