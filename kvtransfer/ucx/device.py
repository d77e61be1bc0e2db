"""GPU buffers for the UCX transport: what ``transport.py`` needs to send and receive device memory.

UCX moves CUDA memory itself (``cuda_ipc``/NVLink between GPUs of one node, ``cuda_copy`` plus
RDMA or TCP across nodes); ucxx's ``Array`` accepts any ``__cuda_array_interface__`` object.
What is left to us is stream ordering, because UCX works outside torch's streams:

- send: the frame may still be being written by kernels queued on the caller's stream, so
  ``send`` records a CUDA event there and the progress thread posts the message only once the
  event has completed (polled, never blocking the caller);
- receive: a fresh block from torch's caching allocator may still be read by kernels queued on
  the allocating stream (it was freed by torch, not by the GPU), so the progress thread syncs
  that stream once per message before UCX writes into the new buffers.

Only ``is_device``, ``tls_allows_cuda``, ``default_device`` and ``check_device`` run without
CUDA; the rest is called only on a transport that has a device.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def default_device() -> str | None:
    """``cuda:<current device>`` when this process can use CUDA, else None."""
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else None


def check_device(device: str) -> str:
    """Returns:
        ``device`` normalised (``cuda:N``).
    Raises:
        ValueError: not a CUDA device, or CUDA is not available here.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"ucx receive device must be a CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"ucx receive device {device!r} requested but CUDA is not available")
    return f"cuda:{torch.cuda.current_device() if dev.index is None else dev.index}"


def receive_device(device: str | None, tls: str | None) -> str | None:
    """The CUDA device a transport receives device frames into: ``device`` checked, or by
    default the current one when CUDA is here and the UCX transports (``tls``, else
    ``UCX_TLS``) include cuda; None: no device frames.

    Raises:
        ValueError: ``device`` given but not a CUDA device, CUDA missing, or excluded by ``tls``.
    """
    cuda_tls = tls_allows_cuda(tls or os.environ.get("UCX_TLS", "all"))
    if device is None:
        return default_device() if cuda_tls else None
    device = check_device(device)
    if not cuda_tls:
        raise ValueError(f"ucx device {device!r} requested but UCX transports {tls!r} exclude cuda")
    return device


def tls_allows_cuda(tls: str) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX move CUDA memory (else a device pointer would be
    read as host memory)."""
    names = tls.lower()
    if names.startswith("^"):  # an exclusion list
        return "cuda" not in names
    return "all" in names.split(",") or "cuda" in names


def is_device(buf: object) -> bool:
    """Whether ``buf`` is GPU memory (exposes ``__cuda_array_interface__``)."""
    return hasattr(buf, "__cuda_array_interface__")


def device_frame(buf: object, max_bytes: int) -> tuple[object, int, torch.cuda.Event]:
    """Validate a device frame for sending.

    Args:
        buf: a contiguous CUDA tensor (any dtype), or another ``__cuda_array_interface__``
            object with C-contiguous layout.
        max_bytes: largest frame allowed.
    Returns:
        (object to hand to ucxx's ``Array``, its byte length, an event recorded on the
        current stream of its device: post the send once it has completed).
    Raises:
        ValueError: not C-contiguous, or larger than ``max_bytes``.
    """
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("ucx device frame is not C-contiguous")
        flat = buf.detach().reshape(-1).view(torch.uint8)  # 1-D bytes: what Array handles best
        nbytes, device, obj = flat.numel(), buf.device, flat
    else:
        cai = buf.__cuda_array_interface__
        shape, strides = tuple(cai["shape"]), cai.get("strides")
        item = int(cai["typestr"][2:])
        n = 1
        for s in shape:
            n *= s
        expect = item
        for size, stride in zip(reversed(shape), reversed(strides or ())):  # None: C order
            if size > 1 and stride != expect:
                raise ValueError("ucx device frame is not C-contiguous")
            expect *= size
        nbytes, device, obj = n * item, torch.device("cuda", torch.cuda.current_device()), buf
    if nbytes > max_bytes:
        raise ValueError(f"ucx frame of {nbytes} bytes exceeds MAX_FRAME_BYTES={max_bytes}")
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return obj, nbytes, event


def bind_thread(device: str) -> None:
    """Make ``device``'s primary context current in the calling (progress) thread: UCX
    queries and copies device pointers from there."""
    torch.cuda.set_device(torch.device(device))


def alloc_frames(lengths: list[int], kinds: str, device: str) -> list[torch.Tensor | None] | None:
    """Fresh uint8 CUDA buffers for the ``"d"`` frames of one message (None for host frames).

    Lengths were checked against the transport's limits before this is called. Then waits
    until kernels queued on ``device``'s current stream are done: a block the caching
    allocator hands out may still be read by them, and UCX writes outside torch's stream order.

    Returns:
        The buffers, or None when the GPU is out of memory (logged; the message is dropped).
    """
    try:
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) if k == "d" else None
                for n, k in zip(lengths, kinds)]
        torch.cuda.current_stream(torch.device(device)).synchronize()
    except torch.cuda.OutOfMemoryError as e:
        logger.error("ucx: no GPU memory on %s for a message of %d bytes (%s); dropping it",
                     device, sum(lengths), e)
        return None
    return bufs
