"""SmoothQuant W8A8 linears: INT8 weights and activations quantized per call (int8 x int8)."""

from __future__ import annotations

import warnings

import torch

from engine.quant.cpu_kernels import w8a8_available, w8a8_reduce_range
from engine.quant.formats import QuantizedWeight
from engine.quant.linear.base import QuantLinear, bias_copy


class W8A8Linear(QuantLinear):
    """SmoothQuant W8A8: INT8 per-channel weights, activations quantized per call (int8 x int8).

    The smoothing factor s has been folded offline: ``x / s`` into the preceding op (a norm or
    a linear) where there is one, else kept here as ``in_scale`` (multiplied before the GEMM);
    ``W * s`` into the weight before quantization.
    """

    bits = 8
    kernel = "fbgemm"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                 in_scale: torch.Tensor | None = None) -> None:
        n, k = qw.shape
        super().__init__(k, n, bias_copy(bias))
        if not qw.symmetric or qw.bits != 8:
            raise ValueError("W8A8 needs symmetric INT8 weights")
        if not w8a8_available():
            raise ValueError("W8A8 needs an int8 x int8 kernel (fbgemm/x86 on CPU); unavailable on this "
                             f"build/device (quantized engines: {torch.backends.quantized.supported_engines})")
        self.act_dtype = torch.float32
        # 8-bit activations only where the int8 GEMM does not saturate them (measured once)
        self.reduce_range = w8a8_reduce_range()
        self.register_buffer("qweight", qw.q.to(torch.int8).contiguous())
        self.register_buffer("scale", qw.scale.float().contiguous())
        self.register_buffer("zero", qw.zero.float().contiguous())
        self.register_buffer("in_scale", None if in_scale is None else in_scale.float().contiguous())
        self._prepare()

    def _prepare(self) -> None:
        n = self.out_features
        with warnings.catch_warnings():  # quantized-tensor creation is deprecated, the kernel is not
            warnings.simplefilter("ignore", UserWarning)
            qt = torch._make_per_channel_quantized_tensor(self.qweight.cpu(), self.scale.double().cpu(),
                                                          torch.zeros(n, dtype=torch.long), 0)
        self._packed = torch.ops.quantized.linear_prepack(qt, self.bias)

    def set_act_dtype(self, dtype: torch.dtype) -> None:  # fbgemm takes fp32 only
        pass

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scale, self.zero, 8, None, True)

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).float()
        if self.in_scale is not None:
            x2 = x2 * self.in_scale
        y = torch.ops.quantized.linear_dynamic(x2, self._packed, self.reduce_range)
        return y.to(dtype).reshape(*shape[:-1], self.out_features)
