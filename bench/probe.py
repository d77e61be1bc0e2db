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
   ``--grpc-unread`` gRPC and then ``--unread`` streamed completions of the greedy token that
   it never reads past their first message (bench/probe_unread.py);
   ``--reconnect`` tasks per port that open and close connections back to back, from
   127.0.0.2, no token (bench/probe_reconnect.py; ``--reconnect-rate`` bounds them).
3. **under attack**: the victim's requests again, while the attacks are held; then the
   malformed ones (greedy token): ``--nesting-kb`` KB of ``[``, lone surrogates in
   ``prompt``, ``content`` and ``stop``, a text/plain body, a foreign ``Host``, and a gRPC
   ``Generate`` whose prompt is not UTF-8; then the greedy token asks again on each protocol
   until served (``--greedy-wait-s``): the places its unread streams held came back.

``--fairness`` measures instead two tokens at 3:1 weights (one priority class) under overload:
each token's generated tokens per second and their ratio (bench/probe_fairness.py).
``--preemption``: the victim at high priority asks while the greedy token's low-priority
stream holds the whole KV cache, SSE and gRPC both ways; each greedy stream must resume as one
(bench/probe_preempt.py).

Asserts (exit 1 otherwise) no HTTP 500 and no gRPC INTERNAL/UNKNOWN anywhere, and every
victim request served; reports the victim's p50 under attack against idle (the issue's bar is
1.5x) and when the server closed each kind of idle connection. Prints a table on stdout and,
last, one flat JSON line. Defaults are the issue's counts (1,024 idle connections, 1,000 Watch
streams, 500 unread streams, 100 KB of nesting); the issue names none for slowloris and idle
gRPC connections (256 each), nor for reconnect floods (4 tasks per port, 1,000 connections a
second per port: a tight loop on the same machine takes the server's CPU too). All connections but the reconnect flood's come from one address (loopback), the
victim's, so the HTTP port's per-address caps (``front_door.new_connections_per_client_s``,
then ``connections_per_client``, 256, oldest idle closed first) are what the idle floods meet
first, and the health ``Watch`` streams ``front_door.health_watches_per_client`` (16). Not probed here (needs the cluster key, not black-box): a
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
import statistics
import sys
import time
from dataclasses import dataclass

from bench import probe_fairness, probe_preempt
from bench.probe_fairness import Fairness
from bench.probe_reconnect import Reconnects
from bench.probe_unread import UnreadStreams
from bench.probe_wire import (PROMPT, Tally, Target, aim, completion, http_call, http_request, log, report,
                              served_model, split)


@dataclass
class Counts:
    """How hard each attack is (the flags)."""

    idle_conns: int = 1024
    slowloris: int = 256
    trickle_s: float = 1.0
    grpc_idle: int = 256
    watches: int = 1000
    unread: int = 500
    grpc_unread: int = 1
    unread_max_tokens: int = 512
    reconnect: int = 4  # tasks per port opening and closing connections back to back
    # ... at most this many a second per port (0: as fast as they can: on one machine the flood's
    # own CPU, about a core, is then taken from the server too; 1,000 a port is what an attacker
    # elsewhere costs the server at 2,000 a second, measured: bench/README.md)
    reconnect_rate: float = 1000.0
    greedy_wait_s: float = 90.0  # after the hold, how long the greedy token tries to be served again
    nesting_kb: int = 100
    victim_requests: int = 8
    victim_max_tokens: int = 16
    hold_s: float = 12.0  # attacks held this long before the victim measures (past the header timeout)
    reopen: bool = False  # idle HTTP connections reconnect when the server closes them


# ---- the attacks ------------------------------------------------------------------------------

class Attacks:
    """The attacks of the module doc, started by ``start`` and held until ``stop``."""

    def __init__(self, t: Target, c: Counts, tally: Tally, model: str) -> None:
        self.t, self.c, self.tally, self.model = t, c, tally, model
        self.tasks: list[asyncio.Task] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.channels: list = []
        self.closed_after: dict[str, list[float]] = collections.defaultdict(list)
        self.opened_at = 0.0
        self.unread = UnreadStreams(t, tally, model, c.unread, c.grpc_unread, c.unread_max_tokens)
        self.reconnects = Reconnects(t, tally, c.reconnect, c.reconnect_rate)
        self.rates: dict[str, float] = {}  # the reconnect flood's cycles per second, per port

    async def start(self) -> None:
        self.opened_at = time.monotonic()
        for name, n, fn in (("http idle", self.c.idle_conns, self._idle_http),
                            ("slowloris", self.c.slowloris, self._slowloris),
                            ("grpc idle", self.c.grpc_idle, self._idle_grpc)):
            for _ in range(n):
                self.tasks.append(asyncio.create_task(fn(name)))
            await asyncio.sleep(0)
        await self._watches()
        await self.unread.open()
        self.reconnects.start()

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

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.rates = await self.reconnects.stop()
        for w in self.writers:
            w.close()
        await self.unread.close()
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


async def probe(t: Target, c: Counts) -> tuple[Tally, dict]:
    """The probe's core: baseline, attacks held, victim again, malformed requests; returns the
    tally and the summary (flat JSON-able)."""
    tally = Tally()
    model = await served_model(t)
    log(f"idle: {c.victim_requests} victim requests each over HTTP and gRPC ...")
    await victim_round(t, c, tally, "idle", model)
    attacks = Attacks(t, c, tally, model)
    log(f"attacks: {c.idle_conns} idle HTTP, {c.slowloris} slowloris, {c.grpc_idle} idle gRPC connections, "
        f"{c.watches} Watch streams, {c.unread} HTTP and {c.grpc_unread} gRPC unread greedy streams, "
        f"{c.reconnect} reconnect loops per port; held {c.hold_s:.0f} s ...")
    await attacks.start()
    try:
        await asyncio.sleep(c.hold_s)
        log("under attack: the victim's requests again, then the malformed ones ...")
        await victim_round(t, c, tally, "attack", model)
        await malformed(t, tally, model, c.nesting_kb)
        log(f"the greedy token asks again (up to {c.greedy_wait_s:g} s) while its unread streams are held ...")
        waited = await attacks.unread.again(c.greedy_wait_s)
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
    summary.update(waited)
    summary.update(attacks.rates)
    summary["victim_failures"] = len(tally.victim_failures)
    summary["http_500_or_grpc_internal"] = tally.bad()

    def key(s: str) -> str:
        return s.replace(' ', '_').replace('(', '').replace(')', '')
    for attack, counter in tally.outcomes.items():
        for outcome, n in counter.items():
            summary[f"{key(attack)}.{key(outcome)}"] = n
    return tally, summary


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
    a.add_argument("--grpc-unread", type=int, default=d.grpc_unread,
                   help=f"... and gRPC Generate streams left unread, opened first (default {d.grpc_unread}: with "
                        "--greedy-cap 2 one place each way)")
    a.add_argument("--unread-max-tokens", type=int, default=d.unread_max_tokens,
                   help=f"max_tokens of each (default {d.unread_max_tokens}, logprobs 5: ~1 KB a token)")
    a.add_argument("--greedy-wait-s", type=float, default=d.greedy_wait_s,
                   help=f"after the hold, the greedy token retries a request per protocol until served or "
                        f"this long (default {d.greedy_wait_s:g}: past front_door.unread_stream_timeout_s, 60 s)")
    a.add_argument("--reconnect", type=int, default=d.reconnect,
                   help=f"tasks per port that open and close connections back to back, from 127.0.0.2 "
                        f"(default {d.reconnect})")
    a.add_argument("--reconnect-rate", type=float, default=d.reconnect_rate,
                   help=f"... at most this many connections a second per port in all (default {d.reconnect_rate:g}; "
                        "0: as fast as they can, which on one machine takes the server's CPU as well)")
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
    pa = p.add_argument_group("preemption (--preemption: this instead of the attacks; bench/probe_preempt.py)")
    dp = probe_preempt.Preemption()
    pa.add_argument("--preemption", action="store_true",
                    help="the victim (high priority) asks while the greedy token's (low) stream holds the whole KV "
                         "cache, over SSE and gRPC both ways; the greedy streams must resume as one")
    pa.add_argument("--rounds", type=int, default=dp.rounds, help=f"default {dp.rounds} (each: both ways)")
    pa.add_argument("--preempt-kv-cache-gb", type=float, default=dp.kv_cache_gb,
                    help=f"the server it starts: decode.kv_cache_gb (default {dp.kv_cache_gb}: a few hundred tokens)")
    pa.add_argument("--metrics", help="attach: the router's /metrics host:port (the greedy token's preemptions)")
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
    for name in ("http_reconnect", "grpc_reconnect"):
        if f"{name}_per_s" in summary:
            rows.append((f"{name} rate", f"{summary[f'{name}_per_s']:.0f} connections/s"))
    for proto in ("http", "grpc"):
        rows.append((f"greedy again ({proto})", f"answered after {summary[f'greedy_again_{proto}_s']:.1f} s"))
    rows.append(("500 / INTERNAL", str(summary["http_500_or_grpc_internal"])))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's TERM stops the server it started too)
    c = Counts(idle_conns=args.idle_conns, slowloris=args.slowloris, trickle_s=args.trickle_s,
               grpc_idle=args.grpc_idle, watches=args.watches, unread=args.unread, grpc_unread=args.grpc_unread,
               unread_max_tokens=args.unread_max_tokens, nesting_kb=args.nesting_kb, reconnect=args.reconnect,
               reconnect_rate=args.reconnect_rate, greedy_wait_s=args.greedy_wait_s,
               victim_requests=args.victim_requests, victim_max_tokens=args.victim_max_tokens, hold_s=args.hold_s,
               reopen=args.reopen)
    if args.fairness:
        return probe_fairness.main(args)
    if args.preemption:
        return probe_preempt.main(args)
    with contextlib.ExitStack() as stack:
        t = aim(args, stack, ["mode=colocated", "decode.compile_decode=false"], greedy_cap=args.greedy_cap)
        if t is None:
            return 2
        tally, summary = asyncio.run(probe(t, c))
    report(table(tally, summary), tally, summary)
    return 1 if summary["http_500_or_grpc_internal"] or tally.victim_failures else 0


if __name__ == "__main__":
    sys.exit(main())
