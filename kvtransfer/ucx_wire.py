"""The UCX transport's wire protocol, address format and receive buffers (``ucx.py`` runs them).

Wire protocol. Every worker picks a random 32-bit ``uid``. A 64-bit UCX tag is
``kind (2 bits) | sender uid (32) | seq (30)``; a message to one peer is a header
(kind 1) and then each non-empty frame (kind 2, same seq), in order. The header is msgpack
``[1, seq, [frame lengths], sender address bytes | None]``, plus a fifth element, a str of
one ``"h"`` (host) or ``"d"`` (device) per frame, only when some frame is in GPU memory: four
elements (an older peer's header, or any host-only message) mean all host, so host traffic
is unchanged on the wire. The sender's address is in the first message of each connection (a
new one starts after a drop, a ``disconnect`` or an idle spell, on the same UCX endpoint:
``ucx_peers.py``), so the receiver can make the endpoint its replies use, and knows the
sender's earlier connection is gone. Each connection starts its seq at random (then +1 per
message, modulo 2^30), so tags of an earlier one's messages still in flight are not taken for
a new one's. The receiver probes for kind-1 tags from any
sender, so the peer id it reports is the sender's uid -- the same id the sender got from
``connect``. Lengths are checked against
``MAX_HEADER_BYTES`` / ``MAX_FRAME_BYTES`` / ``MAX_MESSAGE_BYTES`` / ``MAX_FRAMES`` before anything is allocated; a
peer that announces more is logged and ignored from then on.
"""

from __future__ import annotations

import base64
import sys

import msgpack
import numpy as np

MAX_FRAME_BYTES = 4 << 30  # announced frame lengths above this are refused
MAX_MESSAGE_BYTES = 4 << 30  # ... and so are messages announcing more in all (a layer's KV is far less)
MAX_FRAMES = 1 << 16
MAX_HEADER_BYTES = 1 << 20
WIRE_VERSION = 1
HEADER, DATA = 1, 2  # tag kinds
KIND_SHIFT, UID_SHIFT, SEQ_MASK = 62, 30, (1 << 30) - 1
_POOL_MIN_BYTES = 64 << 10  # smaller frames get a plain fresh buffer
_SCHEME = "ucx://"


def tag(kind: int, uid: int, seq: int) -> int:
    return (kind << KIND_SHIFT) | (uid << UID_SHIFT) | (seq & SEQ_MASK)


def peer_id(uid: int) -> str:
    return f"{uid:08x}"


class BufferPool:
    """Receive buffers that are handed out again once the caller has dropped every view.

    A fresh buffer page-faults on its first write, which costs about half the receive
    bandwidth; pooled numpy buffers (by power-of-two capacity, up to ``max_bytes`` in all) are
    reused when their refcount is back to the pool's own references: any view the caller still
    holds (memoryview, ``np.frombuffer``, ``torch.frombuffer``) keeps a reference.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._buckets: dict[int, list[np.ndarray]] = {}

    def take(self, n: int) -> memoryview:
        if n < _POOL_MIN_BYTES:
            return memoryview(np.empty(n, np.uint8))
        cap = 1 << (n - 1).bit_length()
        bucket = self._buckets.setdefault(cap, [])
        for arr in bucket:
            if sys.getrefcount(arr) == 3:  # the bucket, `arr`, getrefcount's argument: unused
                return memoryview(arr)[:n]
        arr = np.empty(cap, np.uint8)
        if self.bytes + cap <= self.max_bytes:
            bucket.append(arr)
            self.bytes += cap
        return memoryview(arr)[:n]


def parse_header(buf) -> tuple[int, list[int], bytes | None, str]:
    """(seq, frame lengths, sender address or None, memory kinds) of a received header.

    Raises:
        ValueError: not a header this version writes, or limits exceeded.
    """
    try:
        version, seq, lengths, hello, *rest = msgpack.unpackb(buf, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"undecodable header: {e}") from None
    kinds = rest[0] if len(rest) == 1 else "h" * len(lengths) if not rest and isinstance(lengths, list) else None
    if (version != WIRE_VERSION or not isinstance(seq, int) or not isinstance(lengths, list)
            or len(lengths) > MAX_FRAMES
            or not all(isinstance(n, int) and 0 <= n <= MAX_FRAME_BYTES for n in lengths)
            or sum(lengths) > MAX_MESSAGE_BYTES
            or not (hello is None or isinstance(hello, bytes))
            or not isinstance(kinds, str) or len(kinds) != len(lengths) or kinds.strip("hd")):
        raise ValueError(f"bad header fields {version!r}, {seq!r}, {str(lengths)[:80]}, {str(rest)[:40]}")
    return seq, lengths, hello, kinds


def format_address(uid: int, worker_address: bytes, process: str | None = None) -> str:
    """``ucx://<uid hex>/<base64 worker address>[/<process>]``; ``process`` (``ucx_peers``'s
    ``this_process()``) lets a peer on this host tell that it has exited."""
    tail = f"/{process}" if process else ""
    return f"{_SCHEME}{peer_id(uid)}/{base64.urlsafe_b64encode(worker_address).decode()}{tail}"


def pack_header(seq: int, lengths: list[int], kinds: str, hello: bytes | None) -> bytes:
    """The wire header; the memory-type string only when some frame is on a device."""
    fields = [WIRE_VERSION, seq, lengths, hello]
    return msgpack.packb(fields + [kinds] if "d" in kinds else fields)


def byte_view(buf: object) -> memoryview:
    """A flat unsigned-byte view of a contiguous host buffer (no copy)."""
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise ValueError(f"ucx frames must be host buffers (bytes, bytearray, memoryview), "
                         f"got {type(buf).__name__}") from e
    if not mv.c_contiguous:
        raise ValueError("ucx frame buffer is not C-contiguous")
    if mv.nbytes > MAX_FRAME_BYTES:
        raise ValueError(f"ucx frame of {mv.nbytes} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def parse_address(address: str) -> tuple[int, bytes, str | None]:
    """(uid, worker address, process or None) of a ``format_address`` string.

    Raises:
        ValueError: not a ucx address.
    """
    bad = ValueError(f"not a ucx address (want {_SCHEME}<uid hex>/<base64 worker address>[/<process>]): "
                     f"{str(address)[:80]!r}")
    if not isinstance(address, str) or not address.startswith(_SCHEME) or "/" not in address[len(_SCHEME):]:
        raise bad
    uid_hex, rest = address[len(_SCHEME):].split("/", 1)
    b64, _, process = rest.partition("/")
    try:
        uid, addr = int(uid_hex, 16), base64.urlsafe_b64decode(b64.encode())
    except ValueError as e:
        raise bad from e
    if not 0 <= uid < (1 << 32) or not addr:
        raise bad
    return uid, addr, process or None
