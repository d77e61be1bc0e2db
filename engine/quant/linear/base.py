"""What every quantized linear shares: the base module, the rows where a step stops being a GEMV,
the per-thread scratch buffer a dequantized weight is written into, and the fp32 reference."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.formats import QuantizedWeight

# Steps of at least this many rows dequantize an INT4 weight to fp32 and run one GEMM (the
# dequantization is ~1 op per weight, the GEMM 2 per weight per row); fewer run the native GEMV
# on the codes. Measured on a 2-core AVX-512 EPYC, 17920x1536: at 64 rows the GEMV took 21 ms
# and the GEMM 80; at 512, 544 and 353 (+5 dequantizing). The kinds read it as ``base.DEQUANT_ROWS``
# at call time: bench/gguf_ppl.py and the tests raise it to send every step through the GEMV.
DEQUANT_ROWS = 128
# Where the CPU has AMX (engine/models/native_amx.c), steps of at least this many rows of an INT4
# or INT8 linear run on it instead, in fp32 arithmetic as the paths above: from 32 rows it beat
# the GEMV on every one of the 1.5B's shapes, at 16 not on all (docs/bench/README.md, "A Xeon with AMX").
AMX_ROWS = 32
_scratch = threading.local()  # per thread: the dequantized weight of the linear running now


def dequant_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's scratch buffer of at least ``numel`` elements of ``dtype`` (grown, never shrunk)."""
    name = "buf" if dtype == torch.float32 else f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


def bias_copy(linear_bias: torch.Tensor | None) -> torch.Tensor | None:
    """A quantized linear's own fp32 copy of an ``nn.Linear``'s bias."""
    return None if linear_bias is None else linear_bias.detach().float().clone()


class QuantLinear(nn.Module):
    """Base: ``in_features``/``out_features``, optional fp32 bias, output in the input's dtype."""

    bits: int = 0
    kernel: str = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", bias)
        self.act_dtype = torch.bfloat16

    def __getstate__(self) -> dict:
        """Pickled (engine/weight_cache.py) without native kernels: they hold this process's
        pointers and are rebuilt on first use."""
        state = dict(super().__getstate__())
        for name in ("_kernel", "_a8"):
            if name in state:
                state[name] = None
        return state

    def _prepare(self) -> None:
        """Build the kernel's derived tensors from the buffers (each kind its own)."""

    def _before_move(self) -> None:
        """Put the buffers in the layout every device reads, before ``_apply`` moves them."""

    def _apply(self, fn, recurse=True):
        # A .to() that changes no tensor (the loader's model.to(cpu, float32) over modules already
        # there) returns at once: rebuilding the derived layouts would copy every weight again,
        # and for INT4 convert twice through the canonical layout (the 1.5B's loading peak).
        tensors = [t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None]
        if all(fn(t) is t for t in tensors):
            return self
        self._before_move()
        out = super()._apply(fn, recurse)
        self._prepare()  # .to(device) etc. must move the derived tensors too
        return out

    def quantized_weight(self) -> QuantizedWeight:
        raise NotImplementedError

    def kernel_weight(self) -> torch.Tensor:
        """The fp32 weight the kernel applies: the dequantized canonical one, unless a kind's
        kernel rounds its scales (INT4's int4pack)."""
        return self.quantized_weight().dequantize()

    def weight_bytes(self) -> int:
        """Bytes the kernel reads per forward (packed weight + scales/zeros + bias)."""
        raise NotImplementedError

    def set_act_dtype(self, dtype: torch.dtype) -> None:
        self.act_dtype = dtype

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel}, act_dtype={str(self.act_dtype).removeprefix('torch.')}")


def reference_forward(mod: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The dequantized reference: ``F.linear(x, dequantize(W), bias)`` in fp32 (for tests); for
    INT4 with the scales/offsets at the precision the kernel stores them (bf16)."""
    return F.linear(x.float(), mod.kernel_weight(), mod.bias)
