"""The sending half of the UCX transport's progress thread (``transport.py`` runs it).

A part :class:`kvtransfer.ucx.transport.UcxTransport` owns, run by its progress thread only.
Each message goes as one sealed header and one tagged send per non-empty frame, on the
peer's current connection (a new one starts with a hello: our address and a fresh seq,
``peers.py``). The caller's buffers are kept here until each send completes; a send that
fails closes its endpoint for good and, if the peer's connection was on it, reports the peer
dropped. Wire format: ``wire.py``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array

from kvtransfer.ucx import device as ucx_device, wire
from kvtransfer.ucx.generation import Generation, request_ok
from kvtransfer.ucx.peers import PeerTable

logger = logging.getLogger("kvtransfer.ucx")


def frame_views(frames: list, device_frames: bool) -> tuple[list, list[int], str, list]:
    """(views, lengths, kinds, CUDA events) of a message's frames, as ``post`` sends them:
    ``"h"`` host buffers as byte views, ``"d"`` GPU buffers read in place once their event is done.

    Raises:
        ValueError: a device frame where ``device_frames`` is off, a frame that is not
            contiguous, not a buffer this side can send, or larger than ``wire.MAX_FRAME_BYTES``.
    """
    views, lengths, kinds, events = [], [], "", []
    for f in frames:
        if ucx_device.is_device(f):
            if not device_frames:
                raise ValueError("ucx device frame given but this transport has no CUDA "
                                 "(or its UCX transports exclude cuda)")
            view, n, event = ucx_device.device_frame(f, wire.MAX_FRAME_BYTES)
            events.append(event)
            kinds += "d"
        else:
            view = wire.byte_view(f)
            n = view.nbytes
            kinds += "h"
        views.append(view)
        lengths.append(n)
    return views, lengths, kinds, events


class SendSide:
    """Post messages to peers and keep their buffers until sent.

    Args:
        uid: the transport's uid (in every tag and sealed header).
        process: the transport's process (``peers.this_process``), carried by every header.
        peers: the transport's peer table: each peer's endpoint and seq.
        current: the transport's UCX worker in use (``generation.py``).
        lost: reports a peer's connection dropped (uid, why).
        key: the cluster key: headers go sealed under it (None: unsealed).
    """

    def __init__(self, uid: int, process: str | None, peers: PeerTable, current: Callable[[], Generation],
                 lost: Callable[[int, str], None], key: bytes | None = None) -> None:
        self.uid, self._process, self._peers, self._current = uid, process, peers, current
        self._lost, self._key = lost, key
        # (uid, endpoint, request, buffer kept alive, the generation it went on)
        self._sending: list[tuple[int, object, object, object, Generation]] = []
        self.unroutable = 0  # messages dropped: their peer was unreachable or unknown

    def __bool__(self) -> bool:
        """Whether a send is in flight."""
        return bool(self._sending)

    def post(self, uid: int, views: list, lengths: list[int], kinds: str, now: float) -> None:
        """Post one message (no frames: the transport's own, telling the peer our address)."""
        p = self._peers.get(uid)
        if p is None:
            self.unroutable += 1
            self._lost(uid, "not a known peer: never connected, disconnected, or forgotten when idle")
            return
        hello = None
        if p.ep is None:
            try:
                self._peers.new_connection(p)
            except ucx_api.UCXError as e:  # e.g. the peer's process is gone (its shm with it)
                logger.warning("ucx peer %s unreachable (%s); dropping the message", wire.peer_id(uid), e)
                self.unroutable += 1
                self._lost(uid, f"unreachable ({e})")
                return
            # A new connection's first message carries our address; a random first seq keeps its
            # tags apart from anything of an earlier connection still in flight.
            hello, p.seq = self._current().address, secrets.randbits(30)
        seq = p.seq
        p.seq, p.last = (seq + 1) & wire.SEQ_MASK, now
        g = self._current()
        header = wire.pack_header(seq, lengths, kinds, hello, self._process, g.number)
        if self._key is not None:
            header = wire.seal_header(self._key, self.uid, header)
        head_tag = ucx_api.UCXXTag(wire.tag(wire.HEADER, self.uid, seq))
        self._sending.append((uid, p.ep, p.ep.tag_send(Array(header), head_tag), header, g))
        data_tag = ucx_api.UCXXTag(wire.tag(wire.DATA, self.uid, seq))
        for v, n in zip(views, lengths):
            if n:
                self._sending.append((uid, p.ep, p.ep.tag_send(Array(v), data_tag), v, g))

    def reap(self) -> bool:
        """Let go of completed sends (a failed one: its endpoint is discarded, its peer dropped).
        Returns whether any completed."""
        still = []
        for uid, ep, req, keep, gen in self._sending:
            if not req.completed:
                still.append((uid, ep, req, keep, gen))
            elif not request_ok(req, "send"):
                current = (p := self._peers.get(uid)) is not None and p.ep is ep
                self._peers.discard(ep)  # broken: the next connection to its address makes a new one
                if current:  # the peer's connection is on it (not one already ended)
                    self._lost(uid, "a send to it failed")
        completed = len(still) < len(self._sending)
        self._sending = still
        return completed

    def uses(self, ep: object) -> bool:
        """Whether a send in flight is on endpoint ``ep``."""
        return any(s[1] is ep for s in self._sending)

    def busy(self, uids: set[int], gen: Generation | None = None) -> bool:
        """Whether a send to one of ``uids`` is in flight (on ``gen``, if given)."""
        return any(s[0] in uids and (gen is None or s[4] is gen) for s in self._sending)

    def drop(self, gen: Generation | None = None) -> None:
        """Let go of the sends on ``gen`` (destroyed: its requests were cancelled), or of all."""
        self._sending = [] if gen is None else [s for s in self._sending if s[4] is not gen]
