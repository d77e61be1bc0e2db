"""What this CPU's kernels can do, measured where it matters, and which variant each format runs.

Machines of one kind differ: some x86-64 CPUs have AVX-512 with VNNI and native bf16, others
only AVX2 + FMA. The same torch call then runs different code, and not always with the same
accuracy:

    W8A8 (fbgemm / oneDNN int8 x int8): without VNNI the kernels multiply u8 activations by s8
        weights with ``vpmaddubsw``, which adds each pair of products into a *saturating int16*.
        A pair 255 * 127 * 2 = 64770 > 32767 is clipped: the output error grows ~15x (measured:
        0.099 vs 0.006 of the largest output on a random layer). With VNNI (``vpdpbusd``) the
        products go straight into int32. The remedy without VNNI is 7-bit activations
        ("reduce range"): 127 * 127 * 2 = 32258 fits, at twice the activation rounding step.
        Which one this CPU needs is *measured* (:func:`w8a8_reduce_range`), not guessed from
        flags: fbgemm and oneDNN choose their code paths themselves (``FBGEMM_ENABLE_INSTRUCTIONS``,
        ``ONEDNN_MAX_CPU_ISA`` can force a smaller ISA; ``ATEN_CPU_CAPABILITY`` does not reach them).
    INT8 weight-only (``_weight_int8pack_mm``, bf16 activations): the same arithmetic on every
        class (measured bit-equal outputs under AVX2 and AVX-512 dispatch): the output is rounded
        to bf16, a relative error of up to 2^-8 per output, on any CPU. The small-step GEMV
        (engine/models/native_decode.c, or the compiled graphs of single_token.py) reads the
        same int8 weights with fp32 activations and accumulation: exact INT8 arithmetic up to
        fp32 summation order. So an INT8 greedy output can differ at a near-tie between a step
        of few tokens (the GEMV: up to ``EngineConfig.compile_decode_rows``) and a larger one
        (int8pack): seen on a Xeon with AMX, with speculation's verify steps. INT4 likewise:
        the native GEMV applies int4pack's weights (bf16-rounded scales) to fp32 activations.

:func:`report` is the one-line summary a worker logs at load and puts in its model info.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from engine.models.native import cpu_flags

log = logging.getLogger(__name__)


def cpu_class() -> str:
    """Short name of what this CPU offers the kernels *as they run now*, e.g.
    "AVX512+VNNI+BF16" or "AVX2".

    Torch's dispatch level (``torch.backends.cpu.get_cpu_capability()``, which
    ``ATEN_CPU_CAPABILITY`` lowers); "VNNI" when the int8 GEMM sums int8 products in int32 (the
    W8A8 probe, which follows fbgemm's/oneDNN's own ISA switches); "BF16"/"AMX" when the CPU
    has them and torch dispatches at AVX-512.
    """
    cap = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    wide = cap.startswith("AVX512")
    if w8a8_available():
        vnni = not _probe_saturates(torch.backends.quantized.engine)
    else:
        vnni = "avx512_vnni" in flags or "avx_vnni" in flags
    extra = [name for name, present in (("VNNI", vnni), ("BF16", wide and "avx512_bf16" in flags),
                                        ("AMX", wide and "amx_int8" in flags)) if present]
    return "+".join([cap, *extra])


@functools.cache
def native_bf16() -> bool:
    """Whether bf16 GEMMs run natively here (AVX512-BF16 or AMX, torch dispatching at AVX-512):
    the INT8-activation mode's prefill then multiplies in bf16 (engine/quant/linear/)."""
    cls = cpu_class()
    return "+BF16" in cls or "+AMX" in cls


def w8a8_available(device: str = "cpu") -> bool:
    """An int8 x int8 GEMM exists: fbgemm/x86 quantized engines on CPU (not on CUDA here)."""
    engines = torch.backends.quantized.supported_engines
    return device == "cpu" and any(e in engines for e in ("x86", "fbgemm"))


# ---- W8A8: does the int8 x int8 GEMM saturate on this CPU? ----------------------------------
_PROBE_K, _PROBE_N = 64, 8


@functools.cache
def _probe_saturates(engine: str) -> bool:
    # The worst case for a u8 x s8 pair: every activation quantizes to 255 (x = 1, range [0, 1],
    # scale 1/255, exact) and every weight to +127 (w = 1, scale 1/127): y = K exactly, in int32.
    # A kernel summing pairs into saturating int16 returns about K * 32767 / 64770, half of it.
    w = torch.full((_PROBE_N, _PROBE_K), 127, dtype=torch.int8)
    with warnings.catch_warnings():  # quantized-tensor creation is deprecated, the kernel is not
        warnings.simplefilter("ignore", UserWarning)
        qt = torch._make_per_channel_quantized_tensor(w, torch.full((_PROBE_N,), 1 / 127, dtype=torch.double),
                                                      torch.zeros(_PROBE_N, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qt, None)
    y = torch.ops.quantized.linear_dynamic(torch.ones(1, _PROBE_K), packed, False)
    # exact up to fp32 rounding of K * (1/255 * 255) * (1/127 * 127): far below 1
    return bool((y - _PROBE_K).abs().max().item() > 0.5)


def w8a8_reduce_range() -> bool:
    """True when this CPU's int8 x int8 GEMM saturates 8-bit activations (no VNNI): W8A8 must
    then quantize activations to 7 bits. Measured once per quantized engine and process."""
    engine = torch.backends.quantized.engine
    reduce = _probe_saturates(engine)
    if reduce:
        # Not silent: 7-bit activations keep the GEMM exact but cost about 3x the perplexity of
        # 8-bit ones on the bundled model (README, "Per CPU class"); weight-only int8 does not.
        log.warning("W8A8: the %s int8 GEMM saturates int16 pair sums on this CPU (%s): 7-bit activations, "
                    "about 3x the accuracy loss of a VNNI CPU (README); `int8` (weight-only) keeps it under 1%%",
                    engine, cpu_class())
    return reduce
