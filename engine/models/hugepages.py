"""Buffers in transparent huge pages: weights streamed once per token through 4 KiB pages cost
TLB misses (the one-token path keeps its weights in such a buffer: engine/models/single_token.py)."""

from __future__ import annotations

import ctypes
import sys

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def hugepage_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor whose storage is advised into transparent huge pages (Linux; elsewhere, or
    if the kernel says no, ordinary memory). Must be written after this call to take effect."""
    elem = torch.empty((), dtype=dtype).element_size()
    pad = _HUGE_PAGE // elem
    flat = torch.empty(numel + pad, dtype=dtype)
    off = (-flat.data_ptr() % _HUGE_PAGE) // elem
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None)
            length = (numel * elem) // _HUGE_PAGE * _HUGE_PAGE
            if length:
                libc.madvise(ctypes.c_void_p(flat.data_ptr() + off * elem), ctypes.c_size_t(length),
                             _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc to ask: plain pages are still correct
            pass
    return flat[off:off + numel]

