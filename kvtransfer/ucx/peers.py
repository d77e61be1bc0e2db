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
reported (``transport.py``), never an error.

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

Stale peers. What UCX holds for a peer (its shared-memory segments, mapped: ~1-2.5 MB) stays
mapped while *our* UCX worker lives once that peer has connected back to it, whether or not
our endpoint is closed; only destroying the worker unmaps it. So the table counts, in
``stale``, the peers that are surely gone since our worker was made: an endpoint closed because
its process exited, a heard peer forgotten for the same reason, and an address superseded by
a newer one of the same uid (its process replaced its UCX worker: the generation in its
hello, or in a dialed address, is higher). ``transport.py`` replaces its worker when ``stale``
passes ``recycle_at`` (and hands the table the new one's endpoints from then on: ``take_endpoints``).
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
# Replace the UCX worker once this many peers are stale (or twice the live peers, if more): a
# replacement makes one stale peer in each live peer's table, so with at least twice the peers
# as the bound, the replacements it sets off elsewhere die out (each side: fewer than 1/2 per
# replacement). Memory held for stale peers stays below the bound times ~2.5 MB.
RECYCLE_MIN_STALE = 4


@dataclass
class Peer:
    address: bytes  # its worker address
    dialed: bool  # from connect(): kept until disconnect
    last: float  # monotonic time of the last message to or from it
    process: str | None = None  # its process (``this_process()``, from its address or hello); None: unknown
    gen: int = 0  # the generation of its UCX worker that ``address`` belongs to
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
        self.stale = 0  # peers surely gone since our UCX worker was made (module doc)
        self._gone: set[int] = set()  # uids whose process had exited, as of the last prune
        # endpoints to addresses their peers left (``_moved``), to close once no send uses them
        # (closing one cancels what is in flight on it: the peer's old worker still receives)
        self.superseded: list[object] = []
        self.recycle_at = RECYCLE_MIN_STALE  # ``stale`` at which to replace the UCX worker (module doc)

    def get(self, uid: int) -> Peer | None:
        return self._peers.get(uid)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))

    def __len__(self) -> int:
        return len(self._peers)

    def live_uids(self) -> list[int]:
        """Peers not known to be gone (as of the last prune, plus any since)."""
        return [u for u in self._peers if u not in self._gone]

    @property
    def num_endpoints(self) -> int:
        return len(self._eps)

    def dial(self, uid: int, address: bytes, process: str | None, now: float, gen: int = 0) -> None:
        p = self._peers.get(uid)
        if p is None:
            self._peers[uid] = Peer(address, True, now, process, gen=gen)
            return
        p.dialed = True
        if gen >= p.gen:  # an older address (a stale copy from the control plane) changes nothing
            self._moved(p, address, gen)
            p.process = process or p.process

    def heard(self, uid: int, address: bytes, now: float, process: str | None = None, gen: int = 0) -> None:
        """Record a hello (forgetting the least recently active heard peer past MAX_PEERS)."""
        p = self._peers.get(uid)
        if p is not None:
            p.last = now
            if gen >= p.gen:  # (a late hello of its older worker changes nothing)
                self._moved(p, address, gen)
                p.process = process or p.process
            return
        self._peers[uid] = Peer(address, False, now, process, gen=gen)
        while len(self._peers) > MAX_PEERS:
            heard = [(q.last, u) for u, q in self._peers.items() if not q.dialed and u != uid]
            if not heard:
                break
            del self._peers[min(heard)[1]]

    def _moved(self, p: Peer, address: bytes, gen: int) -> None:
        """``p`` is at ``address`` now; if that is a new one, its old one is gone for good (the
        peer replaced its UCX worker): our connection ends, and the old endpoint is closed once
        no send uses it (``close_superseded``)."""
        if address != p.address:
            old = self._eps.pop(p.address, None)
            if old is not None:
                self.stale += 1
                self.superseded.append(old[0])
            p.address, p.ep = address, None
        p.gen = gen

    def forget(self, uid: int) -> Peer | None:
        return self._peers.pop(uid, None)

    def close_superseded(self, in_use: Callable[[object], bool]) -> None:
        """Close the superseded endpoints no send is using any more."""
        keep = [ep for ep in self.superseded if in_use(ep)]
        for ep in self.superseded:
            if not any(ep is k for k in keep):
                self._close(ep)
        self.superseded = keep

    def take_endpoints(self) -> list[object]:
        """Hand over every endpoint (our UCX worker is being replaced: they go with it) and end
        every connection; peers are kept, ``stale`` starts again from 0."""
        eps = [ep for ep, _ in self._eps.values()] + self.superseded
        self._eps.clear()
        self.superseded = []
        for p in self._peers.values():
            p.ep = None
        self.stale = 0
        return eps

    def prune(self, now: float) -> None:
        """Apply the idle rules (at most every PRUNE_EVERY_S)."""
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_S
        # Each peer's process is looked up once per prune (a /proc read each)
        gone = {u for u, p in self._peers.items() if p.process is not None and process_gone(p.process)}
        for uid, p in list(self._peers.items()):
            idle = now - p.last
            if not p.dialed and (idle > PEER_IDLE_S or uid in gone):
                del self._peers[uid]
                if uid in gone and p.address not in self._eps:
                    self.stale += 1  # (one with an endpoint counts below)
                gone.discard(uid)
            elif idle > ENDPOINT_IDLE_S:
                p.ep = None
        for address, (ep, process) in list(self._eps.items()):
            if process is not None and process_gone(process):  # its peer died: nobody will use it
                del self._eps[address]
                self.stale += 1
                self._retire(ep)
        self._gone = gone  # the dialed ones left (kept until disconnect)
        self.recycle_at = max(RECYCLE_MIN_STALE, 2 * (len(self._peers) - len(gone)))

    def new_connection(self, p: Peer) -> None:
        """Set ``p.ep`` for a new connection to ``p``: the endpoint kept for its address, unless
        its process has surely exited, else a new one. Raises what ``make`` raises (nothing kept)."""
        ep, process = self._eps.pop(p.address, (None, None))
        process = p.process or process
        if ep is not None and process is not None and process_gone(process):
            self.stale += 1
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
        for ep in [ep for ep, _ in self._eps.values()] + self.superseded:
            self._close(ep)
        self._eps.clear()
        self.superseded = []
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
