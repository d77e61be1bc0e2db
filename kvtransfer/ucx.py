"""UCX frame transport over worker-address endpoints (shared memory on one node, else TCP/RDMA).

Why worker addresses: endpoints made by a UCX listener need endpoint error handling, and with
it UCX drops its shared-memory transports (TCP only, ~0.5 GB/s on one node). Endpoints built
from a peer's *worker address* keep sysv/cma shared memory (several GB/s). The worker address
travels inside our address string, out of band (control plane, test), so no listener exists.

One background thread ("ucx-progress") owns the UCX worker; the caller never touches UCX and
never blocks::

    caller                            progress thread
    connect(addr): _addrs[uid] = worker address       (endpoint made on first send)
    send(peer, frames) ──► _outbox ──► post header + one tagged send per non-empty frame;
                                       keep the caller's buffers until each send completes
                                       probe headers from any peer ─► post one tagged recv per
                                       frame into a pooled buffer of the announced length
    recv() ◄────────────── _inbox ◄── message complete and first in its sender's order

The thread spins on ``worker.progress()`` while requests are in flight (a shared-memory
rendezvous raises no wake-up event), yielding the GIL each round; when idle, or after 1 s
without any completion (a dead peer), it sleeps on the worker's epoll fd and a wake pipe with
a 2 ms timeout, so an idle transport costs almost nothing.

Wire protocol (tags, header, address format): ``ucx_wire.py``.

Buffers. Sends are zero-copy from the caller's buffers: keep them unchanged until delivered.
Received host frames are writable memoryviews (format "B") owned by the caller; their memory
comes from a pool reused once the caller drops every view (fresh pages would halve the
bandwidth).

GPU buffers (when this process has CUDA and the UCX transports include cuda). ``send`` also
takes ``__cuda_array_interface__`` objects, e.g. contiguous CUDA tensors: UCX reads them in
place (``cuda_ipc``/NVLink on one node, ``cuda_copy`` + RDMA/TCP across nodes); the message is
posted once the caller's current stream has produced them (an event, polled). A ``"d"`` frame
is received into a fresh uint8 CUDA tensor on this transport's ``device`` and ``recv``
returns that tensor itself, not a memoryview. A side without CUDA drops messages with device
frames before allocating anything, logs an error and counts them in ``refused_device``; the
sender's sends of them stay in flight until its ``close``. Stream details: ``ucx_device.py``.

Failures. Endpoint error handling is off (it would disable shared memory), so UCX reports no
dead peer: a peer unreachable at endpoint creation has its messages dropped and counted in
``unroutable``; sends to one that dies later stay in flight until ``close`` cancels them after
``linger_s``. The lifecycle's lease is what notices either. There is no flow control: a
receiver that stops calling ``recv`` accumulates messages.

Environment. ``UCX_TLS`` and other ``UCX_*`` variables pass through unchanged unless the
``tls`` argument is given. ``UCX_WARN_UNUSED_ENV_VARS`` defaults to ``n`` here (ucxx sets
``UCX_MEMTYPE_CACHE``, which otherwise triggers a warning).
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before ucxx loads UCX

import numpy as np  # noqa: E402
import ucxx._lib.libucxx as ucx_api  # noqa: E402  (ImportError here: "ucx" stays unregistered)
from ucxx._lib.arr import Array  # noqa: E402

from kvtransfer import ucx_device, ucx_wire as wire  # noqa: E402
from kvtransfer.base import Buffer, FrameTransport, register_transport  # noqa: E402

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.002  # sleep bound when idle: shared-memory traffic may raise no event
_SPIN_S = 1.0  # stop spinning after this long without any completion (e.g. a dead peer)
_GRACE_S = 0.002  # keep spinning this long after the last completion: the next message is near


@dataclass
class _Incoming:
    """One message being received from one sender: header first, then its frames."""

    header_req: object
    header_buf: np.ndarray
    frame_reqs: list = field(default_factory=list)
    frames: list | None = None  # memoryviews / CUDA tensors; set once the header is parsed
    dropped: bool = False  # bad header or failed receive: never delivered

    def done(self) -> bool:
        return self.frames is not None and all(r.completed for r in self.frame_reqs)


class UcxTransport(FrameTransport):
    """A FrameTransport over UCX tagged messages (registered as ``"ucx"``).

    Args:
        tls: UCX transports to use (as ``UCX_TLS``, e.g. ``"sm,tcp"``); None keeps the
            environment's choice (UCX's default: shared memory on one node).
        linger_s: how long ``close`` waits for queued sends to finish before cancelling them.
        pool_bytes: receive buffers kept for reuse, in all (0: a fresh buffer per frame).
        device: CUDA device that device frames are received into; default ``cuda:<current>``
            when CUDA is available and the UCX transports include cuda, else None (no device
            frames either way).
    Raises:
        ValueError: ``device`` given but not a CUDA device, CUDA missing, or excluded by ``tls``.
    """

    name = "ucx"

    def __init__(self, tls: str | None = None, linger_s: float = 1.0, pool_bytes: int = 512 << 20,
                 device: str | None = None) -> None:
        cuda_tls = ucx_device.tls_allows_cuda(tls or os.environ.get("UCX_TLS", "all"))
        if device is not None:
            device = ucx_device.check_device(device)
            if not cuda_tls:
                raise ValueError(f"ucx device {device!r} requested but UCX transports {tls!r} exclude cuda")
        elif cuda_tls:
            device = ucx_device.default_device()
        self.device = device
        self.device_frames = device is not None  # FrameTransport capability: send/recv GPU memory
        config = {"TLS": tls} if tls else None
        self._ctx = ucx_api.UCXContext(config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()  # creates the epoll fd the idle wait uses
        self.uid = secrets.randbits(32)
        self._addr_bytes = self._worker.address.tobytes()
        self.address = wire.format_address(self.uid, self._addr_bytes)
        self.linger_s = linger_s
        self._addrs: dict[int, bytes] = {}  # uid -> worker address (connect or hello)
        self._seq: dict[int, int] = {}  # uid -> next seq to it; absent: send our address
        self._outbox: deque[tuple] = deque()  # (uid, buffers, lengths, kinds, CUDA events)
        self._inbox: deque[tuple[str, list[Buffer]]] = deque()
        # Owned by the progress thread only:
        self._eps: dict[int, object] = {}
        self._sending: list[tuple[object, object]] = []  # (request, buffer kept alive)
        self._receiving: dict[int, deque[_Incoming]] = {}
        self._banned: set[int] = set()  # peers that sent a bad header: ignored
        self._unreachable: set[int] = set()  # endpoint creation failed: messages dropped
        self.unroutable = 0  # messages dropped because their peer was unreachable
        self.refused_device = 0  # messages with device frames dropped: no CUDA here, or no memory
        self._refused_from: set[int] = set()  # peers already logged for that
        self._pool = wire.BufferPool(pool_bytes)
        self._error: BaseException | None = None
        self._closed = False
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="ucx-progress", daemon=True)
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------------
    def bind(self) -> str:
        """Returns:
            ``ucx://<uid>/<worker address, base64>``; reachable from construction on.
        """
        self._check_open()
        return self.address

    def connect(self, address: str) -> str:
        """Args:
            address: another endpoint's ``bind()`` string.
        Returns:
            The peer id for ``send``: the peer's uid in hex (also what its replies carry).
        Raises:
            ValueError: ``address`` is not a ucx address.
        """
        self._check_open()
        uid, addr = wire.parse_address(address)
        self._addrs[uid] = addr
        return wire.peer_id(uid)

    def send(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Queue one message for ``peer``; the progress thread posts it. Zero-copy: keep
        ``frames`` unchanged until the peer has them.

        Args:
            peer: from ``connect`` or ``recv``.
            frames: host buffers, and (with ``device_frames``) contiguous CUDA tensors or other
                ``__cuda_array_interface__`` objects, sent from GPU memory once the current
                stream has produced them.
        Raises:
            ValueError: unknown peer, or a frame that is not contiguous, not a buffer this
                side can send, or larger than ``wire.MAX_FRAME_BYTES``.
        """
        self._check_open()
        try:
            uid = int(peer, 16)
        except (TypeError, ValueError):
            uid = -1
        if uid not in self._addrs:
            raise ValueError(f"unknown ucx peer {peer!r}: connect() to it first, "
                             "or reply to an id from recv()")
        if len(frames) > wire.MAX_FRAMES:
            raise ValueError(f"{len(frames)} frames in one message; at most {wire.MAX_FRAMES}")
        views, lengths, kinds, events = [], [], "", []
        for f in frames:
            if ucx_device.is_device(f):
                if not self.device_frames:
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
        self._outbox.append((uid, views, lengths, kinds, events))
        self._wake()

    def recv(self) -> tuple[str, list[Buffer]] | None:
        """Returns:
            The next complete message as (sender uid, frames), or None. Host frames are
            memoryviews; device frames are uint8 CUDA tensors on ``device``.
        Raises:
            RuntimeError: the progress thread died (its error is chained).
        """
        if self._inbox:
            return self._inbox.popleft()
        if self._error is not None and not self._closed:
            raise RuntimeError("ucx progress thread failed") from self._error
        return None

    def close(self) -> None:
        """Stop the progress thread (it waits up to ``linger_s`` for queued sends), cancel
        what is left, close endpoints and the worker. Undelivered messages are dropped."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake()
        self._thread.join(self.linger_s + 10.0)
        if self._thread.is_alive():
            logger.warning("ucx progress thread did not stop; leaving it (daemon)")
            return
        self._inbox.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ucx transport {wire.peer_id(self.uid)} is closed")
        if self._error is not None:
            raise RuntimeError("ucx progress thread failed") from self._error

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full (a wake-up is pending anyway) or closed

    # ---- progress thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.device is not None:
                ucx_device.bind_thread(self.device)
            last_completion = time.monotonic()
            while not self._stop.is_set():
                completed, in_flight = self._pump()
                now = time.monotonic()
                if completed:
                    last_completion = now
                quiet = now - last_completion
                if quiet > _GRACE_S and (not in_flight or quiet > _SPIN_S):
                    self._idle_wait()
                    continue
                time.sleep(0)  # hand the GIL to the caller's thread between rounds
            deadline = time.monotonic() + self.linger_s
            while (self._outbox or self._sending) and time.monotonic() < deadline:
                self._pump()
        except BaseException as e:  # surfaced to the caller by recv/send
            logger.exception("ucx progress thread failed")
            self._error = e
        finally:
            self._shutdown()

    def _pump(self) -> tuple[bool, bool]:
        """One round of progress and bookkeeping.

        Returns:
            (whether anything was posted or completed, whether requests are in flight).
        """
        w = self._worker
        w.progress()
        completed = False
        # In order; a message waits for the kernels producing its device frames.
        while self._outbox and all(e.query() for e in self._outbox[0][4]):
            uid, views, lengths, kinds, _ = self._outbox.popleft()
            self._post_send(uid, views, lengths, kinds)
            completed = True
        while True:
            probe = w.tag_probe(ucx_api.UCXXTag(wire.HEADER << wire.KIND_SHIFT),
                                ucx_api.UCXXTagMask(3 << wire.KIND_SHIFT), remove=True)
            if not probe.matched:
                break
            uid = (probe.sender_tag.value >> wire.UID_SHIFT) & 0xFFFFFFFF
            too_long = probe.length > wire.MAX_HEADER_BYTES
            if too_long:
                logger.error("ucx peer %s sent a %d-byte header; ignoring it from now on",
                             wire.peer_id(uid), probe.length)
                self._banned.add(uid)
            # A removed probe must still be received: a too long one is cut (and dropped).
            buf = np.empty(min(probe.length, wire.MAX_HEADER_BYTES), np.uint8)
            req = w.tag_recv_with_handle(Array(buf), probe)
            self._receiving.setdefault(uid, deque()).append(_Incoming(req, buf, dropped=too_long))
            completed = True
        if self._sending:
            still = []
            for req, keep in self._sending:
                if not req.completed:
                    still.append((req, keep))
                else:
                    _check(req, "send")
            completed = completed or len(still) < len(self._sending)
            self._sending = still
        in_flight = bool(self._sending) or bool(self._outbox)
        for uid, queue in self._receiving.items():
            for msg in queue:
                if msg.frames is None and msg.header_req.completed:
                    self._on_header(uid, msg)
                    completed = True
            while queue and queue[0].done():
                msg = queue.popleft()
                completed = True
                ok = all([_check(r, "recv") for r in msg.frame_reqs])
                if ok and not msg.dropped and uid not in self._banned:
                    self._inbox.append((wire.peer_id(uid), msg.frames))
            in_flight = in_flight or bool(queue)
        return completed, in_flight

    def _post_send(self, uid: int, views: list, lengths: list[int], kinds: str) -> None:
        ep = self._eps.get(uid)
        if ep is None:
            if uid in self._unreachable:
                self.unroutable += 1
                return
            try:
                address = ucx_api.UCXAddress.create_from_buffer(self._addrs[uid])
                ep = self._worker.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
            except ucx_api.UCXError as e:  # e.g. the peer's process is gone (its shm with it)
                logger.warning("ucx peer %s unreachable (%s); dropping messages to it", wire.peer_id(uid), e)
                self._unreachable.add(uid)
                self.unroutable += 1
                return
            self._eps[uid] = ep
        seq = self._seq.get(uid)
        hello = self._addr_bytes if seq is None else None
        seq = seq or 0
        self._seq[uid] = seq + 1
        header = wire.pack_header(seq, lengths, kinds, hello)
        head_tag = ucx_api.UCXXTag(wire.tag(wire.HEADER, self.uid, seq))
        self._sending.append((ep.tag_send(Array(header), head_tag), header))
        data_tag = ucx_api.UCXXTag(wire.tag(wire.DATA, self.uid, seq))
        for v, n in zip(views, lengths):
            if n:
                self._sending.append((ep.tag_send(Array(v), data_tag), v))

    def _on_header(self, uid: int, msg: _Incoming) -> None:
        """Parse a received header and post the receives of its frames (or ban the peer)."""
        msg.frames = []
        if msg.dropped or uid in self._banned or not _check(msg.header_req, "header recv"):
            msg.dropped = True
            return
        try:
            seq, lengths, hello, kinds = wire.parse_header(msg.header_buf)
        except ValueError as e:
            logger.error("ucx peer %s sent a bad header (%s); ignoring it from now on", wire.peer_id(uid), e)
            self._banned.add(uid)
            msg.dropped = True
            return
        if hello is not None:
            self._addrs.setdefault(uid, hello)
        bufs: list | None = [None] * len(lengths)  # None: a host frame, from the pool
        if "d" in kinds:
            bufs = None if self.device is None else ucx_device.alloc_frames(lengths, kinds, self.device)
            if bufs is None:
                self._refuse_device(uid, msg)
                return
        tag = ucx_api.UCXXTag(wire.tag(wire.DATA, uid, seq))
        for n, buf in zip(lengths, bufs):
            view = self._pool.take(n) if buf is None else buf
            if n:
                msg.frame_reqs.append(self._worker.tag_recv(Array(view), tag))
            msg.frames.append(view)

    def _refuse_device(self, uid: int, msg: _Incoming) -> None:
        """Drop a message with device frames (no CUDA here, or out of GPU memory); its frames
        are never received."""
        msg.dropped = True
        self.refused_device += 1
        if uid not in self._refused_from and self.device is None:
            self._refused_from.add(uid)
            logger.error("ucx peer %s sends GPU frames but this side has no CUDA (or its UCX "
                         "transports exclude cuda); dropping them (counted in refused_device)", wire.peer_id(uid))

    def _idle_wait(self) -> None:
        if self._worker.arm():  # False: events are pending, progress again at once
            select.select([self._worker.epoll_file_descriptor, self._wake_r], [], [], _IDLE_WAIT_S)
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _shutdown(self) -> None:
        w = self._worker
        try:
            w.cancel_inflight_requests()
            for ep in self._eps.values():
                ep.close()
            for _ in range(10):
                w.progress()
        except Exception:  # best effort: the objects go away below either way
            logger.exception("ucx transport shutdown")
        # Requests and endpoints hold the worker: drop them, then the worker, then buffers.
        self._eps.clear()
        self._receiving.clear()
        self._sending.clear()
        w = self._worker = self._ctx = None
        self._outbox.clear()
        self._pool = wire.BufferPool(0)


def _check(req, what: str) -> bool:
    try:
        req.check_error()
        return True
    except Exception as e:  # the lifecycle's lease fails the transfer; just report here
        logger.warning("ucx %s failed: %s", what, e)
        return False


register_transport("ucx", UcxTransport)
