"""Quantized linear layers: drop-in ``nn.Linear`` replacements over packed integer kernels.

Each module keeps the canonical integer weight (what a checkpoint stores, see formats.py) as
its state and builds the kernel's own layout from it once, at construction. Kernels, by name:

    int8  "int8pack"  torch ``aten._weight_int8pack_mm`` (CPU); on CUDA, untested here (no GPU
                      lent): the int8 weight is cast to the activation dtype inside one GEMM
          "fused"     a compiled dequantize-matvec (torch.compile / Inductor C++): reads the
                      int8 weight once, converts in registers; fp32 activations
    int4  "int4pack"  ``aten._weight_int4pack_mm_for_cpu`` (CPU) or ``aten._weight_int4pack_mm``
                      (CUDA, tinygemm), both over a weight repacked once at load
          "native"    the native kernels (engine/models/native_decode.c) over their own layout
    w8a8  "fbgemm"    ``quantized::linear_dynamic``: int8 x int8 GEMM with per-tensor dynamic
                      activation quantization (fbgemm/oneDNN on x86 CPUs); 7-bit activations
                      where this CPU's kernel saturates 8-bit ones (no VNNI, see cpu_kernels.py)

The packed CPU kernels are fast only with bf16 activations on AVX2 CPUs (fp32 activations are
6-13x slower, see bench/quant.py), so ``act_dtype`` says in which dtype the kernel runs; the
module casts in and out, and its output has the input's dtype. ``activations.choose_act_dtype``
times both per layer shape and keeps the faster.

Modules: ``base`` (QuantLinear, DEQUANT_ROWS, the scratch buffer, the fp32 reference), ``int8``,
``int4`` (with the INT4 embedding table), ``w8a8``, ``activations`` (the INT8-activation mode,
the per-layer activation dtype).
"""

# Re-exported: the four kinds are imported across the engine, bench/ and tests/ by these names.
from engine.quant.linear.base import QuantLinear
from engine.quant.linear.int4 import Int4Linear
from engine.quant.linear.int8 import Int8Linear
from engine.quant.linear.w8a8 import W8A8Linear

__all__ = ["Int4Linear", "Int8Linear", "QuantLinear", "W8A8Linear"]
