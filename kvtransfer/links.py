"""The KV sender's connections: one per receiver address, its handshake, drops and re-dials.

States of one :class:`Link`::

    dial() ─► connecting ──hello_ok, a model we can send to──► ready ──connection dropped──► dropped
                 │     (connect() waits for it; after a drop,                                  │
                 │      begin() dials and sends at once)          begin() or connect(): dial() again
                 ├── another model or no common heads ─► refused: forgotten (LayoutMismatch)
                 └── no hello_ok by its deadline (a background re-dial) ─► dropped

When a link drops, closes or is refused, the transfers on it FAIL (through ``fail_on``, the
sender's). Those that failed because the connection dropped could not be told to the
receiver: their ``fail`` goes out first on the next connection to it (``untold``), so a
receiver that did not notice the drop itself frees their blocks then rather than at its lease.

Tables (exactly these): ``_links`` (receiver → :class:`Link`, keyed by the transport's
``identity`` of its address, so every address one receiver has had finds its link; forgotten by
``forget``, when refused, or when a blocking handshake times out) and ``_hello`` (peer id →
the layout its hello_ok carried; only while a handshake to it waits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvtransfer.base import Buffer, FrameTransport, KVLayout
from kvtransfer.receiver import encode_control, layout_from_wire, layout_to_wire

# A re-dial that begin() started may wait this long for the receiver's hello_ok before the
# transfers on it fail: connect()'s default wait for the same reply.
RECONNECT_TIMEOUT_S = 10.0


class LayoutMismatch(ValueError):
    """The receiver's KV layout cannot take this sender's KV (other model, or no common heads)."""


@dataclasses.dataclass
class Link:
    peer: str  # the transport's peer id for the current connection
    address: str  # the receiver's address, the newest given
    layout: KVLayout | None  # the receiver's, from its last hello_ok (None before the first)
    state: str = "connecting"  # connecting | ready | dropped | refused
    deadline: float | None = None  # a background re-dial: no hello_ok by then (sender's clock) fails it
    why: str | None = None  # why it was refused, or why it dropped
    untold: list[str] = dataclasses.field(default_factory=list)  # failed by a drop, fail not yet sent


class Links:
    """The links of one sender (see the module doc).

    Args:
        transport: the sender's transport.
        layout: the sender's cache layout.
        send: sends control messages (MAC'd as the sender does).
        clock: the sender's clock (re-dial deadlines).
        fail_on: ``fail_on(peer, reason, notify)`` FAILs the live transfers on ``peer`` and
            returns their ids.
    """

    def __init__(self, transport: FrameTransport, layout: KVLayout, send: Callable[[str, list[Buffer]], None],
                 clock: Callable[[], float], fail_on: Callable[[str, str, bool], list[str]]) -> None:
        self.transport, self.layout, self._send, self._clock, self._fail_on = transport, layout, send, clock, fail_on
        self._links: dict[str, Link] = {}
        self._hello: dict[str, KVLayout | None] = {}

    def get(self, address: str) -> Link | None:
        """The link to the receiver at ``address``, which may be a newer address of it than the
        link's: the transport is told (it keeps whichever is newer), so a peer that missed the
        receiver's announcement of it follows the control plane's copy."""
        link = self._links.get(self.transport.identity(address))
        if link is not None and address != link.address:
            self.transport.connect(address)  # (the same peer id: a record update, no handshake)
            link.address = address
        return link

    def dial(self, address: str, deadline: float | None = None) -> Link:
        """The link to ``address``: a fresh connection and hello unless it is ready or
        connecting already. Messages sent on it from now on follow the hello."""
        key = self.transport.identity(address)
        link = self._links.get(key)
        if link is not None and link.state in ("ready", "connecting"):
            return link
        peer = self.transport.connect(address)
        self._hello[peer] = None
        self._send(peer, encode_control("hello", layout=layout_to_wire(self.layout)))
        new = Link(peer, address, link.layout if link is not None else None, deadline=deadline)
        for tid in link.untold if link is not None else ():
            self._send(peer, encode_control("fail", id=tid, reason="the connection it went on dropped"))
        self._links[key] = new
        return new

    def answered(self, peer: str, wire_layout: object) -> None:
        """A hello_ok from ``peer``: kept only if a handshake to it waits."""
        layout = layout_from_wire(wire_layout)
        if layout is not None and peer in self._hello and self._hello[peer] is None:
            self._hello[peer] = layout

    def settle(self) -> None:
        """Finish the handshakes whose answer arrived; fail those past their deadline."""
        for link in list(self._links.values()):
            if link.state != "connecting":
                continue
            address = link.address
            remote = self._hello.get(link.peer)
            if remote is not None:
                del self._hello[link.peer]
                self._answered(address, link, remote)
            elif link.deadline is not None and self._clock() >= link.deadline:
                self.close(address, f"KV receiver at {address} did not answer the re-handshake within "
                                    f"{RECONNECT_TIMEOUT_S:g}s", forget=False)

    def _answered(self, address: str, link: Link, remote: KVLayout) -> None:
        error = self.mismatch(address, remote)
        if error is not None:
            link.why = error
            self.close(address, error, forget=True)
            link.state = "refused"
            return
        if link.layout is not None and remote != link.layout:  # restarted with other heads or blocks
            self._fail_on(link.peer, f"KV receiver at {address} came back with another layout", True)
        link.layout, link.state = remote, "ready"

    def dropped(self, peer: str, why: str) -> None:
        """The transport reports ``peer``'s connection dropped: its transfers FAIL (the receiver
        is told on the next connection) and the link waits for the next dial."""
        self._hello.pop(peer, None)
        for link in self._links.values():
            if link.peer == peer and link.state in ("ready", "connecting"):
                link.state, link.why = "dropped", why
                link.untold += self._fail_on(peer, f"connection to KV receiver {link.address} dropped: {why}", False)

    def close(self, address: str, reason: str, forget: bool) -> None:
        """Close the connection to ``address`` (transfers on it FAIL with ``reason``); forget
        the address, or leave it dropped. No-op for an unknown address."""
        key = self.transport.identity(address)
        link = self._links.get(key)
        if link is None:
            return
        failed = self._fail_on(link.peer, reason, link.state == "ready")
        self._hello.pop(link.peer, None)
        self.transport.disconnect(link.peer)
        if forget:
            del self._links[key]
        else:
            link.state, link.why = "dropped", reason
            link.untold += failed

    def common_heads(self, remote: KVLayout) -> tuple[int, int] | None:
        lo, hi = max(self.layout.heads[0], remote.heads[0]), min(self.layout.heads[1], remote.heads[1])
        return (lo, hi) if lo < hi else None

    def mismatch(self, address: str, remote: KVLayout) -> str | None:
        """Why this sender cannot send to a receiver of layout ``remote``; None if it can."""
        mine = self.layout
        if remote.fingerprint != mine.fingerprint:
            return (f"KV receiver at {address} has model fingerprint {remote.fingerprint!r}, "
                    f"this sender {mine.fingerprint!r}: different model or architecture")
        shape = ("num_layers", "num_kv_heads", "head_dim")
        if any(getattr(remote, f) != getattr(mine, f) for f in shape):
            return (f"KV receiver at {address} has layers/heads/head_dim "
                    f"{[getattr(remote, f) for f in shape]}, this sender {[getattr(mine, f) for f in shape]}")
        if self.common_heads(remote) is None:
            return f"KV receiver at {address} holds heads {remote.heads}, this sender {mine.heads}: nothing to send"
        return None
