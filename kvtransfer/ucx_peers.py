"""Whom a UCX transport talks to: one record per peer uid, when it is forgotten, and the UCX
endpoints its connections go on.

A record holds the peer's worker address and, while a connection to it is open, our endpoint
to it. It is made by ``connect`` (*dialed*: kept until ``disconnect``) or by the peer's hello
(the address in the first message of each of its connections: *heard*). Only the progress
thread touches the table. Three rules keep it bounded while peers come and go:

- a connection idle for ``ENDPOINT_IDLE_S`` ends; the next message to that peer starts a new
  one, whose first message carries our address again;
- a heard record idle for ``PEER_IDLE_S`` is forgotten. That is safe: the peer's own
  connection to us has then been idle for more than ``ENDPOINT_IDLE_S`` too, so it has ended
  and its next message brings its address back;
- past ``MAX_PEERS`` records, the least recently active heard one is forgotten at once.

"Idle": no message to or from the peer. A message to a forgotten peer is dropped and
reported (``ucx.py``), never an error.

Endpoints: one per worker address, made by the first connection to it and reused by every
later one (each still starts with a hello and a fresh seq: the peer sees a new connection).
Why: every new endpoint maps the peer's shared-memory segments once more, and closing one made
without error handling (ours: with it UCX drops shared memory) unmaps nothing while our UCX
worker lives once the peer has connected back to it, as UCX's rendezvous does for messages
above its shared-memory eager size (ucp_ep.c: "not destroying ep because of connection from
remote"). An endpoint per connection grew a prefill worker's RSS by 10-33 MB per reconnection
(30 severed connections: SysV mappings 4 -> 62, RSS 1191 -> 1242 MB). Ending a connection
(disconnect, drop, idle) therefore closes nothing. An endpoint is closed for good
only when a send on it failed (``discard``), when the process at its address has surely exited
(checked as a connection starts: a kept endpoint would take messages to a dead peer silently,
where making a new one fails at once; and every ``PRUNE_EVERY_S`` for every kept endpoint whose
process is known: a restarted peer comes back at a new address, so the dead one's endpoint
would otherwise be kept, with what UCX holds for it, until ``MAX_PEERS``), past ``MAX_PEERS``
endpoints (least recently connected first), and when the transport closes (``close_all``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Long enough that a live peer's connection is never restarted mid-conversation (a waiting
# transfer is renewed every lease/3 = 40 s); what it is for: heard peers can be forgotten
# (PEER_IDLE_S). Ending a connection releases nothing: its endpoint is kept for the next.
ENDPOINT_IDLE_S = 300.0
# Twice the above: the peer's connection to us has surely ended by then (see the module doc),
# with ENDPOINT_IDLE_S of slack for messages in flight.
PEER_IDLE_S = 2 * ENDPOINT_IDLE_S
# Far more peers than a cluster has workers; a bound on what a flood of made-up uids (or of
# restarted workers' addresses, endpoints) can cost.
MAX_PEERS = 4096
PRUNE_EVERY_S = 5.0  # how often idle records are looked for: idleness is measured in minutes


@dataclass
class Peer:
    address: bytes  # its worker address
    dialed: bool  # from connect(): kept until disconnect
    last: float  # monotonic time of the last message to or from it
    process: str | None = None  # its process (``this_process()``, from its address string); None: unknown
    ep: object | None = None  # our endpoint to it while a connection is open
    seq: int = 0  # seq of the next message of that connection


class PeerTable:
    """uid -> :class:`Peer`, with the forgetting rules of the module docstring, and worker
    address -> our endpoint to it.

    Args:
        make: makes an endpoint to a worker address (raises when it cannot).
        close: closes an endpoint for good.
    """

    def __init__(self, make: Callable[[bytes], object], close: Callable[[object], None]) -> None:
        self._make, self._close = make, close
        self._peers: dict[int, Peer] = {}
        # address -> (endpoint, its process if known); least recently connected first
        self._eps: dict[bytes, tuple[object, str | None]] = {}
        self._next_prune = 0.0

    def get(self, uid: int) -> Peer | None:
        return self._peers.get(uid)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def num_endpoints(self) -> int:
        return len(self._eps)

    def dial(self, uid: int, address: bytes, process: str | None, now: float) -> None:
        p = self._peers.get(uid)
        if p is None:
            self._peers[uid] = Peer(address, True, now, process)
        else:
            p.address, p.dialed, p.process = address, True, process

    def heard(self, uid: int, address: bytes, now: float) -> None:
        """Record a hello (forgetting the least recently active heard peer past MAX_PEERS)."""
        p = self._peers.get(uid)
        if p is not None:
            p.address, p.last = address, now
            return
        self._peers[uid] = Peer(address, False, now)
        while len(self._peers) > MAX_PEERS:
            heard = [(q.last, u) for u, q in self._peers.items() if not q.dialed and u != uid]
            if not heard:
                break
            del self._peers[min(heard)[1]]

    def forget(self, uid: int) -> Peer | None:
        return self._peers.pop(uid, None)

    def prune(self, now: float) -> None:
        """Apply the idle rules (at most every PRUNE_EVERY_S)."""
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_S
        for uid, p in list(self._peers.items()):
            idle = now - p.last
            if not p.dialed and idle > PEER_IDLE_S:
                del self._peers[uid]
            elif idle > ENDPOINT_IDLE_S:
                p.ep = None
        for address, (ep, process) in list(self._eps.items()):
            if process is not None and process_gone(process):  # its peer died: nobody will use it
                del self._eps[address]
                self._retire(ep)

    def new_connection(self, p: Peer) -> None:
        """Set ``p.ep`` for a new connection to ``p``: the endpoint kept for its address, unless
        its process has surely exited, else a new one. Raises what ``make`` raises (nothing kept)."""
        ep, process = self._eps.pop(p.address, (None, None))
        process = p.process or process
        if ep is not None and process is not None and process_gone(process):
            self._retire(ep)  # making a new one reports it unreachable
            ep = None
        if ep is None:
            ep = self._make(p.address)
        self._eps[p.address] = (ep, process)
        p.ep = ep
        while len(self._eps) > MAX_PEERS:
            self._retire(self._eps.pop(next(iter(self._eps)))[0])

    def discard(self, ep: object) -> None:
        """Close a broken endpoint for good: the next connection to its address makes a new one."""
        for address in [a for a, (e, _) in self._eps.items() if e is ep]:
            del self._eps[address]
            self._retire(ep)

    def close_all(self) -> None:
        """Close every endpoint and forget every peer (the transport is closing)."""
        for ep, _ in self._eps.values():
            self._close(ep)
        self._eps.clear()
        self._peers.clear()

    def _retire(self, ep: object) -> None:
        for p in self._peers.values():  # (rare: a failed send, a dead peer, MAX_PEERS addresses)
            if p.ep is ep:
                p.ep = None  # its connection ends: the next message starts a new one
        self._close(ep)


@functools.cache
def _host() -> tuple[str, int]:
    """(boot id, PID namespace): processes that share both see the same pids."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip().replace("-", "")
    return boot, os.stat("/proc/self/ns/pid").st_ino


def _stat(pid: int) -> tuple[str, str]:
    """(state, start time) of a process: fields 3 and 22 of /proc/<pid>/stat (the start time
    tells a reused pid apart)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def this_process() -> str | None:
    """This process as ``<boot id>.<pid namespace>.<pid>.<start time>``; None without /proc."""
    try:
        boot, ns = _host()
        return f"{boot}.{ns}.{os.getpid()}.{_stat(os.getpid())[1]}"
    except (OSError, IndexError):
        return None


def process_gone(process: str) -> bool:
    """Whether ``process`` (another's ``this_process()``) has surely exited: it ran on this host
    in this PID namespace, and its pid is gone, a zombie, or names a later process. False when
    that cannot be told (another host or namespace, no /proc)."""
    try:
        boot, ns, pid, start = process.split(".")
        if (boot, int(ns)) != _host() or int(pid) <= 0:
            return False
    except (OSError, ValueError):
        return False
    try:
        state, started = _stat(int(pid))
        return started != start or state in ("Z", "X", "x")  # exited, not yet reaped: a zombie
    except FileNotFoundError:
        # No such process any more, unless /proc hides other users' processes (hidepid): then
        # init is hidden too, and a missing pid tells nothing.
        return os.path.exists("/proc/1/stat")
    except (OSError, IndexError):
        return False
