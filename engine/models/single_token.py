"""Batch-1 decode fast path: one token through torch.compile'd (inductor) kernels.

A step that carries a single token (one request decoding) is bound by reading the weights
(538 MB for SmolLM2 in fp32), and in eager torch also by ~30 small ops per layer, each a
dispatch and, for the GEMVs, a wake-up of the worker threads. Here each layer boundary is one
compiled call: ``o_proj`` + residual + norm + ``gate_up`` + SiLU·up + ``down_proj`` + residual
+ the next layer's norm + ``qkv_proj`` + rotary. The GEMVs are written as
``(w * x).sum(-1)``, which inductor turns into one vectorized, threaded pass over the weight
rows; attention (variable context length) stays with the eager backend between the calls.

The weights are plain ``[N, K]`` copies (the oneDNN-prepacked ones serve batched steps) kept in
one buffer advised into 2 MiB transparent huge pages: streaming 400+ MB per token through 4 KiB
pages costs TLB misses. Measured on the 2-core AVX2 box (ms per token, forward + LM head):
eager oneDNN 35, compiled 25, compiled in huge pages 21.5.

Only for fp32 on CPU with plain (not quantized) linears; anything else keeps the eager path.
Compiling takes a few seconds once per process (inductor caches the kernels on disk), done at
load so the first request does not pay it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def hugepage_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor whose storage is advised into transparent huge pages (Linux; elsewhere, or
    if the kernel says no, ordinary memory). Must be written after this call to take effect."""
    elem = torch.empty((), dtype=dtype).element_size()
    pad = _HUGE_PAGE // elem
    flat = torch.empty(numel + pad, dtype=dtype)
    off = (-flat.data_ptr() % _HUGE_PAGE) // elem
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None)
            length = (numel * elem) // _HUGE_PAGE * _HUGE_PAGE
            if length:
                libc.madvise(ctypes.c_void_p(flat.data_ptr() + off * elem), ctypes.c_size_t(length),
                             _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc to ask: plain pages are still correct
            pass
    return flat[off:off + numel]


# --- the compiled functions (shared by every layer and every engine in the process) ---------

def _gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (w * x).sum(-1) + b


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's formula (normalize, then scale), so fp32 results match it closely
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _pre(h, ln, w_qkv, b_qkv, cos, sin, eps: float, nq: int, nkv: int):
    """norm + qkv_proj + rotary of one token -> q [nq, D], k [nkv, D], v [nkv, D]."""
    qkv = _gemv(_rms(h, ln, eps), w_qkv, b_qkv).view(nq + 2 * nkv, -1)
    qk = qkv[:nq + nkv]
    x1, x2 = qk.chunk(2, -1)
    qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    return qk[:nq], qk[nq:], qkv[nq + nkv:]


def _post(h, o, w_o, ln2, w_gu, w_d, zero_h, zero_gu, eps: float):
    """h + o_proj(o), then + mlp(norm(.)) -> the next residual stream."""
    h = h + _gemv(o, w_o, zero_h)
    gate, up = _gemv(_rms(h, ln2, eps), w_gu, zero_gu).chunk(2)
    return h + _gemv(F.silu(gate) * up, w_d, zero_h)


def _post_pre(h, o, w_o, ln2, w_gu, w_d, zero_h, zero_gu, ln1, w_qkv, b_qkv, cos, sin,
              eps: float, nq: int, nkv: int):
    h = _post(h, o, w_o, ln2, w_gu, w_d, zero_h, zero_gu, eps)
    return (h, *_pre(h, ln1, w_qkv, b_qkv, cos, sin, eps, nq, nkv))


def _logits(h, ln, w, zero_v, eps: float):
    return _gemv(_rms(h, ln, eps), w, zero_v)


_COMPILED: dict[str, Callable] = {}


def _compiled(name: str) -> Callable:
    fn = _COMPILED.get(name)
    if fn is None:
        import torch._inductor.config as inductor_config
        # Compile in this process: a pool of compile workers would compete with the serving
        # threads (and with Ray) for the few cores a CPU worker has.
        inductor_config.compile_threads = 1
        # One graph per model shape: a process holding several models (tests, draft + target)
        # needs more than dynamo's default of 8 before it gives up.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        fn = _COMPILED[name] = torch.compile(globals()[name], dynamic=False, fullgraph=True)
    return fn


class SingleTokenDecoder:
    """Runs a one-token step of a Llama-family model (see the module docstring).

    Built from the model's plain ``nn.Linear`` weights before they are prepacked; shares the
    model's attention backend, rotary tables and KV cache layout, so its results go into the
    same cache the batched path reads.
    """

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.eps, self.nq, self.nkv = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads
        tied = model.lm_head.weight is model.embed_tokens.weight
        mats: list[tuple[str, torch.Tensor]] = []
        for i, layer in enumerate(model.layers):
            a, m = layer.self_attn, layer.mlp
            mats += [(f"{i}.qkv", a.qkv_proj.weight), (f"{i}.o", a.o_proj.weight),
                     (f"{i}.gu", m.gate_up_proj.weight), (f"{i}.d", m.down_proj.weight)]
        mats.append(("embed" if tied else "lm_head",
                     model.embed_tokens.weight if tied else model.lm_head.weight))
        buf = hugepage_empty(sum(w.numel() for _, w in mats), torch.float32)
        self.w: dict[str, torch.Tensor] = {}
        pos = 0
        with torch.no_grad():
            for name, w in mats:
                view = buf[pos:pos + w.numel()].view(w.shape)
                view.copy_(w)
                self.w[name] = view
                pos += w.numel()
        self.tied = tied
        self.lm_head = self.w["embed" if tied else "lm_head"]
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.zero_h, self.zero_gu = torch.zeros(hidden), torch.zeros(2 * inter)
        self.zero_v = torch.zeros(self.lm_head.shape[0])
        self.b_qkv = [l.self_attn.qkv_proj.bias.detach().clone() if l.self_attn.qkv_proj.bias is not None
                      else torch.zeros(l.self_attn.qkv_proj.out_features) for l in model.layers]
        self.ln1 = [l.input_layernorm.weight for l in model.layers]
        self.ln2 = [l.post_attention_layernorm.weight for l in model.layers]

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """True for an fp32 CPU model whose decoder linears are plain ``nn.Linear``."""
        p = model.embed_tokens.weight
        if p.dtype != torch.float32 or p.device.type != "cpu" or not hasattr(model, "layers"):
            return False
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj):
                if type(lin) is not nn.Linear or lin.weight.dtype != torch.float32:
                    return False
            if a.o_proj.bias is not None:
                return False
        return type(model.lm_head) is nn.Linear and model.lm_head.bias is None

    def warm_up(self) -> bool:
        """Compile every graph now (with dummy inputs), so no request waits for it.

        Returns False (and logs why) when compiling fails, e.g. no C++ compiler on the machine:
        the caller then keeps the eager path.
        """
        try:
            self._run_once()
        except Exception as e:  # noqa: BLE001 - any compiler failure means "use the eager path"
            log.warning("compiled one-token decode path unavailable, using eager: %s", str(e).splitlines()[0])
            return False
        m = self.model
        if self.tied:  # the embedding lookup reads the huge-page copy too: no second plain copy
            m.embed_tokens.weight = nn.Parameter(self.w["embed"], requires_grad=False)
            if isinstance(m.lm_head, nn.Linear):
                m.lm_head.weight = m.embed_tokens.weight
        return True

    def _run_once(self) -> None:
        m = self.model
        cos, sin = m.rotary.cos[:1], m.rotary.sin[:1]
        h = torch.zeros(m.config.hidden_size)
        with torch.inference_mode():
            q, k, v = _compiled("_pre")(h, self.ln1[0], self.w["0.qkv"], self.b_qkv[0], cos, sin,
                                        self.eps, self.nq, self.nkv)
            o = torch.zeros(q.numel())
            last = len(m.layers) - 1
            _compiled("_post_pre")(h, o, self.w["0.o"], self.ln2[0], self.w["0.gu"], self.w["0.d"],
                                   self.zero_h, self.zero_gu, self.ln1[0], self.w["0.qkv"], self.b_qkv[0],
                                   cos, sin, self.eps, self.nq, self.nkv)
            _compiled("_post")(h, o, self.w[f"{last}.o"], self.ln2[last], self.w[f"{last}.gu"],
                               self.w[f"{last}.d"], self.zero_h, self.zero_gu, self.eps)
            self.logits(h[None])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Same contract as ``LlamaForCausalLM.forward`` for one token: hidden [1, hidden]."""
        m, w = self.model, self.w
        pos = positions[0]
        cos, sin = m.rotary.cos[pos][None], m.rotary.sin[pos][None]
        h = m.embed_tokens.weight[input_ids[0]]
        pre, post_pre, post = _compiled("_pre"), _compiled("_post_pre"), _compiled("_post")
        q, k, v = pre(h, self.ln1[0], w["0.qkv"], self.b_qkv[0], cos, sin, self.eps, self.nq, self.nkv)
        last = len(m.layers) - 1
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            o = a.backend.forward(q[None], k[None], v[None], kv_caches[i], meta, a.scale).reshape(-1)
            if layer_done is not None:
                layer_done(i)
            if i < last:
                h, q, k, v = post_pre(h, o, w[f"{i}.o"], self.ln2[i], w[f"{i}.gu"], w[f"{i}.d"],
                                      self.zero_h, self.zero_gu, self.ln1[i + 1], w[f"{i + 1}.qkv"],
                                      self.b_qkv[i + 1], cos, sin, self.eps, self.nq, self.nkv)
            else:
                h = post(h, o, w[f"{i}.o"], self.ln2[i], w[f"{i}.gu"], w[f"{i}.d"],
                         self.zero_h, self.zero_gu, self.eps)
        return h[None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, hidden] -> fp32 logits [1, vocab] (final norm + LM head as one GEMV)."""
        return _compiled("_logits")(hidden[0], self.model.norm.weight, self.lm_head, self.zero_v,
                                    self.eps)[None]
