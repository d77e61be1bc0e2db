"""Who may speak on the KV plane: message authentication codes (MACs) on every message.

Without it, anyone who reaches a decode worker's KV endpoint can write into reserved blocks
(a wrong answer served with OK), fail or renew transfers, or answer a handshake. With a
:class:`PlaneAuth` on both sides (pdserve's workers always have one) every message carries a
MAC as its last frame, and one without a valid MAC is dropped and counted
(``TransferStats.forged``); it changes nothing. One exception: a KV data message whose MAC
fails, sent by a transport peer that already began that transfer (its ``begin`` carried a
valid cluster MAC), fails the transfer at once (``receiver.py``): it was damaged in transit,
and such a peer could fail the transfer anyway with a ``fail`` message. Two keys:

- the **cluster key** (the router makes it at start and hands it to each worker actor; every
  worker of one cluster holds it) signs the lifecycle: hello/hello_ok, begin, renew, ack, fail.
- a **transfer secret** (made by the receiver in ``expect``, carried to the chosen sender by the
  router through Ray calls, never on the KV wire) signs what becomes output: every KV data
  frame and the ``end`` trailer (decode's first token). Only the sender the router chose can
  write into a transfer's blocks, and no frame of an earlier transfer (the same id again, with
  another secret) can be replayed into it. A replayed lifecycle message can at worst fail a
  transfer, and the request then runs again: never a wrong token.

Framing with a key: a control message is ``[body, mac]``, a data message ``[header, K, V, mac]``;
``mac = HMAC-SHA256(key, frames)[:16]``. ``integrity`` says what a data frame's MAC covers:
``"header"`` (the default) the header, which carries the xxh3 checksum of the K and V bytes:
nobody without the transfer's secret can inject or replay a frame, and bit errors fail it, at
no measurable cost; the bytes are then as safe against an attacker who can *modify* traffic in
flight as xxh3 (not a cryptographic hash) makes them. ``"full"`` MACs the K and V bytes too:
cryptographic integrity against such an attacker, for most of the KV throughput (measured:
``bench/kv_transfer.py``, rows ``machdr`` and ``mac``: 5.2 vs 1.4 GB/s over UCX for 8,192
tokens on the 2-core dev box). Such an attacker also reads the KV (nothing is encrypted): the
cluster's network is meant to be private, so the default is ``header``. A transport that
moves KV straight from GPU memory (``device_frames``) gets ``"header"`` (``for_transport``):
hashing would mean a copy to the host.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.base import Buffer

MAC_BYTES = 16  # 128 bits of HMAC-SHA256: forging one is a 2^-128 guess per message
SECRET_BYTES = 32
INTEGRITY = ("full", "header")


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def mac(key: bytes, frames: Sequence[Buffer]) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        h.update(f)
    return h.digest()[:MAC_BYTES]


def derive(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """A key for one purpose (``label``) and one context (``parts``): HMAC-SHA256 under ``key``
    of the length-prefixed parts, so no two contexts share a derived key (``b"ab", b"c"`` is
    not ``b"a", b"bc"``)."""
    h = hmac.new(key, label, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def verify(key: bytes, frames: Sequence[Buffer], tag: bytes | None) -> bool:
    """Whether ``tag`` is the MAC of ``frames`` under ``key`` (compared in constant time)."""
    return tag is not None and hmac.compare_digest(mac(key, frames), tag)


@dataclass(frozen=True)
class PlaneAuth:
    """The cluster key and what data MACs cover; one per sender or receiver. Its repr never
    shows the key (logs, tracebacks, Ray's task errors print reprs)."""

    key: bytes = field(repr=False)
    integrity: str = "header"

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("a KV plane key needs at least 16 bytes")
        if self.integrity not in INTEGRITY:
            raise ValueError(f"kv integrity {self.integrity!r}; valid: {', '.join(INTEGRITY)}")

    def for_transport(self, transport) -> PlaneAuth:
        """This, or ``"header"`` integrity for a transport whose frames may stay on the GPU."""
        if getattr(transport, "device_frames", False) and self.integrity == "full":
            return PlaneAuth(self.key, "header")
        return self

    def _covered(self, frames: Sequence[Buffer]) -> Sequence[Buffer]:
        if len(frames) == 3 and self.integrity == "header":
            return frames[:1]
        return frames

    def seal(self, frames: Sequence[Buffer], secret: bytes | None = None) -> list[Buffer]:
        """``frames`` plus their MAC: under ``secret`` (data, ``end``), else the cluster key."""
        return [*frames, mac(secret or self.key, self._covered(frames))]

    @staticmethod
    def split(frames: Sequence[Buffer]) -> tuple[list[Buffer], bytes | None]:
        """(the message without its MAC frame, the MAC); a MAC of the wrong size is None."""
        if len(frames) < 2:
            return list(frames), None
        tag = bytes(frames[-1])
        return list(frames[:-1]), tag if len(tag) == MAC_BYTES else None

    def valid(self, frames: Sequence[Buffer], tag: bytes | None, secret: bytes | None = None) -> bool:
        """Whether ``tag`` is the MAC of ``frames`` under ``secret`` (else the cluster key)."""
        return verify(secret or self.key, self._covered(frames), tag)
