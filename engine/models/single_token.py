"""Small-step decode fast path: a few tokens through native kernels or torch.compile'd graphs.

Two implementations of the same math. Where they build (x86-64 with AVX-512 or AVX2 + FMA and
a C compiler: every machine of this project's kind), the native kernels of native_decode.c
serve: one call per layer does attention (read in place from the paged cache), o_proj, MLP and
the next layer's qkv, and their INT8/INT4 GEMVs widen packed weights in registers (measured on
a 2-core AVX-512 Xeon, batch-1 INT8 decode: see the README's vs_llamacpp table). Elsewhere, or
with ``PDSERVE_NATIVE_DECODE=0``, the torch.compile'd graphs described below serve.

A step that carries a single token (one request decoding) is bound by reading the weights
(538 MB for SmolLM2 in fp32), and in eager torch also by ~30 small ops per layer, each a
dispatch and, for the GEMVs, a wake-up of the worker threads. Here each layer boundary is one
compiled call: ``o_proj`` + residual + norm + ``gate_up`` + SiLU·up + ``down_proj`` + residual
+ the next layer's norm + ``qkv_proj`` + rotary. The GEMVs are written as
``(w * x).sum(-1)``, which inductor turns into one vectorized, threaded pass over the weight
rows; attention (variable context length) stays with the eager backend between the calls.

Steps of a few tokens (a small decode batch, a 1+K speculative verify step) run the same
graphs with R rows: one GEMV per row written out, fused by inductor into one pass that loads
each weight once and updates R accumulators. Each R up to ``max_rows`` has its own graphs.
Measured (2 cores, AVX-512, tok/s against the eager batched forward, same run): fp32 batch 2
1.27x, 4 1.07x, 8 0.68-1.0x; INT8 1.26x / 1.08x / 1.12x; INT4 1.17x / 1.19x / 0.93x. Past
4 rows the multiply-adds per weight load, not the loads, bound it, and oneDNN's blocked GEMM
does those better.

The weights are plain ``[N, K]`` copies (the oneDNN-prepacked ones serve batched steps) kept in
one buffer advised into 2 MiB transparent huge pages: streaming 400+ MB per token through 4 KiB
pages costs TLB misses. Measured on the 2-core AVX2 box (ms per token, forward + LM head):
eager oneDNN 35, compiled 25, compiled in huge pages 21.5.

INT8 weight-only linears (engine/quant, per-channel, symmetric or not) run the same GEMV on
their int8 weights (a quarter of the bytes; the conversion is fused into the pass), read as
int32 words in a column-interleaved order that loads at full width on every ISA (see ``_dot`` in
engine/models/step_graphs.py, which holds the compiled functions), and are moved into the
huge-page buffer (engine/models/hugepages.py) rather than copied. INT4 linears call torch's int4pack
kernel from inside the compiled graphs (its packed weight moved into the buffer too). For fp32,
INT8 or INT4 models on CPU; anything else (W8A8, bf16, CUDA) keeps the eager path.
Families: Llama (Llama, Mistral, Qwen2) on both implementations; Gemma 3 on the native kernels
only (its QK-norm, sandwich norms, GeGLU and sliding window are data of their layer struct:
engine/models/layer_specs.py), its eager forward where they do not build.
Compiling takes a few seconds per row count once per process (inductor caches the kernels on
disk), done at load so the first request does not pay it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.memory import release_freed_memory
from engine.models import int4_blocks
from engine.models.hugepages import hugepage_empty
from engine.models.layer_specs import fits as layout_fits, layout
from engine.models.native import NativeLayers, int4_weights as native_int4_weights, enabled_library as native_library
from engine.models.step_graphs import compiled
from engine.quant.formats import interleave4

log = logging.getLogger(__name__)

NATIVE_ROWS, COMPILED_ROWS = 32, 4  # the largest step each implementation runs by default


def _is_int8(lin: nn.Module) -> bool:
    return (type(lin).__name__ == "Int8Linear" and getattr(lin, "kernel", "") in ("int8pack", "fused")
            and lin.in_features % 4 == 0)


def _is_int4(lin: nn.Module) -> bool:
    return type(lin).__name__ == "Int4Linear" and getattr(lin, "kernel", "") in ("int4pack", "native")


def _is_native_int4(lin: nn.Module) -> bool:
    """An INT4 linear already in the native kernels' layout (its only copy: engine/quant/linear/int4.py)."""
    return _is_int4(lin) and lin.kernel == "native"


def _is_fp32(lin: nn.Module) -> bool:
    return type(lin) is nn.Linear and lin.weight.dtype == torch.float32


class SingleTokenDecoder:
    """Runs a small step of a Llama-family or Gemma 3 model (see the module docstring).

    Built from the model's plain ``nn.Linear`` (and INT8/INT4) weights before they are prepacked;
    shares the model's attention backend, rotary tables and KV cache layout, so its results go
    into the same cache the batched path reads.
    """

    def __init__(self, model: nn.Module, max_rows: int | None = 1, min_rows: int = 1) -> None:
        cfg = model.config
        self.model = model
        self.eps, self.nq, self.nkv = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads
        self.tied = (model.lm_head.weight is getattr(model.embed_tokens, "weight", None)) if _is_fp32(model.lm_head) \
            else False
        mods: list[tuple[str, nn.Module]] = []
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            mods += [(f"{i}.qkv", a.qkv_proj), (f"{i}.o", a.o_proj), (f"{i}.gu", m.gate_up_proj),
                     (f"{i}.d", m.down_proj)]
        mods.append(("head", model.lm_head))
        self._mods, self._weights = mods, self._into_huge_pages(mods)
        self.layout = layout(model)  # each layer's norms, activation, window, rotary table
        self.ln1, self.ln2 = [s.ln1 for s in self.layout.specs], [s.ln2 for s in self.layout.specs]
        self.native: NativeLayers | None = None  # set by warm_up where the native kernels serve
        self.sync()
        lib = native_library()
        self._lib = lib if lib is not None and self._native_reads_all(lib.pd_vector_width()) else None
        # Steps of 1..max_rows tokens run here (at least min_rows: a 1+K verify step; at most
        # 32). None: NATIVE_ROWS with the native kernels, which compile nothing per row count
        # and beat the eager batched forward at 8 and 32 rows (bench/decode_rows.py, README);
        # COMPILED_ROWS with the graphs, where each row count is compiled at load and oneDNN's
        # GEMM keeps up past 4.
        self._rows, self._min_rows = max_rows, min_rows
        self.max_rows = self._max_rows()

    def __getstate__(self) -> dict:
        """For the served-weights cache (engine/weight_cache.py): everything but the native
        library handle and kernels, which each process builds (``warm_up``)."""
        state = dict(vars(self))
        state["_lib"], state["native"] = state["_lib"] is not None, None
        return state

    def __setstate__(self, state: dict) -> None:
        had_lib = state.pop("_lib")
        self.__dict__.update(state)
        self._lib = native_library() if had_lib else None

    def set_rows(self, max_rows: int | None, min_rows: int = 1) -> None:
        """This process's step sizes (as the constructor's): a decoder from the served-weights
        cache was built with the defaults, before warm_up compiles or builds for these."""
        self._rows, self._min_rows = max_rows, min_rows
        self.max_rows = self._max_rows()

    def _max_rows(self) -> int:
        rows = self._rows if self._rows is not None else NATIVE_ROWS if self._lib is not None else COMPILED_ROWS
        return min(32, max(1, rows, self._min_rows))

    def sync(self) -> None:
        """(Re)build each linear's tuple from its module: after a module's activation dtype
        changes (``set_act_dtype``), the INT4 kernel's scales follow it here too."""
        weights = self._weights
        self.lin: dict[str, tuple] = {}
        for name, mod in self._mods:
            n = mod.out_features
            bias = mod.bias.detach().float() if mod.bias is not None else torch.zeros(n)
            if _is_int8(mod):
                zs = torch.zeros(n) if mod.symmetric else (mod.zero * mod.scale).float()
                self.lin[name] = (weights[name], mod.scale.float(), zs, bias)
            elif _is_native_int4(mod):  # read by the native kernels as the module holds it
                self.lin[name] = (weights[name], mod.scale, mod.zero, bias, mod.group_size, mod.scale_blocks)
            elif _is_int4(mod):
                self.lin[name] = (weights[name], mod.scales_and_zeros, mod.group_size, bias)
            else:
                self.lin[name] = (weights[name], torch.ones(n), torch.zeros(n), bias)
        if self.native is not None:
            self.native = self._native_layers(self.native.lib)

    def _native_reads_all(self, lanes: int) -> bool:
        """Every linear is fp32, INT8, or INT4 in groups of whole vector pairs (``lanes`` floats
        each), and attention heads fit the kernel's vectors: the native kernels can serve."""
        head_dim = self.model.config.head_dim
        if head_dim % lanes or head_dim > 256:
            return False
        return all(not _is_int4(m) or (m.group_size % (2 * lanes) == 0 and m.in_features % m.group_size == 0)
                   for _, m in self._mods)

    def _native_lin(self, lanes: int) -> dict[str, tuple]:
        """The linears as the native kernels read them: fp32, INT8 and native INT4 as they are
        here (one copy: engine/quant/linear/int4.py's Int4Linear holds the kernels' layout); an INT4
        module on torch's int4pack kernel (built while the native kernels were off) gets a copy
        in their layout, in huge pages."""
        mods = {n: m for n, m in self._mods if _is_int4(m) and not _is_native_int4(m)}
        if not mods:
            return self.lin
        qws = {n: m.quantized_weight() for n, m in mods.items()}
        buf = hugepage_empty(sum(qw.q.numel() // 2 for qw in qws.values()), torch.uint8)
        out, pos = dict(self.lin), 0
        for name, qw in qws.items():
            n, k = qw.q.shape
            view = buf[pos:pos + n * k // 2].view(n, k // 2)
            pos += n * k // 2
            s, z = qw.scale.view(n, -1), qw.zero.view(n, -1)
            meta = int4_blocks.compact(qw.q, s, z, qw.group_size)
            w, s, z = native_int4_weights(qw.q, s, z, qw.group_size, lanes, view)
            out[name] = (w, s, z, self.lin[name][3], qw.group_size, meta)
        return out

    def _native_layers(self, lib) -> NativeLayers:
        return NativeLayers(lib, self._native_lin(lib.pd_vector_width()), self.layout.specs, self.layout.norm,
                            self.eps, self.nq, self.nkv, self.max_rows,
                            int8_activations=getattr(self.model, "int8_activations", False))

    @property
    def kernel(self) -> str:
        """What runs these steps: "native" (engine/models/native_decode.c) or "compiled"."""
        return "native" if self.native is not None else "compiled"

    def _into_huge_pages(self, mods: list[tuple[str, nn.Module]]) -> dict[str, torch.Tensor]:
        """Each linear's weight in one huge-page buffer per dtype: fp32 weights copied (the
        module keeps its own, to be prepacked); INT8 ones moved in interleave4 order (the module
        reads that copy, interleaving its activations), returned as int32 words."""
        out: dict[str, torch.Tensor] = {}

        def weight(m: nn.Module) -> torch.Tensor:
            if _is_native_int4(m):
                return m.qweight
            return m.quantized_weight().q if _is_int8(m) else m.packed if _is_int4(m) else m.weight

        # shapes first, each weight fetched only when moved: holding them all until the end
        # would keep every module's old copy alive too (the loading peak, not the steady state)
        meta = {}
        for n, m in mods:
            w = weight(m)  # an interleaved INT8 one is a copy: once each
            meta[n] = (w.dtype, w.shape, w.numel())
            del w
        for dtype in (torch.float32, torch.int8, torch.uint8):
            group = [(n, m) for n, m in mods if meta[n][0] == dtype]
            pad = lambda k: -(-k // 64) * 64  # 64-element aligned views (the int8 kernel wants it)
            buf = hugepage_empty(sum(pad(meta[n][2]) for n, _ in group), dtype)
            pos = 0
            with torch.no_grad():
                for name, mod in group:
                    w = weight(mod)
                    view = buf[pos:pos + w.numel()].view(w.shape)
                    pos += pad(w.numel())
                    if _is_int8(mod):
                        view.copy_(interleave4(w))
                        mod.set_interleaved(view)
                        out[name] = view.view(torch.int32)
                    elif _is_native_int4(mod):  # moved: the module and the kernels share it
                        view.copy_(w)
                        mod.set_native_weight(view)
                        out[name] = view
                    elif _is_int4(mod):  # the kernel's own layout, shared with the module
                        view.copy_(w)
                        mod.set_packed(view)
                        out[name] = view
                    else:
                        view.copy_(w)
                        # the module reads this copy from now on: its own (which prepacking
                        # replaces, while this object keeps the module) is freed, not a third copy
                        mod.weight.data = view
                        out[name] = view
                    del w
                    release_freed_memory()  # the old copy, back to the OS before the next one
        return out

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """True for a CPU Llama-family or Gemma 3 model whose decoder linears and LM head are fp32
        ``nn.Linear``, INT8 or INT4 weight-only, with fp32 embeddings and norms (the layer
        structures engine/models/layer_specs.py describes: other families run their eager forward)."""
        if not hasattr(model, "layers") or not layout_fits(model):
            return False
        p = getattr(model.embed_tokens, "weight", None)  # none: an INT4 table (QuantEmbedding), fp32 rows
        if p is not None and (p.dtype != torch.float32 or p.device.type != "cpu"):
            return False
        if sys.byteorder != "little":  # INT8 bytes are read out of int32 words by position
            return False
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
                if not (_is_fp32(lin) or _is_int8(lin) or _is_int4(lin)):
                    return False
        return _is_fp32(model.lm_head) or _is_int8(model.lm_head) or _is_int4(model.lm_head)

    def warm_up(self) -> bool:
        """Compile every graph now (with dummy inputs), so no request waits for it.

        Where the native kernels build and read every linear, they serve and nothing is compiled
        (``PDSERVE_NATIVE_DECODE=0`` keeps the compiled graphs, to compare). Returns False (and
        logs why) when compiling fails, e.g. no C++ compiler on the machine: the caller then
        keeps the eager path.
        """
        if self._lib is not None:
            try:
                self.native = self._native_layers(self._lib)
                self._check_native()
            except Exception as e:  # noqa: BLE001 - whatever failed, the compiled graphs can serve
                log.warning("native decode kernels failed at load (%s), using the compiled graphs", e)
                self.native, self._lib = None, None
                self.max_rows = self._max_rows()
        if self.native is None and not self.layout.graphs:
            log.info("%s: no native decode kernels here and no compiled graphs for the family: eager decode",
                     self.model.config.family)
            return False
        try:
            if self.native is None:
                self._run_once()
        except Exception as e:  # noqa: BLE001 - any compiler failure means "use the eager path"
            log.warning("compiled one-token decode path unavailable, using eager: %s", str(e).splitlines()[0])
            return False
        m = self.model
        if self.tied:  # the embedding lookup reads the huge-page copy too: no second plain copy
            m.embed_tokens.weight = nn.Parameter(self.lin["head"][0], requires_grad=False)
            if isinstance(m.lm_head, nn.Linear):
                m.lm_head.weight = m.embed_tokens.weight
        return True

    def _check_native(self) -> None:
        """One dummy token through every native entry point but attention: a library that
        loads but cannot run here fails now, not on the first request."""
        nat, m = self.native, self.model
        h, o = torch.zeros(1, m.config.hidden_size), torch.zeros(1, self.nq * nat.head_dim)
        cos, sin = m.rotary.cos[:1].contiguous(), m.rotary.sin[:1].contiguous()
        nat.pre(h, cos, sin)
        if len(m.layers) > 1:
            nat.post_pre(0, h, o, cos, sin)
        nat.post(len(m.layers) - 1, h, o)
        if not bool(torch.isfinite(nat.logits(h)).all()):
            raise RuntimeError("non-finite logits from a zero input")

    def _run_once(self) -> None:
        m, lin = self.model, self.lin
        last = len(m.layers) - 1
        with torch.inference_mode():
            for rows in range(1, self.max_rows + 1):
                # inputs made as forward makes them (same strides: no recompile when serving)
                pos = torch.zeros(rows, dtype=torch.long)
                cos, sin = m.rotary.cos[pos][:, None], m.rotary.sin[pos][:, None]
                h = m.embed_tokens(pos)
                # every (fp32 | int8) combination of the layers present gets its graphs now
                seen = set()
                for i in range(len(m.layers)):
                    key = tuple(lin[f"{i}.{p}"][0].dtype for p in ("qkv", "o", "gu", "d"))
                    nxt = lin[f"{min(i + 1, last)}.qkv"][0].dtype
                    if (key, nxt) in seen:
                        continue
                    seen.add((key, nxt))
                    q, _, _ = compiled("_pre")(h, self.ln1[i], lin[f"{i}.qkv"], cos, sin, self.eps, self.nq,
                                                self.nkv)
                    o = torch.zeros(rows, q[0].numel())
                    compiled("_post_pre")(h, o, lin[f"{i}.o"], self.ln2[i], lin[f"{i}.gu"], lin[f"{i}.d"],
                                           self.ln1[min(i + 1, last)], lin[f"{min(i + 1, last)}.qkv"], cos, sin,
                                           self.eps, self.nq, self.nkv)
                    compiled("_post")(h, o, lin[f"{i}.o"], self.ln2[i], lin[f"{i}.gu"], lin[f"{i}.d"], self.eps)
                self.logits(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Same contract as ``LlamaForCausalLM.forward`` for up to ``max_rows`` tokens (one
        request decoding, a small decode batch, a 1+K verify step): hidden [T, hidden]."""
        m, lin = self.model, self.lin
        if not 1 <= input_ids.shape[0] <= self.max_rows:
            raise ValueError(f"{input_ids.shape[0]} tokens: the compiled path runs 1..{self.max_rows}")
        if self.native is not None:
            return self._forward_native(input_ids, positions, meta, kv_caches, layer_done)
        cos, sin = m.rotary.cos[positions][:, None], m.rotary.sin[positions][:, None]
        h = m.embed_tokens(input_ids)
        pre, post_pre, post = compiled("_pre"), compiled("_post_pre"), compiled("_post")
        q, k, v = pre(h, self.ln1[0], lin["0.qkv"], cos, sin, self.eps, self.nq, self.nkv)
        last = len(m.layers) - 1
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            o = a.backend.forward(q, k, v, kv_caches[i], meta, a.scale).reshape(q.shape[0], -1)
            if layer_done is not None:
                layer_done(i)
            if i < last:
                h, q, k, v = post_pre(h, o, lin[f"{i}.o"], self.ln2[i], lin[f"{i}.gu"], lin[f"{i}.d"],
                                      self.ln1[i + 1], lin[f"{i + 1}.qkv"], cos, sin, self.eps, self.nq, self.nkv)
            else:
                h = post(h, o, lin[f"{i}.o"], self.ln2[i], lin[f"{i}.gu"], lin[f"{i}.d"], self.eps)
        return h

    def _forward_native(self, input_ids, positions, meta, kv_caches, layer_done) -> torch.Tensor:
        m, nat, lay = self.model, self.native, self.layout
        nat.set_threads(torch.get_num_threads())
        rows, nq, nkv = input_ids.shape[0], self.nq, self.nkv
        tables = [(r.cos[positions].contiguous(), r.sin[positions].contiguous()) for r in lay.rotaries]
        rope = [tables[k] for k in lay.rope]  # each layer's (cos, sin): Gemma's local or global
        h = m.embed(input_ids).contiguous()  # a fresh tensor (Gemma's scaled too): updated in place below
        qkv = nat.pre(h, *rope[0])
        last = len(m.layers) - 1
        a0 = m.layers[0].self_attn
        if nat.attends(a0.backend, kv_caches):  # attention read in place from the paged cache too
            attn, keep = nat.step_attention(meta, positions, a0.scale)
            attn_p = ctypes.addressof(attn)
            for i in range(last + 1):
                nat.layer(i, i == last, h, qkv, *rope[min(i + 1, last)], attn_p, kv_caches[i])
                if layer_done is not None:
                    layer_done(i)
            del keep
            return h
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            o = a.backend.forward(qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:], kv_caches[i], meta,
                                  a.scale, window=getattr(a, "window", None)).reshape(rows, -1).contiguous()
            if layer_done is not None:
                layer_done(i)
            if i < last:
                qkv = nat.post_pre(i, h, o, *rope[i + 1])
            else:
                nat.post(i, h, o)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> fp32 logits [T, vocab] (final norm + LM head as one pass)."""
        if not 1 <= hidden.shape[0] <= self.max_rows:
            raise ValueError(f"{hidden.shape[0]} rows: the compiled path runs 1..{self.max_rows}")
        if self.native is not None:
            logits, cap = self.native.logits(hidden), self.layout.softcap
            return logits if cap is None else torch.tanh(logits / cap) * cap
        return compiled("_logits")(hidden, self.model.norm.weight, self.lin["head"], self.eps)
