"""INT4 weight-only linears (one copy of the weight, in the native kernels' layout where they
serve, else torch's int4pack) and the INT4 embedding table that reads a few of its rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import int4_blocks
from engine.models.native import (W_I4, Int4Kernel, amx_fits, amx_library, amx_linear, enabled_library,
                                  int4_codes, int4_weights, int8_activations_fit, library)
from engine.quant.cpu_kernels import native_bf16
from engine.quant.formats import QuantizedWeight, pack_int4, unpack_int4
from engine.quant.linear import base
from engine.quant.linear.base import QuantLinear, bias_copy, dequant_buffer

_INNER_K_TILES = 8  # tinygemm / CPU int4 packing tile; needs K % (inner_k_tiles * 16) == 0


def _native_int4_library(group_size: int, in_features: int):
    """The native kernels' library where they can serve this INT4 shape (groups of whole vector
    pairs), else None. PDSERVE_NATIVE_DECODE=0 turns them off here as in the one-token path."""
    lib = enabled_library()
    if lib is None:
        return None
    lanes = lib.pd_vector_width()
    return lib if group_size % (2 * lanes) == 0 and in_features % group_size == 0 else None


class Int4Linear(QuantLinear):
    """W [N, K] ~= (q - zero) * scale per group of ``group_size`` inputs; y = x W^T (+ bias).

    On a CPU with the native kernels (engine/models/native_decode.c) the module holds ONE copy of
    its weight, in their layout (``kernel == "native"``): ``qweight`` the codes in blocks of
    2 x vector-width columns, ``scale`` / ``zero`` as given (fp32), applied as
    ``q * scale - zero * scale`` (one FMA); ``scale_blocks``, where exact, the same scales and
    offsets in 0.75 bits per weight (engine/models/int4_blocks.py), which the kernels then read
    instead of ``scale`` / ``zero`` (kept for the state dict and embedding rows). Every path
    reads it: the one-token path's GEMV, batched steps through the same GEMV, prefill-sized
    steps through a GEMM on the weight dequantized into a scratch buffer (fp32 activations
    throughout). The state dict always holds the canonical (q, scale, zero). Elsewhere (no
    library, CUDA) the canonical buffers stay and torch's int4pack kernel serves from its own
    packed copy, with ``w = (q - 8) * s + z'``, ``z' = (8 - zero) * s``, s and z' rounded to bf16
    as it stores them.
    """

    bits = 4

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        n, k = qw.shape
        super().__init__(k, n, bias_copy(bias))
        self.group_size = qw.group_size
        self.symmetric = qw.symmetric
        self.register_buffer("qweight", pack_int4(qw.q).contiguous())  # canonical, [N, K/2]
        self.register_buffer("scale", qw.scale.float().contiguous())
        self.register_buffer("zero", qw.zero.float().contiguous())
        self.native = 0  # vector width of the native layout the buffers hold, 0: canonical
        # compact scales the native kernels read: a weight as served (the memory account counts
        # buffers so), not in the state dict (which stays canonical)
        self.register_buffer("scale_blocks", None, persistent=False)
        # the native GEMV quantizes its inputs to INT8 (set_int8_activations; < DEQUANT_ROWS rows)
        self.int8_activations = False
        self._prepare()

    def _prepare(self) -> None:
        dev = self.qweight.device
        lib = _native_int4_library(self.group_size, self.in_features) if dev.type == "cpu" else None
        if lib is not None:
            if not self.native:
                n = self.out_features
                lanes = lib.pd_vector_width()
                q, s, z = unpack_int4(self.qweight), self.scale.view(n, -1), self.zero.view(n, -1)
                self.scale_blocks = int4_blocks.compact(q, s, z, self.group_size)
                w, _, _ = int4_weights(q, s, z, self.group_size, lanes, torch.empty_like(self.qweight))
                self.qweight, self.native = w, lanes
            self.kernel, self.act_dtype = "native", torch.float32
            self._packed = self._scales_zeros = None
            self._kernel = None  # built on first use: single_token may move qweight first
            return
        self._to_canonical()
        q = unpack_int4(self.qweight).to(torch.int32)
        if dev.type == "cuda":
            self.kernel = "int4pack-cuda"
            self._packed = torch.ops.aten._convert_weight_to_int4pack(
                (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), _INNER_K_TILES)
        else:
            self.kernel = "int4pack"
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        sz = torch.stack((self.scale, (8.0 - self.zero) * self.scale), -1)  # [N, G, 2]
        self._scales_zeros = sz.transpose(0, 1).contiguous().to(self.act_dtype)  # [G, N, 2]

    def _canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K], scale, zero) in the canonical convention, whatever the buffers hold."""
        if not self.native:
            return unpack_int4(self.qweight), self.scale, self.zero
        return int4_codes(self.qweight, self.native), self.scale, self.zero

    def _to_canonical(self) -> None:
        if self.native:
            q, scale, zero = self._canonical()
            self.qweight, self.scale, self.zero, self.native = pack_int4(q).contiguous(), scale, zero, 0
            self._kernel, self.scale_blocks = None, None

    def use_int8_activations(self) -> None:
        """Small steps quantize their inputs to INT8 (set_int8_activations): the kernel is rebuilt."""
        self.int8_activations, self._kernel = True, None

    @property
    def packed(self) -> torch.Tensor | None:
        """torch's int4pack weight (a module built while the native kernels were off), or None."""
        return self._packed

    @property
    def scales_and_zeros(self) -> torch.Tensor | None:
        """int4pack's [G, N, 2] scales and zero points, in the activation dtype, or None."""
        return self._scales_zeros

    def set_packed(self, packed: torch.Tensor) -> None:
        """Hold ``packed`` (a copy of the int4pack weight, e.g. in the one-token path's buffer)
        instead of its own: one copy for both paths."""
        if self._packed is None or packed.shape != self._packed.shape or packed.dtype != self._packed.dtype:
            raise ValueError(f"int4pack weight {tuple(packed.shape)} {packed.dtype} for this module's "
                             f"{None if self._packed is None else tuple(self._packed.shape)}")
        self._packed = packed

    def set_native_weight(self, qweight: torch.Tensor) -> None:
        """Hold ``qweight`` (a copy of this module's native-layout codes, e.g. in the one-token
        path's huge-page buffer) instead of its own: one copy, read by every path."""
        if not self.native or qweight.shape != self.qweight.shape or qweight.dtype != torch.uint8:
            raise ValueError(f"native INT4 weight {tuple(qweight.shape)} {qweight.dtype} for a "
                             f"{'native' if self.native else 'canonical'} {tuple(self.qweight.shape)} module")
        self.qweight, self._kernel = qweight, None

    def native_kernel(self):
        """The :class:`engine.models.native.Int4Kernel` over this module's tensors (native only)."""
        if self._kernel is None:
            b = self.bias.detach().float().contiguous() if self.bias is not None else torch.zeros(self.out_features)
            self._bias32 = b
            n = self.out_features
            lib = library()
            aq = self.int8_activations and int8_activations_fit(W_I4, self.in_features, self.group_size,
                                                                 lib.pd_vector_width())
            self._kernel = Int4Kernel(lib, self.qweight, self.scale.view(n, -1), self.zero.view(n, -1), b,
                                      self.group_size, int8_activations=aq, meta=self.scale_blocks)
        return self._kernel

    # The state dict always holds the canonical (q, scale, zero), whatever this module reads.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.native:
            q, scale, zero = self._canonical()
            destination[prefix + "qweight"] = pack_int4(q)
            destination[prefix + "scale"], destination[prefix + "zero"] = scale, zero

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._to_canonical()  # load into the canonical buffers, then convert again
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._prepare()

    def set_act_dtype(self, dtype: torch.dtype) -> None:
        if self.native:  # the native kernels take fp32 activations only
            return
        self.act_dtype = dtype
        self._scales_zeros = self._scales_zeros.to(dtype)

    def _before_move(self) -> None:
        self._to_canonical()  # a move (to CUDA, say) starts from the layout every device reads

    def quantized_weight(self) -> QuantizedWeight:
        q, scale, zero = self._canonical()
        return QuantizedWeight(q, scale, zero, 4, self.group_size, self.symmetric)

    def kernel_weight(self) -> torch.Tensor:
        """The weight the kernel applies: exactly (q - zero) * scale as one FMA (native), or with
        scales and offsets rounded to bf16 as torch's int4pack kernel stores them."""
        n, k = self.out_features, self.in_features
        if self.native:
            return self.native_kernel().dequantize(torch.empty(n * k)).clone()
        q = unpack_int4(self.qweight).float().view(n, k // self.group_size, self.group_size)
        s = self.scale.to(torch.bfloat16).float()
        z = ((8.0 - self.zero) * self.scale).to(torch.bfloat16).float()
        return ((q - 8) * s[..., None] + z[..., None]).view(n, k)

    def weight_bytes(self) -> int:
        if self.native:
            scales = (self.scale, self.zero) if self.scale_blocks is None else (self.scale_blocks,)
            return sum(t.numel() * t.element_size() for t in (self.qweight, *scales))
        return (self._packed.numel() * self._packed.element_size()
                + self._scales_zeros.numel() * self._scales_zeros.element_size())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` as fp32 [*ids.shape, K], dequantized (an embedding lookup reads a
        handful of rows of a table it holds in INT4: :class:`QuantEmbedding`)."""
        flat = ids.reshape(-1)
        n, k, g = flat.numel(), self.in_features, self.group_size
        if self.native:
            q = int4_codes(self.qweight[flat], self.native)
        else:  # only the rows asked for are unpacked, never the whole table
            q = unpack_int4(self.qweight[flat])
        s = self.scale.view(self.out_features, -1)[flat]
        z = self.zero.view(self.out_features, -1)[flat]
        w = torch.addcmul(-(z * s)[..., None], q.view(n, k // g, g).float(), s[..., None])  # (q - zero) * s
        return w.view(*ids.shape, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        if self.native:
            x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
            return self._native_forward(x2).to(dtype).reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)
        if self.kernel == "int4pack-cuda":
            y = torch.ops.aten._weight_int4pack_mm(x2, self._packed, self.group_size, self._scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._packed, self.group_size, self._scales_zeros)
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _native_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """fp32 rows [R, K] -> [R, N] through the native layout: steps of AMX_ROWS rows or more on
        AMX where the CPU has it (the same fp32 arithmetic, in another order); else the GEMV for
        small steps and a GEMM over the weight dequantized into this thread's scratch buffer for
        prefill-sized ones."""
        kern = self.native_kernel()
        amx = None if self.int8_activations or x2.shape[0] < base.AMX_ROWS else amx_library()
        if amx is not None and amx_fits(self.out_features, self.in_features, self.group_size):
            return amx_linear(amx, kern.lin, x2)  # fp32 arithmetic, bias included
        if x2.shape[0] < base.DEQUANT_ROWS:
            return kern.linear(x2)  # bias included
        w = kern.dequantize(dequant_buffer(self.out_features * self.in_features))
        if self.int8_activations and native_bf16():
            # the INT8-activation mode's prefill: a bf16 GEMM (weights and activations
            # rounded to bf16) where the CPU multiplies bf16 natively: ~1.3-2.3x the fp32
            # GEMM on the 1.5B's shapes (2-core AVX-512 EPYC), as llama.cpp's prompt
            # processing multiplies quantized activations too
            wb = dequant_buffer(w.numel(), torch.bfloat16)[:w.numel()].view_as(w)
            wb.copy_(w)
            return F.linear(x2.to(torch.bfloat16), wb).float() + self._bias32
        return F.linear(x2, w, self._bias32)


class QuantEmbedding(nn.Module):
    """An embedding table kept in INT4 as the file shipped it (an :class:`Int4Linear` of
    [vocab, hidden]): a lookup dequantizes only the rows it reads. Qwen2.5-Coder-1.5B's Q4_K
    table is 0.18 GB this way against 0.93 GB in fp32."""

    def __init__(self, table: Int4Linear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 g{self.table.group_size}"
