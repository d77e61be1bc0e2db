"""How activations enter a model's quantized linears: the INT8-activation mode, and the
activation dtype each layer shape runs fastest in."""

from __future__ import annotations

import time

import torch
from torch import nn

from engine.quant.formats import interleave4
from engine.quant.linear.int4 import Int4Linear
from engine.quant.linear.int8 import Int8Linear


def set_int8_activations(model: nn.Module) -> int:
    """Serve ``model``'s INT4 and INT8 linears with INT8 activations where the native kernels run
    them (EngineConfig.activations "int8"): each GEMV of fewer than DEQUANT_ROWS rows quantizes
    its inputs per group of 32 (d = max|x| / 127) and multiplies bytes, llama.cpp's arithmetic
    on its K-quants. Faster (the unpacking no longer bounds the GEMV) and no longer
    token-identical to HF. The one-token path reads the model's flag when it builds its
    kernels (engine/models/single_token.py). INT8 modules hold their weight interleaved
    for it. Returns how many modules take it."""
    model.int8_activations = True
    n = 0
    for mod in model.modules():
        if isinstance(mod, Int4Linear):
            mod.use_int8_activations()
            n += 1
        elif isinstance(mod, Int8Linear) and mod.kernel == "int8pack":
            if not mod.interleaved and mod.qweight.device.type == "cpu":
                with torch.no_grad():  # the kernel's column order (the one-token path keeps it too)
                    mod.set_interleaved(interleave4(mod.qweight).contiguous())
            mod.use_int8_activations()
            n += 1
    return n


def _time(fn, reps: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


@torch.inference_mode()
def choose_act_dtype(model: nn.Module, rows: int = 1, candidates=(torch.bfloat16, torch.float32)) -> dict:
    """Time each distinct quantized layer shape with each activation dtype; keep the fastest.

    Returns:
        {(kind, out, in): (chosen dtype, {dtype: seconds})} for the shapes measured.
    """
    chosen: dict = {}
    for mod in model.modules():
        if not isinstance(mod, (Int8Linear, Int4Linear)):
            continue
        key = (type(mod).__name__, mod.out_features, mod.in_features)
        if key not in chosen:
            x = torch.randn(rows, mod.in_features)
            times = {}
            for dt in candidates:
                mod.set_act_dtype(dt)
                times[dt] = _time(lambda: mod(x))
            chosen[key] = (min(times, key=times.get), times)
        mod.set_act_dtype(chosen[key][0])
    if getattr(model, "single_token", None) is not None:
        model.single_token.sync()  # its INT4 calls take the scales in the chosen dtype too
    return chosen
