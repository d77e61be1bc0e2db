"""The receiving half of the UCX transport's progress thread (``transport.py`` runs it).

A part :class:`kvtransfer.ucx.transport.UcxTransport` owns, run by its progress thread only;
what it needs of the transport comes in its constructor (the UCX workers, the peer table, the
receiving device, where delivered messages go, how a dropped peer is reported). Its own tables:
``_receiving`` (uid → that peer's messages in arrival order, kept only while one is on its
way), ``_cut`` (messages of a dropped connection, kept until UCX no longer writes into their
buffers) and ``_banned`` (peers that sent a bad header, bounded, oldest out first).

Each message: the header is probed from any sender and received; with a key its MAC is
checked (``wire.open_header``), then its lengths (a frame above ``limit_frames``' bound,
or a message above twice it, bans the peer), all before anything is allocated; its frames'
receives are posted into buffers of the announced lengths (host: pooled; device: fresh CUDA
memory) once that peer's messages on their way (posted, not yet delivered) hold less than
``PEER_INFLIGHT_BYTES`` (a larger one alone; later ones wait in order, unallocated, their
data at the sender: ``_admit``); it is delivered once complete and first in its sender's order. A header carrying the sender's
address marks the first message of a new connection of the sender's: messages of its earlier
connection still incomplete then were cut with it, and a drop mark takes their place (not
those that came in on another of our workers, one we replaced: the peer sent them before it
learnt our new address; nor when the hello is of the peer's newer worker, or a late one of its
older: those complete, each worker lives on until quiet). A message of no frames is the transport's own (a
peer telling its new address): it is not delivered.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array

from kvtransfer.ucx import device as ucx_device, wire
from kvtransfer.ucx.generation import Generation, request_ok
from kvtransfer.ucx.peers import PeerTable

logger = logging.getLogger("kvtransfer.ucx")

# Peers remembered as banned: a bound on what made-up uids can cost; one that falls out is
# banned again by its next bad header.
MAX_BANNED = 1024
# Bytes one peer's messages may hold while on their way here (posted, not delivered); more wait.
# Several layers' KV of a long prompt; one message larger than this is received alone.
PEER_INFLIGHT_BYTES = 256 << 20


@dataclass(eq=False)  # identity: queues are searched for one message (in, index, remove)
class _Incoming:
    """One message being received from one sender: header first, then its frames. A drop mark
    (``lost`` set) is a message with nothing to receive."""

    header_req: object
    header_buf: np.ndarray | None
    frame_reqs: list = field(default_factory=list)
    frames: list | None = None  # memoryviews / CUDA tensors; set once the header is parsed
    dropped: bool = False  # bad header or failed receive: never delivered
    lost: str | None = None  # a drop mark: why the sender's earlier connection is gone
    worker: object = None  # the UCX worker of ours it came in on
    internal: bool = False  # no frames: the transport's own message, not delivered
    nbytes: int = 0  # its frames' announced lengths, in all
    pending: tuple | None = None  # (data tag, lengths, kinds): frames not posted yet (``_admit``)
    posted: bool = False  # its frames' receives are posted (it holds memory until delivered)

    def done(self) -> bool:
        return self.frames is not None and self.pending is None and all(r.completed for r in self.frame_reqs)


class ReceiveSide:
    """Probe, receive and deliver messages in each sender's order (see the module doc).

    Args:
        generations: the transport's UCX workers, retiring ones first (``generation.py``).
        peers: the transport's peer table (``peers.py``): a hello records the peer there.
        device: CUDA device that device frames are received into; None: they are refused.
        pool_bytes: host receive buffers kept for reuse, in all (``wire.BufferPool``).
        put: takes ``(peer id, frames)`` of a delivered message, or ``(peer id, why)`` of a drop mark.
        lost: reports a peer's connection dropped (uid, why).
        key: the cluster key: only headers sealed under it are taken (None: unsealed ones).
    """

    def __init__(self, generations: Callable[[], list[Generation]], peers: PeerTable, device: str | None,
                 pool_bytes: int, put: Callable[[tuple], None], lost: Callable[[int, str], None],
                 key: bytes | None = None) -> None:
        self._generations, self._peers, self.device = generations, peers, device
        self._pool = wire.BufferPool(pool_bytes)
        self._put, self._lost = put, lost
        self._receiving: dict[int, deque[_Incoming]] = {}
        self._cut: list[tuple[int, _Incoming]] = []  # (sender's uid, message)
        self._banned: dict[int, None] = {}
        self._key = key
        self.max_frame_bytes, self.max_message_bytes = wire.MAX_FRAME_BYTES, wire.MAX_MESSAGE_BYTES
        self.peer_inflight_bytes = PEER_INFLIGHT_BYTES
        self.refused = 0  # headers refused: no valid MAC, malformed, announcing too much, or a banned peer's
        self.refused_device = 0  # messages with device frames dropped: no CUDA here, or no memory

    def limit_frames(self, max_frame_bytes: int) -> None:
        """Refuse frames above ``max_frame_bytes`` (a receiver's: what its cache can hold of
        one layer) and messages above twice that and 1 MiB (a KV message: header, K, V)."""
        self.max_frame_bytes = min(wire.MAX_FRAME_BYTES, max_frame_bytes)
        self.max_message_bytes = min(wire.MAX_MESSAGE_BYTES, 2 * max_frame_bytes + (1 << 20))

    def probe_headers(self) -> bool:
        """Post a receive for every header waiting; True if there was one."""
        found = False
        for g in self._generations():
            found = self._probe_worker(g.worker) or found
        return found

    def _probe_worker(self, w) -> bool:
        found = False
        while True:
            probe = w.tag_probe(ucx_api.UCXXTag(wire.HEADER << wire.KIND_SHIFT),
                                ucx_api.UCXXTagMask(3 << wire.KIND_SHIFT), remove=True)
            if not probe.matched:
                return found
            found = True
            uid = (probe.sender_tag.value >> wire.UID_SHIFT) & 0xFFFFFFFF
            too_long = probe.length > wire.MAX_HEADER_BYTES
            if too_long:
                logger.error("ucx peer %s sent a %d-byte header; ignoring it from now on",
                             wire.peer_id(uid), probe.length)
                self._ban(uid)
            # A removed probe must still be received: a too long one is cut (and dropped).
            buf = np.empty(min(probe.length, wire.MAX_HEADER_BYTES), np.uint8)
            req = w.tag_recv_with_handle(Array(buf), probe)
            self._receiving.setdefault(uid, deque()).append(_Incoming(req, buf, dropped=too_long, worker=w))

    def deliver(self, now: float) -> tuple[bool, bool]:
        """Parse arrived headers, deliver complete messages in order, release cut ones.

        Returns:
            (whether anything happened, whether messages are still on their way).
        """
        completed = in_flight = False
        for uid, queue in list(self._receiving.items()):
            for msg in list(queue):
                if msg.frames is None and msg.header_req.completed and msg in queue:
                    self._on_header(uid, msg, queue)
                    completed = True
            while queue and queue[0].done():
                msg = queue.popleft()
                completed = True
                if msg.lost is not None:
                    self._put((wire.peer_id(uid), msg.lost))
                elif not all([request_ok(r, "recv") for r in msg.frame_reqs]):
                    self._lost(uid, "a receive from it failed")
                elif not msg.dropped and uid not in self._banned:
                    if (p := self._peers.get(uid)) is not None:
                        p.last = now
                    if not msg.internal:
                        self._put((wire.peer_id(uid), msg.frames))
            if queue:
                self._admit(uid, queue)  # (what was delivered frees the peer's budget)
                in_flight = True
            else:
                del self._receiving[uid]
        for _, m in self._cut:
            if m.frames is None and m.header_req.completed:
                m.frames = []  # its frames are never posted: nothing more is written for it
        self._cut = [(u, m) for u, m in self._cut if not m.done()]
        return completed, in_flight

    def _on_header(self, uid: int, msg: _Incoming, queue: deque[_Incoming]) -> None:
        """Parse a received header and post the receives of its frames (or ban the peer)."""
        msg.frames = []
        if msg.dropped or uid in self._banned:
            msg.dropped = True
            self.refused += 1
            return
        if not request_ok(msg.header_req, "header recv"):
            msg.dropped = True
            self._lost(uid, "a receive from it failed")
            return
        try:
            head = msg.header_buf if self._key is None else wire.open_header(self._key, uid, msg.header_buf)
            seq, lengths, hello, kinds, process, gen = wire.parse_header(head)
            if any(n > self.max_frame_bytes for n in lengths) or sum(lengths) > self.max_message_bytes:
                raise ValueError(f"announces {sum(lengths)} bytes in frames of up to {max(lengths)}; this side "
                                 f"takes {self.max_frame_bytes} per frame, {self.max_message_bytes} per message")
        except ValueError as e:
            logger.error("ucx peer %s sent a bad header (%s); ignoring it from now on", wire.peer_id(uid), e)
            self.refused += 1
            self._ban(uid)
            msg.dropped = True
            return
        if hello is not None:  # the first message of a new connection of the peer's
            known = self._peers.get(uid)
            if known is None or gen == known.gen:  # (a newer worker's: its old one's messages complete;
                self._reconnected(uid, msg, queue)  # an older one's, late: nothing of the newer is cut)
            self._peers.heard(uid, hello, time.monotonic(), process, gen)
            msg.internal = not lengths  # its new address only
        msg.nbytes, msg.pending = sum(lengths), (wire.tag(wire.DATA, uid, seq), lengths, kinds)
        self._admit(uid, queue)

    def _admit(self, uid: int, queue: deque[_Incoming]) -> None:
        """Post the frames of the peer's waiting messages, in order, while its messages on
        their way hold less than ``peer_inflight_bytes`` (one larger message: alone)."""
        busy = sum(m.nbytes for m in queue if m.posted)
        for m in queue:
            if m.pending is None:
                continue
            if busy and busy + m.nbytes > self.peer_inflight_bytes:
                return
            busy += m.nbytes
            self._post_frames(uid, m)

    def _post_frames(self, uid: int, msg: _Incoming) -> None:
        """Allocate a message's frames and post their receives."""
        data_tag, lengths, kinds = msg.pending
        msg.pending, msg.posted = None, True
        bufs: list | None = [None] * len(lengths)  # None: a host frame, from the pool
        if "d" in kinds:
            bufs = None if self.device is None else ucx_device.alloc_frames(lengths, kinds, self.device)
            if bufs is None:
                self._refuse_device(uid, msg)
                return
        tag = ucx_api.UCXXTag(data_tag)
        for n, buf in zip(lengths, bufs):
            view = self._pool.take(n) if buf is None else buf
            if n:
                msg.frame_reqs.append(msg.worker.tag_recv(Array(view), tag))
            msg.frames.append(view)

    def _reconnected(self, uid: int, msg: _Incoming, queue: deque[_Incoming]) -> None:
        """The peer started a new connection to us. Earlier messages still incomplete were cut
        with its old one: set them aside and put a drop mark in their place, so the caller
        learns of the drop before ``msg``; our connection to it ends too (as a reset would: our
        next message to it starts a new one, with a hello and a fresh seq, on the UCX endpoint
        kept for its address -- ``peers.py``)."""
        older = list(queue)[:queue.index(msg)]
        cut = [m for m in older if not m.done() and m.worker is msg.worker]
        if not cut:
            return  # nothing in flight on the old connection (e.g. it ended when idle)
        for m in cut:
            queue.remove(m)
            m.dropped, m.pending = True, None  # (one never posted has nothing to finish)
        self._cut.extend((uid, m) for m in cut)
        why = "it reconnected: its earlier connection was cut mid-message"
        queue.insert(queue.index(msg), _Incoming(None, None, frames=[], lost=why))
        if (p := self._peers.get(uid)) is not None:
            p.ep = None

    def _refuse_device(self, uid: int, msg: _Incoming) -> None:
        """Drop a message with device frames (no CUDA here, or out of GPU memory); its frames
        are never received."""
        msg.dropped = True
        self.refused_device += 1
        if self.refused_device == 1 and self.device is None:  # once: the counter tells the rest
            logger.error("ucx peer %s sends GPU frames but this side has no CUDA (or its UCX "
                         "transports exclude cuda); dropping them (counted in refused_device)", wire.peer_id(uid))

    def receiving_from(self, uids: set[int]) -> bool:
        """Whether a message from one of ``uids`` is on its way here."""
        return any(u in uids for u in self._receiving)

    def busy_on(self, worker: object, uids: set[int]) -> bool:
        """Whether a message from one of ``uids`` that came in on our UCX ``worker`` is still
        incomplete (cut ones too). Only live peers count: what a dead one left never completes,
        and waiting on it held a replaced worker, and the dead peers' mappings it was replaced to
        let go, until ``RETIRE_FORCE_S``."""
        return any(u in uids and m.worker is worker for u, m in self._cut) or \
            any(m.worker is worker and not m.done() for u, q in self._receiving.items() if u in uids for m in q)

    def cut_worker(self, worker: object) -> list[int]:
        """Forget what came in on ``worker`` (destroyed: its requests are cancelled); returns
        the uids of the peers whose messages were cut incomplete."""
        peers = []
        for uid, queue in self._receiving.items():
            cut = [m for m in queue if m.worker is worker and not m.done()]
            for m in cut:
                queue.remove(m)
            if cut:
                peers.append(uid)
        self._cut = [(u, m) for u, m in self._cut if m.worker is not worker]
        return peers

    def clear(self) -> None:
        """Drop every message on its way and the buffer pool (the transport's shutdown, once
        the UCX workers' requests are gone)."""
        self._receiving.clear()
        self._cut.clear()
        self._pool = wire.BufferPool(0)

    def _ban(self, uid: int) -> None:
        self._banned[uid] = None
        while len(self._banned) > MAX_BANNED:
            del self._banned[next(iter(self._banned))]

