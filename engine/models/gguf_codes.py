"""A GGUF tensor in pdserve's integer formats, without a detour through float where it can.

The precision classes of llama.cpp's block formats, and what each becomes here:

    Q4_0   w = d * (q - 8)            groups of 32   -> INT4 g32: the same 4-bit codes, scale d
    Q4_1   w = d * q + m              groups of 32   -> INT4 g32: codes, scale d, offset m
    Q4_K   w = d*sc * q - dmin*m      sub-blocks 32  -> INT4 g32: codes, scale d*sc, offset -dmin*m
    Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 (5 to 8 bits)       -> INT8 per output channel (round to nearest
                                                        from the file's dequantized values)
    F32, F16, BF16                                   -> float

The 4-bit formats all have the shape ``w = scale * q + offset`` over 32 inputs, which is exactly
pdserve's asymmetric INT4 with groups of 32 (``w = (q - zero) * scale``, ``zero = -offset /
scale``): the codes and scales are taken over unchanged, the offset served as ``-zero * scale``
(within an ulp of the file's; the native kernels read Q4_K's scales and these offsets in a
compact exact form, engine/models/int4_blocks.py). 5-bit and wider formats have no 4-bit
equivalent without losing precision, and pdserve's INT8 keeps one scale per row rather than per
block of 32: the round trip adds a little error (``bench/gguf_ppl.py`` measures each choice's
perplexity against the file's own dequantized weights).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import dequantize
from gguf.quants import Q4_K

from engine.quant.formats import QuantizedWeight, quantize_weight

GROUP = 32  # every 4-bit GGUF format quantizes 32 inputs per scale


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunks: int) -> np.ndarray:
    """[n, chunks * 16] bytes -> [n, chunks * 32] codes: each chunk of 16 bytes holds 32 values,
    the low nibbles first (values 0..15), then the high ones (16..31)."""
    n = qs.shape[0]
    q = qs.reshape(n, chunks, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, chunks * 32)


def _q4_0(blocks: np.ndarray):
    d = _f16(blocks[:, :2])  # [n, 1]
    q = _nibbles(blocks[:, 2:], 1)
    return q, d, -8.0 * d


def _q4_1(blocks: np.ndarray):
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:], 1), d, m


def _q4_k(blocks: np.ndarray):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    # 128 bytes = 4 chunks of 32 bytes; chunk j holds sub-block 2j in its low nibbles and 2j+1 in
    # its high ones (llama.cpp's layout), which _nibbles reads as 8 chunks of 16 bytes would not.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, 256)
    # the float products in the order gguf's (and so HF's) dequantizer computes them
    return q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


_FOUR_BIT = {"Q4_0": (_q4_0, 32), "Q4_1": (_q4_1, 32), "Q4_K": (_q4_k, 256)}
FLOAT_TYPES = ("F32", "F16", "BF16")


def precision_class(type_name: str) -> str:
    """"int4", "int8" or "float": what a tensor of this GGUF type is served as (module docstring)."""
    if type_name in _FOUR_BIT:
        return "int4"
    return "float" if type_name in FLOAT_TYPES else "int8"


CHUNK_ROWS = 4096  # rows dequantized at a time: gguf-py's temporaries stay ~100 MB, not 4x the tensor


def _q4_k_float(blocks: np.ndarray) -> torch.Tensor:
    """Q4_K blocks [n, 144] as fp32 [n, 256]: gguf-py's arithmetic, d*sc * q - dmin*m, each
    product and the difference rounded to fp32 once as numpy rounds them, on torch's threads
    (``_q4_k``'s offset is -(dmin*m): adding it is the same rounding as subtracting dmin*m)."""
    n = blocks.shape[0]
    q, scale, offset = _q4_k(blocks)
    w = torch.mul(torch.from_numpy(scale).view(n, 8, 1), torch.from_numpy(q).view(n, 8, 32).float())
    return torch.add(w, torch.from_numpy(offset).view(n, 8, 1)).view(n, 256)


def _q6_k_float(blocks: np.ndarray) -> torch.Tensor:
    """Q6_K blocks [n, 210] as fp32 [n, 256]: gguf-py's arithmetic (d * sc, then times q - 32)."""
    n = blocks.shape[0]
    ds = torch.from_numpy(_f16(blocks[:, 208:210]) * blocks[:, 192:208].view(np.int8).astype(np.float32))
    ql = torch.from_numpy(np.ascontiguousarray(blocks[:, :128])).view(n, 2, 1, 64)
    qh = torch.from_numpy(np.ascontiguousarray(blocks[:, 128:192])).view(n, 2, 1, 32)
    lo = torch.cat((ql & 15, ql >> 4), 2).view(n, 8, 32)  # 8 runs of 32: low nibbles, then high
    hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2).view(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    return torch.mul(ds.view(n, 16, 1), q).view(n, 256)


# The bulk of a K-quant file, dequantized over whole chunks with torch's threads rather than by
# gguf-py's numpy, 16 rows at a time on one thread (what that cost: docs/bench/README.md, First
# load of a GGUF file)
_FAST = {"Q4_K": (_q4_k_float, 144), "Q6_K": (_q6_k_float, 210)}


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf-py's ``dequantize(data, qtype)``, the same numbers bit for bit (tests)."""
    fast = _FAST.get(qtype.name)
    if fast is None or data.ndim != 2:
        return dequantize(data, qtype)
    f, size = fast
    return f(np.ascontiguousarray(data).reshape(-1, size)).view(data.shape[0], -1).numpy()


def dequantized(t, rows: slice | None = None) -> torch.Tensor:
    """A GGUF ReaderTensor (or its ``rows``) as fp32 [rows, cols], exactly as gguf-py (and so HF)
    dequantizes it, a chunk of rows at a time."""
    data = t.data if rows is None else t.data[rows]
    if data.ndim < 2 or data.shape[0] <= CHUNK_ROWS:
        # a copy always: an F32 tensor comes back as a view of the file's memory map, which would
        # keep the whole mapping (and its pages, in RSS) alive as long as the model
        return torch.from_numpy(np.array(_dequantize(data, t.tensor_type), dtype=np.float32, order="C", copy=True))
    out = None
    for r0 in range(0, data.shape[0], CHUNK_ROWS):
        part = _dequantize(data[r0:r0 + CHUNK_ROWS], t.tensor_type)
        if out is None:
            out = np.empty((data.shape[0], part.shape[1]), dtype=np.float32)
        out[r0:r0 + part.shape[0]] = part
    return torch.from_numpy(out)


def int4_codes(t) -> QuantizedWeight:
    """A 4-bit GGUF weight as INT4 g32 codes, scales and zero points, with no rounding.

    A group whose scale is zero holds one value, its offset, which ``(q - zero) * scale`` writes
    with codes 0, zero point -8 and scale offset / 8 (exact: a power-of-two division).
    """
    name = t.tensor_type.name
    decode, per_block = _FOUR_BIT[name]
    rows = int(t.shape[1]) if len(t.shape) > 1 else 1
    cols = int(t.shape[0])
    raw = np.asarray(t.data).view(np.uint8).reshape(rows * cols // per_block, -1)
    q, scale, offset = decode(raw)
    scale = scale.reshape(rows, cols // GROUP)
    offset = np.broadcast_to(offset, (raw.shape[0], per_block // GROUP)).reshape(rows, cols // GROUP)
    q = q.reshape(rows, cols // GROUP, GROUP)
    flat = scale == 0
    if flat.any():
        q = q.copy()
        q[flat] = 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, -8.0, -offset / np.where(flat, 1.0, scale)).astype(np.float32)
    scale = np.where(flat, offset / 8, scale).astype(np.float32)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols))),
                           torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(zero), 4, GROUP,
                           symmetric=False)


def as_int4(t) -> QuantizedWeight:
    """INT4 g32: the file's own codes where it has them, else round to nearest (asymmetric)."""
    if precision_class(t.tensor_type.name) == "int4":
        return int4_codes(t)
    n = t.data.shape[0] if t.data.ndim > 1 else 1
    parts = []
    for r0 in range(0, n, CHUNK_ROWS):  # a chunk of rows at a time, as as_int8 (the loading peak)
        w = dequantized(t, slice(r0, r0 + CHUNK_ROWS))
        parts.append(quantize_weight(w, 4, GROUP if w.shape[1] % GROUP == 0 else None, symmetric=False))
        del w
    return parts[0] if len(parts) == 1 else concat_rows(parts)


def as_int8(t) -> QuantizedWeight:
    """INT8 per output channel, round to nearest from the file's dequantized values (a chunk of
    rows at a time: the LM head of a 1.5B model is 0.9 GB in fp32 and would be several at once)."""
    n = t.data.shape[0] if t.data.ndim > 1 else 1
    parts = [quantize_weight(dequantized(t, slice(r0, r0 + CHUNK_ROWS)), 8, None, symmetric=True)
             for r0 in range(0, n, CHUNK_ROWS)]
    return parts[0] if len(parts) == 1 else concat_rows(parts)


def permute_rows(qw: QuantizedWeight, perm: torch.Tensor) -> QuantizedWeight:
    """The same weight with its output rows reordered (llama's q/k un-permutation)."""
    return QuantizedWeight(qw.q[perm].contiguous(), qw.scale[perm].contiguous(), qw.zero[perm].contiguous(),
                           qw.bits, qw.group_size, qw.symmetric)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused q/k/v or gate/up: the parts stacked along the output dimension (same format)."""
    first = parts[0]
    if any((p.bits, p.group_size, p.symmetric) != (first.bits, first.group_size, first.symmetric) for p in parts):
        raise ValueError("fused parts must share one integer format")
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.zero for p in parts]), first.bits, first.group_size, first.symmetric)
