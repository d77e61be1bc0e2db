"""New connections per client address, at a rate: a token bucket per address.

A client that opens and closes connections in a tight loop holds none for long, so the caps
on open connections (router.http_conn ``ConnTable``) never meet it; what it costs is each
connection's setup on the event loop that also serves every request (bench/README.md,
*Reconnect floods*: a refused connection costs about half of an accepted one).
``NewConnections.admit`` is asked before any of uvicorn's setup: each address may
open ``rate`` connections a second, ``burst`` at once; beyond, the connection is reset at
once (router.http_conn), for the least work the server can do for it. A client with
keep-alive connections, or one opening a few a second, never meets it.

The table holds only addresses whose bucket is not full: at ``PRUNE_AT`` entries the full
ones (idle for ``burst / rate`` seconds) are dropped, at most once in that time (a sweep is
linear in the table), so the table stays bounded by the addresses that opened connections in
the last few seconds, not by every address ever seen.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable

PRUNE_AT = 4096  # entries before the full buckets are dropped
IPV6_PREFIX = 64  # an IPv6 client is its /64: one host commonly holds a whole /64


def client_key(address: str) -> str:
    """The client an address counts as, for every per-client limit on both ports: an IPv4
    address itself (also when IPv4-mapped, ``::ffff:1.2.3.4``), an IPv6 address's /64 network
    (a host given a /64 could otherwise take a fresh address, and a fresh allowance, for every
    connection), anything else (a unix socket's name) as it is."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # (a zone index, fe80::1%eth0)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_PREFIX), strict=False))
    return str(ip)


class NewConnections:
    """``rate`` new connections a second per address, ``burst`` at once (``admit``)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst, self.clock = rate, burst, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)
        self.pruned_at = -float("inf")

    def admit(self, address: str) -> bool:
        """Take one new connection from ``address``'s bucket; False: over its rate (refuse it)."""
        now = self.clock()
        tokens = self._tokens(address, now)
        if tokens < 1:
            self.buckets[address] = (tokens, now)
            return False
        if len(self.buckets) >= PRUNE_AT and now - self.pruned_at >= self.burst / self.rate:
            self._prune(now)
        self.buckets[address] = (tokens - 1, now)
        return True

    def _tokens(self, address: str, now: float) -> float:
        held = self.buckets.get(address)
        if held is None:
            return self.burst
        tokens, at = held
        return min(self.burst, tokens + (now - at) * self.rate)

    def _prune(self, now: float) -> None:
        self.pruned_at = now
        for address in [a for a in self.buckets if self._tokens(a, now) >= self.burst]:
            del self.buckets[address]
