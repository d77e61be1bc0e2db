"""INT8 weight-only linears: torch's int8pack kernel, a compiled dequantize-matvec, and (in the
INT8-activation mode) the native GEMV over an interleaved weight or a bf16 GEMM for prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.native import (W_I8, Int8Kernel, Lin, amx_fits, amx_library, amx_linear, enabled_library,
                                  int8_activations_fit)
from engine.quant.cpu_kernels import native_bf16
from engine.quant.formats import QuantizedWeight, deinterleave4, interleave4
from engine.quant.linear import base
from engine.quant.linear.base import QuantLinear, bias_copy, dequant_buffer


class Int8Linear(QuantLinear):
    """W [N, K] ~= (q - zero) * scale per output channel; y = x W^T (+ bias).

    Asymmetric weights use ``x (q - z)^T s = (x q^T) s - (sum_k x_k) (z s)``: the kernel runs on
    q, and one rank-1 correction follows.
    """

    bits = 8

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, kernel: str = "int8pack") -> None:
        n, k = qw.shape
        super().__init__(k, n, bias_copy(bias))
        if kernel not in ("int8pack", "fused"):
            raise ValueError(f"unknown int8 kernel {kernel!r}; valid: int8pack, fused")
        self.kernel = kernel
        self.symmetric = qw.symmetric
        # fresh, aligned copies: tensors straight from a safetensors file may sit at any byte
        # offset, and the int8 kernel crashes on a misaligned weight (seen on this machine)
        self.register_buffer("qweight", qw.q.to(torch.int8).clone())
        self.register_buffer("scale", qw.scale.float().clone())
        self.register_buffer("zero", qw.zero.float().clone())
        self.interleaved = False  # qweight's columns in interleave4 order (set_interleaved)
        # steps of < DEQUANT_ROWS rows through the native GEMV on INT8 activations
        # (set_int8_activations); needs the interleaved weight
        self.int8_activations = False
        self._a8 = None
        self._prepare()

    def use_int8_activations(self) -> None:
        """Small steps quantize their inputs to INT8 (set_int8_activations): the kernel is rebuilt."""
        self.int8_activations, self._a8 = True, None

    def set_interleaved(self, qweight: torch.Tensor) -> None:
        """Hold ``qweight`` = interleave4(the weight) (e.g. in the one-token path's huge-page
        buffer, which reads it as int32 words); forward then interleaves the activations the
        same way, so both paths share one copy of the weight."""
        if qweight.shape != self.qweight.shape or qweight.dtype != torch.int8:
            raise ValueError(f"interleaved weight {tuple(qweight.shape)} {qweight.dtype} != {tuple(self.qweight.shape)}")
        self.qweight, self.interleaved, self._a8 = qweight, True, None

    # The state dict always holds the canonical column order, whatever this module reads.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.interleaved:
            destination[prefix + "qweight"] = deinterleave4(self.qweight)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.interleaved:  # copied in canonical order into the shared buffer: reorder in place
            with torch.no_grad():
                self.qweight.copy_(interleave4(self.qweight.clone()))

    def _prepare(self) -> None:
        self._scale_act = self.scale.to(self.act_dtype)
        # (z s) per channel, for the asymmetric rank-1 correction
        self._zs = None if self.symmetric else (self.zero * self.scale).to(self.act_dtype)

    def set_act_dtype(self, dtype: torch.dtype) -> None:
        self.act_dtype = dtype
        self._prepare()

    def quantized_weight(self) -> QuantizedWeight:
        q = deinterleave4(self.qweight) if self.interleaved else self.qweight
        return QuantizedWeight(q, self.scale, self.zero, 8, None, self.symmetric)

    def weight_bytes(self) -> int:
        n = self.qweight.numel() + self._scale_act.numel() * self._scale_act.element_size()
        return n + (0 if self._zs is None else self._zs.numel() * self._zs.element_size())

    def _bf16_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b with W dequantized to bf16 (a per-thread scratch buffer) and x rounded to
        bf16, summed in fp32: the INT8-activation mode's prefill-sized steps where the CPU has
        native bf16 (the int8pack kernel with bf16 activations ran at half llama.cpp's Q8_0
        prompt speed on the 1.5B)."""
        n, k = self.out_features, self.in_features
        wb = dequant_buffer(n * k, torch.bfloat16)[:n * k].view(n, k)
        for r0 in range(0, n, 4096):  # in row chunks: an LM head's fp32 temporary would be ~1 GB
            q, rows = self.qweight[r0:r0 + 4096], slice(r0, r0 + 4096)
            if not self.symmetric:
                q = q.float() - self.zero[rows, None]
            torch.mul(q, self.scale[rows, None], out=wb[rows])
        x2 = x.reshape(-1, k).to(torch.bfloat16)
        if self.interleaved:  # the same sum in the weight's column order
            x2 = interleave4(x2)
        y = F.linear(x2, wb).float()
        return y + self.bias.float() if self.bias is not None else y

    def _amx(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T + b on AMX (native_amx.c: the codes times x in fp32 arithmetic, more exact than
        int8pack's bf16 activations and 2-3x faster at 512 rows on the 1.5B's shapes), or
        None where it does not serve (no AMX, a shape it cannot tile)."""
        lib = amx_library()
        if (lib is None or self.kernel != "int8pack" or not self.qweight.is_contiguous()
                or not amx_fits(self.out_features, self.in_features, 0)):
            return None
        n = self.out_features  # the struct per call (a prefill step): nothing cached to go stale
        t = (self.scale.float().contiguous(), (self.zero * self.scale).float().contiguous(),
             self.bias.detach().float().contiguous() if self.bias is not None else torch.zeros(n))
        lin = Lin(self.qweight.data_ptr(), *(v.data_ptr() for v in t), n, self.in_features, W_I8, 0, 0, None)
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        return amx_linear(lib, lin, (interleave4(x2) if self.interleaved else x2).contiguous())

    def _a8_kernel(self):
        """The native INT8-activation kernel over this module's interleaved weight, or None where
        it does not serve (off, not interleaved, not on CPU, no library, a shape it cannot tile)."""
        if not (self.int8_activations and self.interleaved and self.qweight.device.type == "cpu"):
            return None
        if self._a8 is None:
            lib = enabled_library()
            if lib is None or not int8_activations_fit(W_I8, self.in_features, 0, lib.pd_vector_width()):
                return None
            n = self.out_features
            self._a8_t = (self.scale.float().contiguous(),
                          (self.zero * self.scale).float().contiguous() if not self.symmetric else torch.zeros(n),
                          self.bias.detach().float().contiguous() if self.bias is not None else torch.zeros(n))
            self._a8 = Int8Kernel(lib, self.qweight, *self._a8_t)
        return self._a8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        if self.int8_activations and x.device.type == "cpu":
            if x.numel() < base.DEQUANT_ROWS * self.in_features:
                kern = self._a8_kernel()
                if kern is not None:
                    x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
                    return kern.linear(x2).to(dtype).reshape(*shape[:-1], self.out_features)
            elif native_bf16():  # a prefill-sized step: bf16 GEMM, as Int4Linear's in this mode
                return self._bf16_gemm(x).to(dtype).reshape(*shape[:-1], self.out_features)
        elif x.numel() >= base.AMX_ROWS * self.in_features and x.device.type == "cpu":
            y = self._amx(x)  # fp32 arithmetic, where the CPU has AMX
            if y is not None:
                return y.to(dtype).reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)
        if self.interleaved:  # x W^T = interleave4(x) interleave4(W)^T: the same sum, reordered
            x2 = interleave4(x2)
        if self.kernel == "fused":
            y = fused_int8_matmul(x2, self.qweight, self._scale_act)
        elif x2.is_cuda:  # no int8 weight-only GEMM in torch for CUDA: int8 -> act dtype, one GEMM
            y = (x2 @ self.qweight.to(x2.dtype).T) * self._scale_act
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self._scale_act)
        if self._zs is not None:
            y = y - x2.sum(-1, keepdim=True) * self._zs
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*shape[:-1], self.out_features)


# ---- fused dequantize-matvec (compiled) ------------------------------------------------------
def _int8_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # y[m, n] = sum_k x[m, k] q[n, k] * s[n]: Inductor fuses the int8->float conversion into
    # the reduction (no dequantized weight is ever written to memory).
    return (x[:, None, :] * q[None].to(x.dtype)).sum(-1) * scale


_compiled: dict[str, object] = {}


def fused_int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x (q * s)^T`` via a compiled fused kernel (falls back to int8pack if compiling fails)."""
    fn = _compiled.get("int8")
    if fn is None:
        fn = _compiled["int8"] = torch.compile(_int8_matmul_ref, dynamic=True)
    return fn(x, q, scale)  # type: ignore[operator]
