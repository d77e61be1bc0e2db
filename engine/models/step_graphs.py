"""The compiled functions of the one-token path's graphs (engine/models/single_token.py), shared
by every layer and every engine in the process: the GEMVs written so that inductor fuses them
with the norms, rotary, residuals and SiLU around them, one compiled call per layer boundary."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

# A linear is a tuple (w, s [N], zs [N], b [N]): y = s * (x . w) - zs * sum(x) + b (fp32: w [N, K],
# s = 1, zs = 0; INT8: the per-channel scale, and zero * scale for asymmetric weights).
#
# INT8 weights are read as int32 words [N, K/4] in interleave4 order (engine/quant/formats.py):
# byte j of word i is column j*K/4 + i. Written as `(w.to(float) * x).sum(-1)` on int8 [N, K],
# inductor converts 8 int8 at a time with a partial vector load, which AVX2 (no masked byte
# loads) does through memory: 1.7 G weights/s there, a third of fp32 (measured, 2 cores). The
# words load at full width on every ISA and shifts sign-extend each byte plane, which is
# multiplied by a contiguous slice of x: 14 G weights/s on AVX2, 15-17 on AVX-512 (2.4x fp32).

def _dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [K] . each row of w -> [N]: fp32 w [N, K], or INT8 as int32 words [N, K/4]."""
    if w.dtype == torch.int32:
        k4 = w.shape[-1]
        acc = ((w << 24) >> 24).to(x.dtype) * x[:k4]
        acc = acc + ((w << 16) >> 24).to(x.dtype) * x[k4:2 * k4]
        acc = acc + ((w << 8) >> 24).to(x.dtype) * x[2 * k4:3 * k4]
        acc = acc + (w >> 24).to(x.dtype) * x[3 * k4:]
        return acc.sum(-1)
    return (w * x).sum(-1)


def _lin(x: torch.Tensor, lin: tuple) -> torch.Tensor:
    """x [R, K] -> [R, N]. R is a small static row count: one GEMV per row, written out, so
    inductor fuses them into one pass over the weight rows that loads each weight once and
    updates R accumulators (a batched matmul kernel would read a 4-byte weight per row, and
    torch's int8 weight-only GEMM is tens of times slower than this at 2-8 rows on CPU)."""
    w, s, zs, b = lin
    if w.dtype == torch.uint8:
        # INT4: (packed, scales_zeros, group_size, b), torch's int4pack kernel called from inside
        # the compiled graph: per matrix it is as fast as a compiled GEMV over the nibbles on
        # AVX2 and 2-3x faster with AVX-512 (measured), and the norms, rotary, residuals and
        # SiLU around it still fuse into a few compiled kernels.
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(s.dtype), w, zs, s)
        return y.to(x.dtype) + b
    dot = torch.stack([_dot(x[r], w) for r in range(x.shape[0])])
    return dot * s - x.sum(-1, keepdim=True) * zs + b


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's formula (normalize, then scale), so fp32 results match it closely
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _pre(h, ln, qkv: tuple, cos, sin, eps: float, nq: int, nkv: int):
    """norm + qkv_proj + rotary of R tokens [R, hidden] -> q [R, nq, D], k, v [R, nkv, D]."""
    out = _lin(_rms(h, ln, eps), qkv).view(h.shape[0], nq + 2 * nkv, -1)
    qk = out[:, :nq + nkv]
    x1, x2 = qk.chunk(2, -1)
    qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    return qk[:, :nq], qk[:, nq:], out[:, nq + nkv:]


def _post(h, o, o_proj: tuple, ln2, gate_up: tuple, down: tuple, eps: float):
    """h + o_proj(o), then + mlp(norm(.)) -> the next residual stream."""
    h = h + _lin(o, o_proj)
    gate, up = _lin(_rms(h, ln2, eps), gate_up).chunk(2, -1)
    return h + _lin(F.silu(gate) * up, down)


def _post_pre(h, o, o_proj: tuple, ln2, gate_up: tuple, down: tuple, ln1, qkv: tuple, cos, sin,
              eps: float, nq: int, nkv: int):
    h = _post(h, o, o_proj, ln2, gate_up, down, eps)
    return (h, *_pre(h, ln1, qkv, cos, sin, eps, nq, nkv))


def _logits(h, ln, head: tuple, eps: float):
    return _lin(_rms(h, ln, eps), head)


_COMPILED: dict[str, Callable] = {}


_THREAD = threading.local()


def _configure_thread() -> None:
    """Settings for compiling in the calling thread. torch's config overrides are per thread
    (torch/utils/_config_module.py): set at load, they would not hold in a worker's step-loop
    thread, which compiles any variant the warm-up missed and checks the recompile limit."""
    if getattr(_THREAD, "done", False):
        return
    import torch._inductor.config as inductor_config  # heavy: inductor, only where graphs compile
    # Compile in this process: a pool of compile workers would compete with the serving
    # threads (and with Ray) for the few cores a CPU worker has.
    inductor_config.compile_threads = 1
    # One graph per model shape and step size (1..max_rows): a process holding several models
    # (tests, draft + target) needs more than dynamo's default of 8 before it gives up.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    _THREAD.done = True


def compiled(name: str) -> Callable:
    """The compiled graph of the function ``name`` of this module (``"_pre"``, ``"_post"``, ...)."""
    _configure_thread()
    fn = _COMPILED.get(name)
    if fn is None:
        # Realize an activation that several rows' GEMVs read (the normalized input, SiLU(gate)
        # * up) once: inlined, each weight load would recompute the norm or SiLU of every row.
        fn = _COMPILED[name] = torch.compile(globals()[name], dynamic=False, fullgraph=True,
                                             options={"realize_reads_threshold": 0})
    return fn

