"""The probe's reconnect flood: clients that open and close connections back to back on the
HTTP and the gRPC port (no token).

Each of ``loops`` tasks per port: connect (from ``source``, by default another loopback
address than the victim's, as an attacker elsewhere would be), on gRPC send HTTP/2's client
preface and an empty SETTINGS frame (the server sets up a transport for it), then close with a
reset (SO_LINGER 0: no TIME_WAIT on this side, so the loop never runs out of ports), and at
once again; with ``rate``, at most that many connections a second per port in all. The flood
runs in a process of its own (``python -m bench.probe_reconnect``, until its stdin closes), so
that its loop does not delay the victim's client in the probe's; on one machine it still takes
CPU from the server it attacks (a tight loop about a core), which an attacker elsewhere would
not. Tallied per port (``http reconnect``, ``grpc reconnect``): ``cycles`` done, and each way a
connect failed; ``{http,grpc}_reconnect_per_s`` in the summary.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import asyncio
import collections
import json
import socket
import struct
import subprocess
import sys
import time

from bench.probe_wire import Tally, Target, split

SOURCE = "127.0.0.2"  # the flood's address (Linux routes all of 127/8 to loopback)
# HTTP/2's client connection preface, then an empty SETTINGS frame (length 0, type 4, no flags, stream 0)
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends RST
PORTS = ("http reconnect", "grpc reconnect")


class Reconnects:
    """The flood's process (``start``, ``stop``); what it counted goes into the tally."""

    def __init__(self, t: Target, tally: Tally, loops: int, rate: float = 0.0, source: str = SOURCE) -> None:
        self.t, self.tally, self.loops, self.rate, self.source = t, tally, loops, rate, source
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.loops:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.probe_reconnect", "--http", self.t.http, "--grpc", self.t.grpc,
                 "--loops", str(self.loops), "--rate", str(self.rate), "--source", self.source],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def stop(self) -> dict:
        """End the flood; its rate per port (connections a second) as summary keys."""
        if self.proc is None:
            return {}
        try:
            out, _ = await asyncio.to_thread(self.proc.communicate, "", 60)  # (stdin closed: it stops)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        done = json.loads(out.strip().splitlines()[-1])
        for name in PORTS:
            for outcome, n in done[name].items():
                self.tally.outcomes[name][outcome] += n
        return {f"{name.replace(' ', '_')}_per_s": done[name].get("cycles", 0) / max(done["seconds"], 1e-9)
                for name in PORTS}


async def flood(http: str, grpc: str, loops: int, rate: float, source: str, until: asyncio.Future) -> dict:
    """Open and reset connections until ``until`` is done; outcome counts per port."""
    counts = {name: collections.Counter() for name in PORTS}
    loop = asyncio.get_running_loop()

    async def one_port(name: str, addr: str, hello: bytes) -> None:
        host, port = split(addr)
        gap = loops / rate if rate else 0.0  # each task's share of the rate
        due = time.monotonic()
        while True:
            s = socket.socket()
            s.setblocking(False)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
            try:
                s.bind((source, 0))
                await loop.sock_connect(s, (host, port))
                if hello:
                    await loop.sock_sendall(s, hello)
                counts[name]["cycles"] += 1
            except OSError as e:
                counts[name][f"connect failed: {e.strerror}"] += 1
                await asyncio.sleep(0.01)  # (a refused connect costs this side only)
            finally:
                s.close()
            due += gap
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    tasks = [asyncio.create_task(one_port(name, addr, hello))
             for _ in range(loops) for name, addr, hello in ((PORTS[0], http, b""), (PORTS[1], grpc, H2_PREFACE))]
    await until
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description="A reconnect flood on two ports until stdin closes; prints its "
                                            "counts as one JSON line (bench/probe.py runs it).")
    p.add_argument("--http", required=True)
    p.add_argument("--grpc", required=True)
    p.add_argument("--loops", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--source", default=SOURCE)
    args = p.parse_args()

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        closed = loop.create_future()
        # stdin's end, read on a thread (the loop stays free for the flood)
        loop.run_in_executor(None, sys.stdin.read).add_done_callback(
            lambda _: loop.call_soon_threadsafe(lambda: closed.done() or closed.set_result(None)))
        t0 = time.monotonic()
        counts = await flood(args.http, args.grpc, args.loops, args.rate, args.source, closed)
        return {"seconds": time.monotonic() - t0, **{k: dict(v) for k, v in counts.items()}}
    print(json.dumps(asyncio.run(run())), flush=True)


if __name__ == "__main__":
    main()
