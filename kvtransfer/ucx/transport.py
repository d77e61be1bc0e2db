"""UCX frame transport over worker-address endpoints (shared memory on one node, else TCP/RDMA).

Why worker addresses: endpoints made by a UCX listener need endpoint error handling, and with
it UCX drops its shared-memory transports (TCP only, ~0.5 GB/s on one node). Endpoints built
from a peer's *worker address* keep sysv/cma shared memory (several GB/s). The worker address
travels inside our address string, out of band (control plane, test), so no listener exists.

One background thread ("ucx-progress") owns the UCX worker; the caller never touches UCX and
never blocks::

    caller                            progress thread
    connect(addr) ─────────► _outbox ──► record the peer (peers.py; connection made on first send)
    send(peer, frames) ──► _outbox ──► post header + one tagged send per non-empty frame;
                                       keep the caller's buffers until each send completes
    disconnect(peer) ──────► _outbox ──► end our connection, forget the peer (the UCX endpoint
                                       stays for the next connection to that address: peers.py)
                                       probe headers from any peer ─► post one tagged recv per
                                       frame into a pooled buffer of the announced length
    recv() ◄────────────── _inbox ◄── message complete and first in its sender's order,
      (dropped() ◄── a drop mark)        or a drop mark in that order

The thread spins on ``worker.progress()`` while requests are in flight (a shared-memory
rendezvous raises no wake-up event), yielding the GIL each round; when idle, or after 1 s
without any completion (a dead peer), it sleeps on the worker's epoll fd and a wake pipe with
a 2 ms timeout (on the pipe alone where the worker keeps events it never clears), so an idle
transport costs almost nothing. Wire protocol (tags, header, address format): ``wire.py``.

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
sender's sends of them stay in flight until its ``close``. Stream details: ``device.py``.

Dropped connections. Endpoint error handling is off (it would disable shared memory), so UCX
itself reports no dead peer. A connection is this side's conversation with a peer: it starts
with a hello (our address) and a fresh seq, on the UCX endpoint kept for that peer's address
(``peers.py``: a new endpoint per connection would map the peer's shared memory again).
This side reports a peer dropped (``dropped``; our connection to it ends and the peer is
forgotten, or for a peer that reconnected, its earlier connection's state) when: an endpoint
to it cannot be made, or its process has exited (its address says which: then no kept
endpoint is reused); a send to it (then its endpoint is closed for good) or a receive from it
fails; a message goes to a peer this side does not know (never connected, disconnected, or
forgotten: ``peers.py``); or it started a new connection to us (its first message carries
its address again) while messages of its earlier one are still incomplete: those are cut, left
to finish in the background, never delivered. Sends to a peer that died silently stay in flight
until ``close`` cancels them after ``linger_s`` (UCX cannot cancel them one by one): a peer
that just stops is noticed by the lifecycle's lease, or by whoever calls ``disconnect``.
Flow control on receive only: a peer's messages on their way hold at most
``recv.PEER_INFLIGHT_BYTES`` (later ones wait at the sender); delivered ones pile up unread.

Replaced workers. What UCX maps of a peer stays mapped until our UCX worker is destroyed, so
once enough peers are gone for good (``peers.py``, "Stale peers") and nothing is in flight, the
progress thread replaces the worker (``generation.py``): the uid stays, the address (``bind``)
changes, every known peer is told the new one on a new connection, and the old worker keeps
receiving until quiet, then is destroyed. A peer keeps a uid's newest address (they carry the generation).

Environment. ``UCX_*`` variables pass through unless ``tls`` is given;
``UCX_WARN_UNUSED_ENV_VARS`` defaults to ``n`` (ucxx sets ``UCX_MEMTYPE_CACHE``: a warning).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import secrets
import select
import threading
import time
from collections import deque
from collections.abc import Sequence

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before ucxx loads UCX

import ucxx._lib.libucxx as ucx_api  # noqa: E402  (ImportError here: "ucx" stays unregistered)

from kvtransfer.ucx import device as ucx_device, wire  # noqa: E402
from kvtransfer.base import MAX_DROP_REPORTS, Buffer, FrameTransport, register_transport  # noqa: E402
from kvtransfer.ucx.generation import Generation, close_endpoint  # noqa: E402
from kvtransfer.ucx.peers import PeerTable, this_process  # noqa: E402
from kvtransfer.ucx.recv import ReceiveSide  # noqa: E402
from kvtransfer.ucx.send import SendSide, frame_views  # noqa: E402

logger = logging.getLogger("kvtransfer.ucx")  # one logger for the whole transport, as before it was a package

_IDLE_WAIT_S = 0.002  # sleep bound when idle: shared-memory traffic may raise no event
_ARM_REFUSALS = 64  # arm() refused so often, nothing completing: stuck events (after peer faults)
_SPIN_S = 1.0  # stop spinning after this long without any completion (e.g. a dead peer)
_GRACE_S = 0.002  # keep spinning this long after the last completion: the next message is near
_SEND, _CONNECT, _DISCONNECT = range(3)  # what an _outbox entry asks the progress thread to do


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
        progress_cpus: cores the progress thread runs on (default: those of the thread that
            creates the transport). The progress thread does the copying of every message
            and spins while one is in flight: on a CPU worker, give it a core the forward does
            not use, or it preempts the forward by as much as the transfer it should hide
            (bench/kv_overlap.py).
        key: the cluster key: headers go sealed and only sealed ones are taken (``wire``).
    Raises:
        ValueError: ``device`` given but not a CUDA device, CUDA missing, or excluded by ``tls``;
            ``progress_cpus`` empty or naming a core this machine does not have.
    """

    name = "ucx"

    def __init__(self, tls: str | None = None, linger_s: float = 1.0, pool_bytes: int = 512 << 20,
                 device: str | None = None, progress_cpus: set[int] | None = None,
                 key: bytes | None = None) -> None:
        ncpu = os.cpu_count() or 1
        if progress_cpus is not None and not (progress_cpus and set(progress_cpus) <= set(range(ncpu))):
            raise ValueError(f"progress_cpus {progress_cpus!r}: give cores of this machine (0..{ncpu - 1}), or None")
        self._progress_cpus = set(progress_cpus) if progress_cpus else None
        self.device = device = ucx_device.receive_device(device, tls)
        self.device_frames = device is not None  # FrameTransport capability: send/recv GPU memory
        self._config = {"TLS": tls} if tls else None
        self._gen = Generation.make(0, self._config)  # the UCX worker in use (generation.py)
        self._retiring: list[Generation] = []  # replaced ones, receiving until quiet
        self.recycles = 0  # workers replaced
        self.uid = secrets.randbits(32)
        self._process = this_process()
        self.address = wire.format_address(self.uid, self._gen.address, self._process)
        self.linger_s = linger_s
        # (_SEND, uid, buffers, lengths, kinds, CUDA events) | (_CONNECT, uid, address, process, gen) | (_DISCONNECT, uid)
        self._outbox: deque[tuple] = deque()
        self._inbox: deque[tuple[str, list[Buffer] | str]] = deque()  # frames, or why a peer dropped
        self._dropped: deque[tuple[str, str]] = deque(maxlen=MAX_DROP_REPORTS)  # caller's side of the marks
        # Owned by the progress thread only:
        self._peers = PeerTable(self._make_endpoint, close_endpoint)
        self.sender = SendSide(self.uid, self._process, self._peers, lambda: self._gen, self._lost, key)
        self.receiver = ReceiveSide(self._generations, self._peers, device, pool_bytes, self._inbox.append,
                                    self._lost, key)
        self._error: BaseException | None = None
        self._closed = False
        self.arm_refusals = 0  # in a row, nothing completing (_idle_wait)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="ucx-progress", daemon=True)
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------------
    @property
    def unroutable(self) -> int:
        """Messages dropped: their peer was unreachable or unknown."""
        return self.sender.unroutable

    @property
    def refused(self) -> int:
        """Headers refused: no valid MAC, malformed, announcing too much, or a banned peer's."""
        return self.receiver.refused

    @property
    def refused_device(self) -> int:
        """Messages with device frames dropped: no CUDA here, or no GPU memory."""
        return self.receiver.refused_device

    def limit_frames(self, max_frame_bytes: int) -> None:
        """Refuse frames above ``max_frame_bytes`` (``ReceiveSide.limit_frames``)."""
        self.receiver.limit_frames(max_frame_bytes)

    def bind(self) -> str:
        """Returns:
            ``ucx://<uid>/<worker address, base64>/<process>[/<generation>]``; reachable from
            construction on. It changes when the UCX worker is replaced (module doc): the
            newest is what to publish; an older one reaches this side for a while yet.
        """
        self._check_open()
        return self.address

    def identity(self, address: str) -> str:
        """The peer id of ``address``: the same for every address of one transport (its uid)."""
        try:
            return wire.peer_id(wire.parse_address(address)[0])
        except ValueError:
            return address

    def connect(self, address: str) -> str:
        """Args:
            address: another endpoint's ``bind()`` string.
        Returns:
            The peer id for ``send``: the peer's uid in hex (also what its replies carry).
        Raises:
            ValueError: ``address`` is not a ucx address.
        """
        self._check_open()
        uid, addr, process, gen = wire.parse_address(address)
        self._outbox.append((_CONNECT, uid, addr, process, gen))
        self._wake()
        return wire.peer_id(uid)

    def disconnect(self, peer: str) -> None:
        """End our connection to ``peer`` and forget it (queued messages to it still go first;
        sends in flight finish in the background). No-op for an unknown or malformed id."""
        if not self._closed and (uid := wire.peer_uid(peer)) is not None:
            self._outbox.append((_DISCONNECT, uid))
            self._wake()

    def dropped(self) -> list[tuple[str, str]]:
        out = list(self._dropped)
        self._dropped.clear()
        return out

    def send(self, peer: str, frames: Sequence[Buffer]) -> None:
        """Queue one message for ``peer``; the progress thread posts it. Zero-copy: keep
        ``frames`` unchanged until the peer has them. A message to a peer this side does not
        know (any more) is dropped, counted in ``unroutable`` and the peer reported dropped.

        Args:
            peer: from ``connect`` or ``recv``.
            frames: host buffers, and (with ``device_frames``) contiguous CUDA tensors or other
                ``__cuda_array_interface__`` objects, sent from GPU memory once the current
                stream has produced them.
        Raises:
            ValueError: a malformed peer id, or a frame that is not contiguous, not a buffer
                this side can send, or larger than ``wire.MAX_FRAME_BYTES``.
        """
        self._check_open()
        uid = wire.peer_uid(peer)
        if uid is None:
            raise ValueError(f"unknown ucx peer {peer!r}: connect() to it first, "
                             "or reply to an id from recv()")
        if not 1 <= len(frames) <= wire.MAX_FRAMES:  # (an empty message is the transport's own)
            raise ValueError(f"{len(frames)} frames in one message; 1 to {wire.MAX_FRAMES}")
        views, lengths, kinds, events = frame_views(frames, self.device_frames)
        self._outbox.append((_SEND, uid, views, lengths, kinds, events))
        self._wake()

    def recv(self) -> tuple[str, list[Buffer]] | None:
        """Returns:
            The next complete message as (sender uid, frames), or None (also at a drop mark:
            ``dropped`` has it). Host frames are memoryviews; device frames are uint8 CUDA
            tensors on ``device``.
        Raises:
            RuntimeError: the progress thread died (its error is chained).
        """
        if self._inbox:
            peer, item = self._inbox.popleft()
            if isinstance(item, str):
                self._dropped.append((peer, item))
                return None
            return peer, item
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
        if self._thread.is_alive():  # where it hangs (every thread's stack): a rare stall's one clue
            logger.warning("ucx progress thread did not stop; leaving it (daemon); stacks on stderr")
            faulthandler.dump_traceback(all_threads=True)
            return
        self._inbox.clear()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

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
            if self._progress_cpus:
                os.sched_setaffinity(0, self._progress_cpus)  # 0: this thread only (Linux)
            if self.device is not None:
                ucx_device.bind_thread(self.device)
            last_completion = time.monotonic()
            while not self._stop.is_set():
                completed, in_flight = self._pump()
                now = time.monotonic()
                if completed:
                    last_completion, self.arm_refusals = now, 0
                quiet = now - last_completion
                if quiet > _GRACE_S and (not in_flight or quiet > _SPIN_S):
                    self._idle_wait()
                    continue
                time.sleep(0)  # hand the GIL to the caller's thread between rounds
            deadline = time.monotonic() + self.linger_s
            while (self._outbox or self.sender) and time.monotonic() < deadline:
                self._pump()
        except BaseException as e:  # surfaced to the caller by recv/send
            logger.exception("ucx progress thread failed")
            self._error = e
        finally:
            self._shutdown()

    def _generations(self) -> list[Generation]:
        """Retiring ones first: what a peer sent to our old worker was sent before what it
        sends to the new one, and each sender's messages are queued as their headers are found."""
        return [*self._retiring, self._gen]

    def _pump(self) -> tuple[bool, bool]:
        """One round of progress and bookkeeping.

        Returns:
            (whether anything was posted or completed, whether requests are in flight).
        """
        for g in self._generations():
            g.worker.progress()
        now = time.monotonic()
        completed = False
        # In order; a message waits for the kernels producing its device frames.
        while self._outbox and (self._outbox[0][0] != _SEND or all(e.query() for e in self._outbox[0][5])):
            kind, uid, *rest = self._outbox.popleft()
            if kind == _SEND:
                self.sender.post(uid, *rest[:3], now)
            elif kind == _CONNECT:
                self._peers.dial(uid, rest[0], rest[1], now, rest[2])
            else:
                self._peers.forget(uid)
            completed = True
        completed = self.receiver.probe_headers() or completed
        completed = self.sender.reap() or completed
        received, receiving = self.receiver.deliver(now)
        self._peers.prune(now)
        if self._peers.superseded:
            self._peers.close_superseded(self.sender.uses)
        self._replace_worker_if_due(now)
        self._destroy_retired(now)
        return completed or received, receiving or bool(self.sender) or bool(self._outbox)

    def _replace_worker_if_due(self, now: float) -> None:
        """A new UCX worker once enough peers are stale and nothing is in flight (module doc);
        every known peer is sent an empty message on a new connection: our new address."""
        if self._retiring or self._peers.stale < self._peers.recycle_at or self._outbox:
            return
        # Nothing in flight to or from a live peer (what a dead one left never completes: it is
        # cancelled with the old worker), so no peer sees our messages out of order.
        live = set(self._peers.live_uids())
        if self.sender.busy(live) or self.receiver.receiving_from(live):
            return
        old = self._gen
        try:
            new = Generation.make(old.number + 1, self._config)
        except ucx_api.UCXError as e:  # (out of resources): the old one serves on, tried again later
            logger.warning("ucx: could not make a new worker (%s); keeping the old one", e)
            self._peers.stale = 0
            return
        stale = self._peers.stale
        old.endpoints, old.retired_at = self._peers.take_endpoints(), now
        self._retiring.append(old)
        self._gen = new
        self.address = wire.format_address(self.uid, new.address, self._process, new.number)
        self.recycles += 1
        logger.info("ucx %s: replaced its UCX worker (generation %d, %d stale peers); telling %d peers",
                    wire.peer_id(self.uid), new.number, stale, len(live := self._peers.live_uids()))
        for uid in live:
            self.sender.post(uid, [], [], "", now)

    def _destroy_retired(self, now: float) -> None:
        """Destroy replaced workers once quiet (``generation.py``); what is still in flight
        on one then is cut, and its peer reported dropped."""
        for g in list(self._retiring):
            w = g.worker
            live = set(self._peers.live_uids())  # (a message to or from a peer gone never completes)
            if not g.due(now, self.sender.busy(live, g) or self.receiver.busy_on(w, live)):
                continue
            self._retiring.remove(g)
            g.destroy(close_endpoint)  # cancels what is in flight on it first: then its buffers go
            self.sender.drop(g)
            for uid in self.receiver.cut_worker(w):
                self._lost(uid, "its messages to our replaced UCX worker were cut")

    def _lost(self, uid: int, why: str) -> None:
        """Report a dropped connection (after the messages already delivered from the peer) and
        end ours to it; the peer is forgotten unless it was dialed (the caller keeps its id and
        may send again: a new connection starts then)."""
        p = self._peers.get(uid)
        if p is not None:
            p.ep = None
            if not p.dialed:
                self._peers.forget(uid)
        self._inbox.append((wire.peer_id(uid), why))

    def _make_endpoint(self, address: bytes) -> object:
        """Raises UCXError when it cannot be made (e.g. the peer's process is gone)."""
        return self._gen.worker.create_endpoint_from_worker_address(
            ucx_api.UCXAddress.create_from_buffer(address), endpoint_error_handling=False)

    def _idle_wait(self) -> None:
        workers = [g.worker for g in self._generations()]
        if all(w.arm() for w in workers):
            self.arm_refusals = 0
            select.select([w.epoll_file_descriptor for w in workers] + [self._wake_r], [], [], _IDLE_WAIT_S)
        else:  # events are pending: progress again at once, unless they never clear (spinning)
            self.arm_refusals += 1
            if self.arm_refusals >= _ARM_REFUSALS:
                select.select([self._wake_r], [], [], _IDLE_WAIT_S)
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _shutdown(self) -> None:
        w = self._gen.worker
        try:
            w.cancel_inflight_requests()
            self._peers.close_all()
            for _ in range(10):
                w.progress()
        except Exception:  # best effort: the objects go away below either way
            logger.exception("ucx transport shutdown")
        # Requests and endpoints hold the worker: drop them, then the worker, then buffers.
        self._peers.close_all()  # (again, in case the first call raised)
        for g in self._retiring:
            g.destroy(close_endpoint)
        self.receiver.clear()
        self.sender.drop()
        self._retiring.clear()
        self._gen.worker = self._gen.ctx = None
        self._outbox.clear()


register_transport("ucx", UcxTransport)
