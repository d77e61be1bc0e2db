"""In-process frame transport: endpoints in one Python process exchange messages through deques.

For tests and single-process setups. Every endpoint gets a unique address
``inproc://<n>`` when it is built and is listed in a process-global registry under it;
``bind`` returns that address and ``connect`` just checks it exists. A message is delivered
by the destination's ``deliver`` (``(sender address, frames)`` into its inbox), so the peer id a
receiver sees is the sender's address, which is also what the sender's ``connect`` returned:
replies need no extra bookkeeping.

Buffers are copied at ``send`` (as a network would), so the sender may reuse its memory at
once and the receiver owns what it gets. Messages to a closed or unknown endpoint are dropped
silently, like packets to a dead host; the lifecycle's leases deal with that.

Connections are virtual: ``_connected`` holds the addresses this endpoint ``connect``-ed to
(and nothing else per peer). ``disconnect(peer)`` of one acts as if a connection had been cut:
it puts a drop mark in the peer's inbox, after what was already sent to it, and the peer's
``recv`` turns the mark into a ``dropped`` report (as a socket reset would reach it). A closed
endpoint tells nobody.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Sequence

from kvtransfer.base import MAX_DROP_REPORTS, Buffer, FrameTransport, register_transport

_REGISTRY: dict[str, InprocTransport] = {}
_LOCK = threading.Lock()
_IDS = itertools.count()


class InprocTransport(FrameTransport):
    """A FrameTransport whose endpoints live in this process (registered as ``"inproc"``)."""

    name = "inproc"

    def __init__(self) -> None:
        self.address = f"inproc://{next(_IDS)}"
        self._inbox: deque[tuple[str, list[Buffer] | None]] = deque()  # None: a drop mark
        self._dropped: deque[tuple[str, str]] = deque(maxlen=MAX_DROP_REPORTS)
        self._connected: set[str] = set()
        self._closed = False
        with _LOCK:
            _REGISTRY[self.address] = self

    def bind(self) -> str:
        """Returns:
            This endpoint's address (every endpoint is reachable from construction on).
        """
        self._check_open()
        return self.address

    def connect(self, address: str) -> str:
        """Args:
            address: another endpoint's address.
        Returns:
            The peer id for ``send``: the address itself.
        Raises:
            ConnectionError: nothing is registered at ``address``.
        """
        self._check_open()
        if address not in _REGISTRY:
            raise ConnectionError(f"no inproc endpoint at {address!r}")
        self._connected.add(address)
        return address

    def send(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Copy ``frames`` into ``peer``'s inbox; dropped if the peer is gone."""
        self._check_open()
        dest = _REGISTRY.get(peer)
        if dest is not None:
            dest.deliver(self.address, [bytes(f) for f in frames])

    def deliver(self, sender: str, frames: list[Buffer] | None) -> None:
        """A message from ``sender`` arrives here (another endpoint's ``send``), or with None
        a drop mark (its ``disconnect``)."""
        self._inbox.append((sender, frames))

    def recv(self) -> tuple[str, list[Buffer]] | None:
        """Returns:
            The oldest waiting (sender address, frames), or None (also at a drop mark).
        """
        if self._closed or not self._inbox:
            return None
        peer, frames = self._inbox.popleft()
        if frames is None:
            self._dropped.append((peer, "the peer disconnected"))
            return None
        return peer, frames

    def disconnect(self, peer: str) -> None:
        """Cut the (virtual) connection: ``peer`` gets a drop mark after what it has already."""
        if peer not in self._connected:
            return
        self._connected.discard(peer)
        dest = _REGISTRY.get(peer)
        if dest is not None and not self._closed:
            dest.deliver(self.address, None)

    def dropped(self) -> list[tuple[str, str]]:
        out = list(self._dropped)
        self._dropped.clear()
        return out

    def close(self) -> None:
        """Unregister; messages still queued here are discarded. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with _LOCK:
            _REGISTRY.pop(self.address, None)
        self._inbox.clear()
        self._connected.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"inproc transport {self.address} is closed")


register_transport("inproc", InprocTransport)
