"""Quantized linear layers: drop-in ``nn.Linear`` replacements over packed integer kernels.

Each module keeps the canonical integer weight (what a checkpoint stores, see formats.py) as
its state and builds the kernel's own layout from it once, at construction. Kernels, by name:

    int8  "int8pack"  torch ``aten._weight_int8pack_mm`` (CPU); on CUDA, untested here (no GPU
                      lent): the int8 weight is cast to the activation dtype inside one GEMM
          "fused"     a compiled dequantize-matvec (torch.compile / Inductor C++): reads the
                      int8 weight once, converts in registers; fp32 activations
    int4  "int4pack"  ``aten._weight_int4pack_mm_for_cpu`` (CPU) or ``aten._weight_int4pack_mm``
                      (CUDA, tinygemm), both over a weight repacked once at load
    w8a8  "fbgemm"    ``quantized::linear_dynamic``: int8 x int8 GEMM with per-tensor dynamic
                      activation quantization (fbgemm/oneDNN on x86 CPUs); 7-bit activations
                      where this CPU's kernel saturates 8-bit ones (no VNNI, see cpu_kernels.py)

The packed CPU kernels are fast only with bf16 activations on AVX2 CPUs (fp32 activations are
6-13x slower, see bench/quant.py), so ``act_dtype`` says in which dtype the kernel runs; the
module casts in and out, and its output has the input's dtype. ``choose_act_dtype`` times both
per layer shape and keeps the faster.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.cpu_kernels import native_bf16, w8a8_available, w8a8_reduce_range
from engine.quant.formats import QuantizedWeight, deinterleave4, interleave4, pack_int4, unpack_int4

_INNER_K_TILES = 8  # tinygemm / CPU int4 packing tile; needs K % (inner_k_tiles * 16) == 0


def _bias(linear_bias: torch.Tensor | None) -> torch.Tensor | None:
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

    def quantized_weight(self) -> QuantizedWeight:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes the kernel reads per forward (packed weight + scales/zeros + bias)."""
        raise NotImplementedError

    def set_act_dtype(self, dtype: torch.dtype) -> None:
        self.act_dtype = dtype

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={self.kernel}, act_dtype={str(self.act_dtype).removeprefix('torch.')}")


class Int8Linear(QuantLinear):
    """W [N, K] ~= (q - zero) * scale per output channel; y = x W^T (+ bias).

    Asymmetric weights use ``x (q - z)^T s = (x q^T) s - (sum_k x_k) (z s)``: the kernel runs on
    q, and one rank-1 correction follows.
    """

    bits = 8

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, kernel: str = "int8pack") -> None:
        n, k = qw.shape
        super().__init__(k, n, _bias(bias))
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

    def _apply(self, fn, recurse=True):  # .to(device) etc. must move the derived tensors too
        out = super()._apply(fn, recurse)
        self._prepare()
        return out

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
        wb = _dequant_buffer(n * k, torch.bfloat16)[:n * k].view(n, k)
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

    def _a8_kernel(self):
        """The native INT8-activation kernel over this module's interleaved weight, or None where
        it does not serve (off, not interleaved, not on CPU, no library, a shape it cannot tile)."""
        if not (self.int8_activations and self.interleaved and self.qweight.device.type == "cpu"):
            return None
        if self._a8 is None:
            from engine.models.native import W_I8, Int8Kernel, enabled_library, int8_activations_fit
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
            if x.numel() < DEQUANT_ROWS * self.in_features:
                kern = self._a8_kernel()
                if kern is not None:
                    x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
                    return kern.linear(x2).to(dtype).reshape(*shape[:-1], self.out_features)
            elif native_bf16():  # a prefill-sized step: bf16 GEMM, as Int4Linear's in this mode
                return self._bf16_gemm(x).to(dtype).reshape(*shape[:-1], self.out_features)
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


# Steps of at least this many rows dequantize an INT4 weight to fp32 and run one GEMM (the
# dequantization is ~1 op per weight, the GEMM 2 per weight per row); fewer run the native GEMV
# on the codes. Measured on a 2-core AVX-512 EPYC, 17920x1536: at 64 rows the GEMV took 21 ms
# and the GEMM 80; at 512, 544 and 353 (+5 dequantizing).
DEQUANT_ROWS = 128
_scratch = threading.local()  # per thread: the dequantized weight of the linear running now


def _dequant_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    name = "buf" if dtype == torch.float32 else f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


def _native_int4_library(group_size: int, in_features: int):
    """The native kernels' library where they can serve this INT4 shape (groups of whole vector
    pairs), else None. PDSERVE_NATIVE_DECODE=0 turns them off here as in the one-token path."""
    from engine.models.native import enabled_library  # engine.models imports engine.quant: here, not at the top
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
    ``q * scale - zero * scale`` (one FMA). Every path reads it: the
    one-token path's GEMV, batched steps through the same GEMV, prefill-sized steps through a
    GEMM on the weight dequantized into a scratch buffer (fp32 activations throughout). The
    state dict always holds the canonical (q, scale, zero). Elsewhere (no library, CUDA) the
    canonical buffers stay and torch's int4pack kernel serves from its own packed copy, with
    ``w = (q - 8) * s + z'``, ``z' = (8 - zero) * s``, s and z' rounded to bf16 as it stores them.
    """

    bits = 4

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        n, k = qw.shape
        super().__init__(k, n, _bias(bias))
        self.group_size = qw.group_size
        self.symmetric = qw.symmetric
        self.register_buffer("qweight", pack_int4(qw.q).contiguous())  # canonical, [N, K/2]
        self.register_buffer("scale", qw.scale.float().contiguous())
        self.register_buffer("zero", qw.zero.float().contiguous())
        self.native = 0  # vector width of the native layout the buffers hold, 0: canonical
        # the native GEMV quantizes its inputs to INT8 (set_int8_activations; < DEQUANT_ROWS rows)
        self.int8_activations = False
        self._prepare()

    def _prepare(self) -> None:
        dev = self.qweight.device
        lib = _native_int4_library(self.group_size, self.in_features) if dev.type == "cpu" else None
        if lib is not None:
            from engine.models.native import int4_weights
            if not self.native:
                n = self.out_features
                lanes = lib.pd_vector_width()
                w, _, _ = int4_weights(unpack_int4(self.qweight), self.scale.view(n, -1), self.zero.view(n, -1),
                                       self.group_size, lanes, torch.empty_like(self.qweight))
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
        from engine.models.native import int4_codes
        return int4_codes(self.qweight, self.native), self.scale, self.zero

    def _to_canonical(self) -> None:
        if self.native:
            q, scale, zero = self._canonical()
            self.qweight, self.scale, self.zero, self.native = pack_int4(q).contiguous(), scale, zero, 0
            self._kernel = None

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
            from engine.models.native import Int4Kernel, library
            b = self.bias.detach().float().contiguous() if self.bias is not None else torch.zeros(self.out_features)
            self._bias32 = b
            n = self.out_features
            lib = library()
            from engine.models.native import W_I4, int8_activations_fit
            aq = self.int8_activations and int8_activations_fit(W_I4, self.in_features, self.group_size,
                                                                 lib.pd_vector_width())
            self._kernel = Int4Kernel(lib, self.qweight, self.scale.view(n, -1), self.zero.view(n, -1), b,
                                      self.group_size, int8_activations=aq)
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

    def _apply(self, fn, recurse=True):
        self._to_canonical()  # a move (to CUDA, say) starts from the layout every device reads
        out = super()._apply(fn, recurse)
        self._prepare()
        return out

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
            return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.zero))
        return (self._packed.numel() * self._packed.element_size()
                + self._scales_zeros.numel() * self._scales_zeros.element_size())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` as fp32 [*ids.shape, K], dequantized (an embedding lookup reads a
        handful of rows of a table it holds in INT4: :class:`QuantEmbedding`)."""
        flat = ids.reshape(-1)
        n, k, g = flat.numel(), self.in_features, self.group_size
        if self.native:
            from engine.models.native import int4_codes
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
            kern = self.native_kernel()
            if x2.shape[0] < DEQUANT_ROWS:
                y = kern.linear(x2)  # bias included
            else:
                w = kern.dequantize(_dequant_buffer(self.out_features * self.in_features))
                if self.int8_activations and native_bf16():
                    # the INT8-activation mode's prefill: a bf16 GEMM (weights and activations
                    # rounded to bf16) where the CPU multiplies bf16 natively: ~1.3-2.3x the fp32
                    # GEMM on the 1.5B's shapes (2-core AVX-512 EPYC), as llama.cpp's prompt
                    # processing multiplies quantized activations too
                    wb = _dequant_buffer(w.numel(), torch.bfloat16)[:w.numel()].view_as(w)
                    wb.copy_(w)
                    y = F.linear(x2.to(torch.bfloat16), wb).float() + self._bias32
                else:
                    y = F.linear(x2, w, self._bias32)
            return y.to(dtype).reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)
        if self.kernel == "int4pack-cuda":
            y = torch.ops.aten._weight_int4pack_mm(x2, self._packed, self.group_size, self._scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._packed, self.group_size, self._scales_zeros)
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.reshape(*shape[:-1], self.out_features)


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
            mod.int8_activations, mod._kernel = True, None
            n += 1
        elif isinstance(mod, Int8Linear) and mod.kernel == "int8pack":
            if not mod.interleaved and mod.qweight.device.type == "cpu":
                with torch.no_grad():  # the kernel's column order (the one-token path keeps it too)
                    mod.set_interleaved(interleave4(mod.qweight).contiguous())
            mod.int8_activations, mod._a8 = True, None
            n += 1
    return n


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
        super().__init__(k, n, _bias(bias))
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

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._prepare()
        return out

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


# ---- per-layer activation dtype --------------------------------------------------------------
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


def reference_forward(mod: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The dequantized reference: ``F.linear(x, dequantize(W), bias)`` in fp32 (for tests); for
    INT4 with the scales/offsets at the precision the kernel stores them (bf16)."""
    w = mod.kernel_weight() if isinstance(mod, Int4Linear) else mod.quantized_weight().dequantize()
    y = F.linear(x.float(), w, mod.bias)
    return y
