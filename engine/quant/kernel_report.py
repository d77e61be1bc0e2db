"""What runs each quantized format of a model on this CPU, in one line (`pdserve` logs, benches).

Apart from cpu_kernels.py (which the linears import to choose their kernels) so that the
description of the linears can import them without a circle.
"""

from __future__ import annotations

import torch

from engine.models.native import amx_library
from engine.quant.cpu_kernels import cpu_class
from engine.quant.linear import Int4Linear, Int8Linear, W8A8Linear
from engine.quant.linear.base import AMX_ROWS, DEQUANT_ROWS


def report(model: torch.nn.Module | None = None, single_token: str | None = None, rows: int = 1) -> str:
    """One line: the CPU class and the kernel each quantized format of ``model`` runs here, with
    the small-step decode path where there is one (``single_token``: "native" for
    engine/models/native_decode.c, "compiled" for the torch.compile'd graphs; steps of up to
    ``rows`` tokens).

    e.g. ``"cpu AVX2; int8: int8pack bf16-act (batched), native GEMV (steps <= 4 tokens);
    w8a8: x86 7-bit act (int16 pair sums saturate here)"``.
    """
    steps = "one-token" if rows <= 1 else f"steps <= {rows} tokens"
    parts = [f"cpu {cpu_class()}"]
    kinds: dict[str, str] = {}
    native = single_token == "native"
    # steps of AMX_ROWS rows or more of INT4 / INT8 (native_amx.c), but in the INT8-activation mode
    amx = amx_library() is not None and not getattr(model, "int8_activations", False)
    for mod in (model.modules() if model is not None else ()):
        if isinstance(mod, Int8Linear) and "int8" not in kinds:
            act = str(mod.act_dtype).removeprefix("torch.")
            fast = (f", native GEMV ({steps})" if native else f", compiled fp32 GEMV ({steps})") if single_token else ""
            big = f", from {AMX_ROWS} rows AMX (fp32 arithmetic)" if amx and mod.kernel == "int8pack" else ""
            kinds["int8"] = f"{mod.kernel} {act}-act (batched){big}{fast}"
        elif isinstance(mod, Int4Linear) and "int4" not in kinds:
            act = str(mod.act_dtype).removeprefix("torch.")
            if mod.kernel == "native":  # one copy, in the native layout, for every path
                small = f"native GEMV ({steps})" if native else "native GEMV"
                if amx:
                    kinds["int4"] = f"{small}, batched < {AMX_ROWS} rows the same GEMV, from {AMX_ROWS} rows AMX (fp32 arithmetic)"
                else:
                    kinds["int4"] = (f"{small}, batched < {DEQUANT_ROWS} rows the same GEMV, "
                                     f"from {DEQUANT_ROWS} rows fp32 GEMM on the weight dequantized")
            elif native:
                kinds["int4"] = f"{mod.kernel} {act}-act (batched), native GEMV ({steps})"
            else:
                fast = f" (batched; {steps}: inside the compiled graphs)" if single_token else ""
                kinds["int4"] = f"{mod.kernel} {act}-act{fast}"
        elif isinstance(mod, W8A8Linear) and "w8a8" not in kinds:
            kinds["w8a8"] = (f"{torch.backends.quantized.engine} "
                             + ("7-bit act (int16 pair sums saturate here)" if mod.reduce_range else "8-bit act"))
    parts += [f"{k}: {v}" for k, v in kinds.items()]
    if getattr(model, "int8_activations", False):
        parts.append(f"int8 activations (INT4/INT8 GEMVs, steps < {DEQUANT_ROWS} rows)")
    if not kinds and single_token:
        parts.append(f"fp32: {single_token} GEMV ({steps})")
    return "; ".join(parts)
