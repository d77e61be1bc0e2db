"""Integer weight formats: quantize, dequantize, and pack INT4 two to a byte.

One real weight ``r`` maps to an integer ``r_q`` with a scale (and a zero point):

    r_q = clamp(round(r / scale) + zero_point, qmin, qmax)      # quantize
    r  ~= (r_q - zero_point) * scale                             # dequantize

    INT8, per output channel (one scale per row of W [N, K]):
        symmetric:  scale = max|r| / 127,            zero_point = 0,   r_q in [-127, 127]
        asymmetric: scale = (max - min) / 255,       zero_point = -128 - round(min / scale)
    INT4, per group of ``g`` consecutive inputs (W [N, K] -> scales [N, K/g]):
        symmetric:  scale = max|r| / 7,              zero_point = 8,   r_q in [0, 15]
        asymmetric: scale = (max - min) / 15,        zero_point = -round(min / scale)

Ranges always include 0 (min <= 0 <= max) so that a zero weight stays exactly zero. INT4 is
stored unsigned (0..15) so that two values pack into one byte: low nibble = even column.
Everything here is vectorized tensor code (used offline and at load, never per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = 1e-10  # floor of a scale: an all-zero row or group quantizes to zeros, not NaN


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) of the stored integers."""
    if bits == 8:
        return (-127, 127) if symmetric else (-128, 127)
    return 0, 15


def qparams(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of ``w`` [..., n] (reduced over the last dim).

    Returns:
        (scale, zero_point), both float32 [...] (zero points are whole numbers).
    """
    w = w.float()
    qmin, qmax = qrange(bits, symmetric)
    if symmetric:
        half = 127 if bits == 8 else 7
        scale = _kernel_round((w.abs().amax(-1) / half).clamp_min(_EPS), bits)
        zero = torch.full_like(scale, 0.0 if bits == 8 else 8.0)
        return scale, zero
    lo, hi = w.amin(-1).clamp_max(0), w.amax(-1).clamp_min(0)
    scale = _kernel_round(((hi - lo) / (qmax - qmin)).clamp_min(_EPS), bits)
    zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)
    return scale, zero


def _kernel_round(scale: torch.Tensor, bits: int) -> torch.Tensor:
    # The CPU INT4 kernel keeps group scales in bf16 even with fp32 activations (measured):
    # choose bf16-representable scales (rounded up, so the range still covers max|r|) so that
    # the integers are rounded against the scale the kernel really applies.
    if bits != 4:
        return scale
    b = scale.to(torch.bfloat16)
    up = b.view(torch.int16) + (b.float() < scale).to(torch.int16)  # next bf16 up (positive)
    return up.view(torch.bfloat16).float()


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    symmetric: bool) -> torch.Tensor:
    """``r_q = clamp(round(r / scale) + zero_point, qmin, qmax)`` with scale/zero broadcast."""
    qmin, qmax = qrange(bits, symmetric)
    return (torch.round(w.float() / scale) + zero).clamp_(qmin, qmax)


@dataclass
class QuantizedWeight:
    """Canonical integer form of one weight W [N, K] (what a checkpoint stores).

    Attributes:
        q: INT8: int8 [N, K]. INT4: uint8 [N, K] with values 0..15 (unpacked).
        scale: float32 [N] (INT8) or [N, K/g] (INT4).
        zero: float32 zero points, same shape as ``scale`` (whole numbers).
        bits: 8 or 4.
        group_size: INT4 group length; None for INT8 (per channel).
        symmetric: how the zero point was chosen.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int | None
    symmetric: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """``r ~= (r_q - zero_point) * scale`` -> float32 [N, K]."""
        q = self.q.float()
        if self.bits == 8:
            return (q - self.zero[:, None]) * self.scale[:, None]
        n, k = q.shape
        g = self.group_size
        deq = (q.view(n, k // g, g) - self.zero[..., None]) * self.scale[..., None]
        return deq.view(n, k)


def group_view(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """W [N, K] -> [N, K/g, g] (or [N, 1, K] per channel) for per-group statistics."""
    n, k = w.shape
    g = group_size or k
    if k % g:
        raise ValueError(f"group_size {g} does not divide the input dimension {k}")
    return w.reshape(n, k // g, g)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                    scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of W [N, K] (scale/zero computed unless given).

    Args:
        w: the weight, any float dtype.
        bits: 8 (per output channel; ``group_size`` must be None) or 4 (per group).
        group_size: INT4 group length dividing K.
        symmetric: scale only, or scale + zero point.
        scale, zero: precomputed parameters ([N] or [N, K/g]), e.g. from GPTQ.
    """
    if bits == 8 and group_size is not None:
        raise ValueError("INT8 is per output channel: group_size must be None")
    if bits == 4 and group_size is None:
        raise ValueError("INT4 needs a group_size")
    wg = group_view(w.float(), group_size)  # [N, G, g]
    if scale is None or zero is None:
        scale, zero = qparams(wg, bits, symmetric)  # [N, G]
    else:
        scale, zero = scale.reshape(wg.shape[:2]).float(), zero.reshape(wg.shape[:2]).float()
    q = quantize_values(wg, scale[..., None], zero[..., None], bits, symmetric).view(w.shape)
    if bits == 8:
        return QuantizedWeight(q.to(torch.int8), scale[:, 0].contiguous(), zero[:, 0].contiguous(), 8, None,
                               symmetric)
    return QuantizedWeight(q.to(torch.uint8), scale.contiguous(), zero.contiguous(), 4, group_size, symmetric)


def interleave4(t: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., K] with position 4i + j holding column j*K/4 + i (K divisible by 4).

    An INT8 weight in this order, read as int32 words, has in byte j of word i the weight of
    column j*K/4 + i: a GEMV then multiplies byte plane j by the *contiguous* slice
    x[j*K/4 : (j+1)*K/4] (engine/models/single_token.py), and every load is full width on any
    vector ISA. The batched path applies the same order to the activations instead.
    """
    *lead, k = t.shape
    if k % 4:
        raise ValueError(f"interleaving by 4 needs a multiple of 4 columns, got {k}")
    return t.reshape(*lead, 4, k // 4).transpose(-1, -2).reshape(*lead, k)


def deinterleave4(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave4`."""
    *lead, k = t.shape
    return t.reshape(*lead, k // 4, 4).transpose(-1, -2).reshape(*lead, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> uint8 [N, K/2]: byte = q[2j] | q[2j+1] << 4."""
    if q.shape[-1] % 2:
        raise ValueError(f"INT4 packing needs an even input dimension, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [N, K/2] -> uint8 [N, K] values 0..15."""
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
