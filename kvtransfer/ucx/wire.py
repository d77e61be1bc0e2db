"""The UCX transport's wire protocol, address format and receive buffers (``transport.py`` runs them).

Wire protocol. Every worker picks a random 32-bit ``uid``. A 64-bit UCX tag is
``kind (2 bits) | sender uid (32) | seq (30)``; a message to one peer is a header
(kind 1) and then each non-empty frame (kind 2, same seq), in order. The header is msgpack
``[1, seq, [frame lengths], sender address bytes | None]``, plus a fifth element, a str of
one ``"h"`` (host) or ``"d"`` (device) per frame, only when some frame is in GPU memory: four
elements (an older peer's header, or any host-only message) mean all host, so host traffic
is unchanged on the wire. The sender's address is in the first message of each connection (a
new one starts after a drop, a ``disconnect`` or an idle spell, on the same UCX endpoint:
``peers.py``), so the receiver can make the endpoint its replies use, and knows the
sender's earlier connection is gone. Each connection starts its seq at random (then +1 per
message, modulo 2^30), so tags of an earlier one's messages still in flight are not taken for
a new one's. The receiver probes for kind-1 tags from any
sender, so the peer id it reports is the sender's uid -- the same id the sender got from
``connect``. A header that carries the address also carries, as its sixth and seventh elements
(the memory-type string is then always the fifth), the sender's process (``peers``'s
``this_process()``, or None) and the *generation* of its UCX worker (0 first; a transport that
replaces its worker, ``transport.py``, counts up): the receiver then knows when that process has
exited, and which of two addresses of one uid is the newer (an older version refuses such a
header: the workers of one cluster run one version). Lengths are checked against
``MAX_HEADER_BYTES`` / ``MAX_FRAME_BYTES`` / ``MAX_MESSAGE_BYTES`` / ``MAX_FRAMES`` before anything is allocated; a
peer that announces more is logged and ignored from then on.

With a key (the cluster key: ``UcxTransport(key=...)``) a header is followed by its MAC
(``seal_header``: HMAC-SHA256 under the key of the sender's uid and the header, 16 bytes),
and the receiver checks it before it parses the header or allocates anything; a header
without a valid MAC bans its sender like a bad one. The KV plane's own MACs (``auth.py``)
still cover every message: this one only keeps strangers from making a receiver allocate.
"""

from __future__ import annotations

import base64
import sys

import msgpack
import numpy as np

from kvtransfer.auth import MAC_BYTES, mac, verify

MAX_FRAME_BYTES = 4 << 30  # announced frame lengths above this are refused
MAX_MESSAGE_BYTES = 4 << 30  # ... and so are messages announcing more in all (a layer's KV is far less)
MAX_FRAMES = 1 << 16
MAX_HEADER_BYTES = 1 << 20
MAX_PROCESS_CHARS = 128  # a process string (boot id, namespace, pid, start time) is ~60
WIRE_VERSION = 1
HEADER, DATA = 1, 2  # tag kinds
KIND_SHIFT, UID_SHIFT, SEQ_MASK = 62, 30, (1 << 30) - 1
_POOL_MIN_BYTES = 64 << 10  # smaller frames get a plain fresh buffer
_SCHEME = "ucx://"


def tag(kind: int, uid: int, seq: int) -> int:
    return (kind << KIND_SHIFT) | (uid << UID_SHIFT) | (seq & SEQ_MASK)


def peer_id(uid: int) -> str:
    return f"{uid:08x}"


def peer_uid(peer: str) -> int | None:
    """The uid of a peer id (``peer_id``'s inverse); None if it is not one."""
    try:
        uid = int(peer, 16)
    except (TypeError, ValueError):
        return None
    return uid if 0 <= uid < 1 << 32 else None


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


def parse_header(buf) -> tuple[int, list[int], bytes | None, str, str | None, int]:
    """(seq, frame lengths, sender address or None, memory kinds, sender process or None,
    sender worker generation) of a received header.

    Raises:
        ValueError: not a header this version writes, or limits exceeded.
    """
    try:
        version, seq, lengths, hello, *rest = msgpack.unpackb(buf, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"undecodable header: {e}") from None
    kinds = rest[0] if rest else "h" * len(lengths) if isinstance(lengths, list) else None
    process, gen = rest[1:] if len(rest) == 3 else (None, 0)
    if (version != WIRE_VERSION or not isinstance(seq, int) or not isinstance(lengths, list)
            or len(rest) not in (0, 1, 3) or (len(rest) == 3 and hello is None)
            or len(lengths) > MAX_FRAMES
            or not all(isinstance(n, int) and 0 <= n <= MAX_FRAME_BYTES for n in lengths)
            or sum(lengths) > MAX_MESSAGE_BYTES
            or not (hello is None or (isinstance(hello, bytes) and hello))
            or not (process is None or (isinstance(process, str) and len(process) <= MAX_PROCESS_CHARS))
            or type(gen) is not int or not 0 <= gen < 1 << 32
            or not isinstance(kinds, str) or len(kinds) != len(lengths) or kinds.strip("hd")):
        raise ValueError(f"bad header fields {version!r}, {seq!r}, {str(lengths)[:80]}, {str(rest)[:40]}")
    return seq, lengths, hello, kinds, process, gen


def seal_header(key: bytes, uid: int, header: bytes) -> bytes:
    """``header`` followed by its MAC under ``key``, bound to the sender's ``uid``."""
    return header + mac(key, [uid.to_bytes(4, "big"), header])


def open_header(key: bytes, uid: int, buf) -> memoryview:
    """The header in a sealed ``buf`` from ``uid``.

    Raises:
        ValueError: no valid MAC (not from a transport holding ``key``, or not from ``uid``).
    """
    view = memoryview(buf).cast("B")
    head = view[:-MAC_BYTES] if view.nbytes > MAC_BYTES else view[:0]
    if not head.nbytes or not verify(key, [uid.to_bytes(4, "big"), head], bytes(view[-MAC_BYTES:])):
        raise ValueError("header without a valid MAC")
    return head


def format_address(uid: int, worker_address: bytes, process: str | None = None, gen: int = 0) -> str:
    """``ucx://<uid hex>/<base64 worker address>[/<process>[/<generation>]]``; ``process``
    (``peers``'s ``this_process()``, ``-`` when unknown) lets a peer on this host tell that
    it has exited; the generation of the UCX worker (see the module doc) which address is newer."""
    tail = f"/{process or '-'}/{gen}" if gen else f"/{process}" if process else ""
    return f"{_SCHEME}{peer_id(uid)}/{base64.urlsafe_b64encode(worker_address).decode()}{tail}"


def pack_header(seq: int, lengths: list[int], kinds: str, hello: bytes | None,
                process: str | None = None, gen: int = 0) -> bytes:
    """The wire header; the memory-type string only when some frame is on a device or the
    header carries the sender's address (then with its process and generation)."""
    fields = [WIRE_VERSION, seq, lengths, hello]
    if hello is not None:
        return msgpack.packb(fields + [kinds, process, gen])
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


def parse_address(address: str) -> tuple[int, bytes, str | None, int]:
    """(uid, worker address, process or None, generation) of a ``format_address`` string.

    Raises:
        ValueError: not a ucx address.
    """
    bad = ValueError(f"not a ucx address (want {_SCHEME}<uid hex>/<base64 worker address>[/<process>[/<gen>]]): "
                     f"{str(address)[:80]!r}")
    if not isinstance(address, str) or not address.startswith(_SCHEME) or "/" not in address[len(_SCHEME):]:
        raise bad
    uid_hex, rest = address[len(_SCHEME):].split("/", 1)
    b64, _, tail = rest.partition("/")
    process, _, gen_str = tail.partition("/")
    try:
        uid, addr = int(uid_hex, 16), base64.urlsafe_b64decode(b64.encode())
        gen = int(gen_str) if gen_str else 0
    except ValueError as e:
        raise bad from e
    if not 0 <= uid < (1 << 32) or not addr or not 0 <= gen < (1 << 32) or len(process) > MAX_PROCESS_CHARS:
        raise bad
    return uid, addr, (None if process in ("", "-") else process), gen
