"""INT4 group scales and offsets in a compact exact form: what the native GEMV reads per weight.

The native kernels (engine/models/native_decode.c) apply an INT4 weight as ``w = q * s + o`` per
group of ``g`` inputs, ``s`` the group's scale and ``o = -zero * s`` its offset, both fp32. Held
as fp32 ``scale`` and ``zero`` that is 64 bits per group of 32: 2 of the 6 bits each weight costs
to read, and a batch-1 decode step is bound by the bytes it reads.

A GGUF Q4_K weight has far less information in them: per superblock of 8 groups one fp16 ``d``
and ``dmin`` and 6-bit ``sc``, ``m`` per group, ``scale = d * sc``, ``offset = -(dmin * m)``, and
engine/models/gguf_codes.py writes ``zero = -offset / scale`` (fp32). So the kernel's ``o`` is
``(offset / scale) * scale`` rounded twice, which differs from ``offset`` in the last bit in about
one group of ten: to serve the same weights as before, the compact form keeps the offset's
factors and the kernel replays that arithmetic.

The form, per row and superblock of 8 groups, 24 bytes: fp32 ``d`` and ``dm``, then uint8
``sc[8]`` and ``m[8]``. The kernel computes, in fp32, ``s = d * sc``, ``off = dm * m`` and
``o = (off / s) * s``, or ``o = off`` where ``s`` is 0 (a group whose codes are all 0: every
weight is ``o``, its scale unused; gguf_codes.py writes Q4_K's flat groups so, with ``o`` equal
to the offset exactly). :func:`compact` searches such factors for any weight and keeps them
only where those fp32 operations give back every group's ``s`` (where its codes are not all 0)
and ``o`` exactly (``==``); else the weight keeps the fp32 pair (None). So the kernel applies the
very same ``w`` from either form, and its outputs are bit for bit the same: 0.75 bits per weight
read for the scales instead of 2, 4.75 in all (llama.cpp's Q4_K: 4.5). Weights quantized by
pdserve itself (arbitrary fp32 scales) find no factoring and keep the fp32 pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SUPER = 8  # groups per superblock (Q4_K's 8 sub-blocks)
BLOCK_BYTES = 24  # fp32 d, fp32 dm, uint8 sc[8], uint8 m[8]
# Codes tried for the largest magnitude of a superblock: Q4_K's quantizer gives its largest scale
# and min the code 63 (6 bits), so 63 settles almost every block at the first try.
_TRIES = (63, *range(62, 0, -1), *range(64, 256))
_SAMPLE = 16  # blocks the first try leaves that are searched in full before the rest: one that
# fails there ends the search (a weight without the structure fails at once, not after 255 tries)


def offsets(s: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """The kernel's ``o`` from its ``s`` and ``off`` (module docstring), fp32."""
    return torch.where(s != 0, (off / torch.where(s != 0, s, torch.ones_like(s))) * s, off)


Check = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _search(v: torch.Tensor, rows: torch.Tensor, fits: Check, base: torch.Tensor, codes: torch.Tensor,
            fp16: bool) -> torch.Tensor:
    """Factors of ``rows`` of v [B, 8] into ``base`` [B] and ``codes`` [B, 8] (in place), trying
    base = (the largest |v|) / c, and its fp16 rounding with ``fp16`` (Q4_K's d and dmin are fp16,
    which the offsets' last-bit error hides); ``fits(rows, base, codes)`` says per row whether a
    candidate is exact. Returns the rows with none (empty: every row factored)."""
    e = v.gather(1, v.abs().argmax(1, keepdim=True)).squeeze(1)

    def attempt(part: torch.Tensor, c: int) -> torch.Tensor:
        for rounded in (False, True)[:1 + fp16]:
            b = (e[part] / c).half().float() if rounded else e[part] / c
            k = torch.round(v[part] / b[:, None]).clamp(0, 255)
            ok = fits(part, b, k) & (b != 0) & torch.isfinite(b)
            base[part[ok]], codes[part[ok]] = b[ok], k[ok].to(torch.uint8)
            part = part[~ok]
        return part

    zero = rows[e[rows] == 0]  # all zeros: base 0 and codes 0 (as they are), or no factoring
    bad = zero[~fits(zero, torch.zeros(len(zero)), torch.zeros(len(zero), SUPER))]
    if bad.numel():
        return bad

    def rest_of_tries(part: torch.Tensor) -> torch.Tensor:
        for c in _TRIES[1:]:
            if part.numel() == 0:
                break
            part = attempt(part, c)
        return part

    todo = attempt(rows[e[rows] != 0], _TRIES[0])
    # a sample first: a weight without the structure fails there, not after 255 passes over it all
    sample = rest_of_tries(todo[:_SAMPLE])
    return torch.cat((sample, todo[_SAMPLE:])) if sample.numel() else rest_of_tries(todo[_SAMPLE:])


def compact(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor | None:
    """The compact form of an INT4 weight's group scales and offsets, or None where it is not exact.

    Args:
        q: codes [N, K] (0..15), canonical column order.
        scale, zero: fp32 [N, K / group].
        group: inputs per group.

    Returns:
        uint8 [N, K / group / 8 * 24]: per row, per superblock of 8 groups, fp32 ``d``, ``dm``
        then ``sc[8]``, ``m[8]`` (module docstring), or None.
    """
    n, ng = scale.shape
    if ng % SUPER or q.shape != (n, ng * group):
        return None
    s, z = scale.float().reshape(-1, SUPER), zero.float().reshape(-1, SUPER)
    o = -z * s  # the kernel's offset from the fp32 pair (native_decode.c row_scales)
    used = q.reshape(n * ng, group).amax(1).reshape(-1, SUPER) > 0
    every = torch.arange(s.shape[0])
    d, dm = torch.zeros(len(every)), torch.zeros(len(every))
    sc, m = torch.zeros_like(s, dtype=torch.uint8), torch.zeros_like(s, dtype=torch.uint8)
    # every group's scale exact, or else (a superblock with a flat group) those its codes use
    todo = _search(s, every, lambda i, b, k: (b[:, None] * k == s[i]).all(1), d, sc, fp16=False)
    if todo.numel():
        vs = torch.where(used, s, torch.zeros_like(s))
        todo = _search(vs, todo, lambda i, b, k: ((b[:, None] * k == s[i]) | ~used[i]).all(1), d, sc, fp16=False)
    if todo.numel():
        return None
    sk = d[:, None] * sc.float()  # the kernel's s
    todo = _search(o, every, lambda i, b, k: (offsets(sk[i], b[:, None] * k) == o[i]).all(1), dm, m, fp16=True)
    if todo.numel():
        return None
    head = torch.stack((d, dm), 1).contiguous().view(torch.uint8)  # [B, 8]: two fp32, native order
    return torch.cat((head, sc, m), 1).reshape(n, ng // SUPER * BLOCK_BYTES).contiguous()


def expand(meta: torch.Tensor, ng: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (s, o) [N, ng] fp32 the kernel computes from :func:`compact`'s bytes (the same fp32
    operations: for checks and tests)."""
    blocks = meta.reshape(-1, BLOCK_BYTES)
    head = blocks[:, :8].contiguous().view(torch.float32)  # [B, 2]
    s = head[:, :1] * blocks[:, 8:16].float()
    o = offsets(s, head[:, 1:] * blocks[:, 16:].float())
    return s.reshape(-1, ng), o.reshape(-1, ng)
