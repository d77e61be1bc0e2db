"""The UCX frame transport (registered as ``"ucx"``): shared memory on one node, else TCP/RDMA,
GPU buffers read in place where UCX has CUDA.

Its parts, and who calls whom (only ``transport.py`` is the caller's; everything below the
line runs on its progress thread)::

    caller ── connect / send / recv / disconnect / dropped / close
       │
    transport.py   UcxTransport: the caller's queues (_outbox, _inbox), the progress thread,
       │           worker replacement; it owns a SendSide and a ReceiveSide
    ───┼──────────────────────────────────────────────────────────────────────────────────
       ├── send.py        SendSide: header + one tagged send per frame, the caller's buffers
       │                  kept until each send completes
       ├── recv.py        ReceiveSide: probe headers, check them before allocating, post the
       │                  frames' receives, deliver each sender's messages in order
       ├── peers.py       PeerTable: one record per peer uid, one UCX endpoint per address,
       │                  idle and stale peers forgotten (bounded)
       ├── generation.py  Generation: a UCX context + worker; the retired ones kept until quiet
       ├── wire.py        tags, header, MAC seal, ``ucx://`` address format, receive buffer pool
       └── device.py      CUDA frames: stream events on send, fresh device buffers on receive

``wire.py`` and ``peers.py`` are plain Python (no ucxx), so importing them needs no UCX;
``UcxTransport`` is imported on first use, and with it ucxx (``kvtransfer.base`` registers the
transport by importing ``kvtransfer.ucx.transport`` and leaves it out when ucxx is missing).
The module docstring of each part says the rest: ``transport.py`` the threads, buffers,
dropped connections and replaced workers; ``wire.py`` the wire protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtransfer.ucx.transport import UcxTransport

__all__ = ["UcxTransport"]


def __getattr__(name: str) -> object:
    # Lazy: ucxx (and UCX itself) loads only for whoever uses the transport, not for wire/peers.
    if name == "UcxTransport":
        from kvtransfer.ucx.transport import UcxTransport  # (optional: ucxx may be missing; heavy: UCX)
        return UcxTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
