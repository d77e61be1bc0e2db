"""Whom a UCX transport talks to: one record per peer uid, and when it is forgotten.

A record holds the peer's worker address and, once a message went to it, our endpoint to it.
It is made by ``connect`` (*dialed*: kept until ``disconnect``) or by the peer's hello (the
address in the first message of each of its endpoints: *heard*). Only the progress thread
touches the table. Three rules keep it bounded while peers come and go:

- an endpoint idle for ``ENDPOINT_IDLE_S`` is closed; the next message to that peer makes a
  new one, whose first message carries our address again;
- a heard record idle for ``PEER_IDLE_S`` is forgotten. That is safe: the peer's own endpoint
  to us has then been idle for more than ``ENDPOINT_IDLE_S`` too, so it is closed and its next
  message brings its address back;
- past ``MAX_PEERS`` records, the least recently active heard one is forgotten at once.

"Idle": no message to or from the peer. A message to a forgotten peer is dropped and
reported (``ucx.py``), never an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# Long enough that a live peer's endpoint is never recycled mid-conversation (a waiting
# transfer is renewed every lease/3 = 40 s), short enough that peers gone for good release
# their endpoints (shared-memory segments) within minutes.
ENDPOINT_IDLE_S = 300.0
# Twice the above: the peer's endpoint to us is surely closed by then (see the module doc),
# with ENDPOINT_IDLE_S of slack for messages in flight.
PEER_IDLE_S = 2 * ENDPOINT_IDLE_S
# Far more peers than a cluster has workers; a bound on what a flood of made-up uids can cost.
MAX_PEERS = 4096
PRUNE_EVERY_S = 5.0  # how often idle records are looked for: idleness is measured in minutes


@dataclass
class Peer:
    address: bytes  # its worker address
    dialed: bool  # from connect(): kept until disconnect
    last: float  # monotonic time of the last message to or from it
    ep: object | None = None  # our endpoint to it, made on the first message
    seq: int = 0  # seq of the next message on ``ep``


class PeerTable:
    """uid -> :class:`Peer`, with the forgetting rules of the module docstring."""

    def __init__(self) -> None:
        self._peers: dict[int, Peer] = {}
        self._next_prune = 0.0

    def get(self, uid: int) -> Peer | None:
        return self._peers.get(uid)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))

    def __len__(self) -> int:
        return len(self._peers)

    def dial(self, uid: int, address: bytes, now: float) -> None:
        p = self._peers.get(uid)
        if p is None:
            self._peers[uid] = Peer(address, True, now)
        else:
            p.address, p.dialed = address, True

    def heard(self, uid: int, address: bytes, now: float) -> list[Peer]:
        """Record a hello. Returns the records evicted to stay within MAX_PEERS (close their
        endpoints)."""
        p = self._peers.get(uid)
        if p is not None:
            p.address, p.last = address, now
            return []
        self._peers[uid] = Peer(address, False, now)
        evicted = []
        while len(self._peers) > MAX_PEERS:
            heard = [(q.last, u) for u, q in self._peers.items() if not q.dialed and u != uid]
            if not heard:
                break
            evicted.append(self._peers.pop(min(heard)[1]))
        return evicted

    def forget(self, uid: int) -> Peer | None:
        return self._peers.pop(uid, None)

    def prune(self, now: float) -> list[object]:
        """Apply the idle rules (at most every PRUNE_EVERY_S). Returns endpoints to close."""
        if now < self._next_prune:
            return []
        self._next_prune = now + PRUNE_EVERY_S
        closing = []
        for uid, p in list(self._peers.items()):
            idle = now - p.last
            if not p.dialed and idle > PEER_IDLE_S:
                del self._peers[uid]
            elif p.ep is None or idle <= ENDPOINT_IDLE_S:
                continue
            if p.ep is not None:
                closing.append(p.ep)
                p.ep = None
        return closing
