"""Attention over the paged KV cache, behind a registry of backends chosen by name.

Every backend sees the same per-step :class:`AttentionMetadata` (built once per step by the
runner, shared by all layers) and the same cache layout: per layer K and V tensors of shape
``[num_blocks * block_size, num_kv_heads, head_dim]`` where slot = block * block_size + offset.
The new tokens' K/V are written to their slots first, then each query attends to its request's
whole context (cached prefix + new tokens), causally; a layer with a sliding ``window`` W (Gemma
3's local layers) sees only the keys at positions p - W < k <= p from the query at p, as HF masks
it. Every layer keeps every block of a request even so: freeing the blocks that fell out of all
windows would suit a model whose layers are all local, which ours are not (a later optimisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """What attention needs for one flattened batch (no padding between requests).

    Attributes:
        slot_mapping: [T] cache slot of each new token.
        query_lens: new tokens per request, in batch order.
        context_lens: tokens in the cache per request after this step (cached + new).
        block_tables: each request's block ids.
        block_size: tokens per block.
    """

    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    prepared: dict = field(default_factory=dict)  # backend-specific, built by prepare()


class AttentionBackend:
    """Interface: ``prepare`` once per step, ``forward`` once per layer."""

    name = "base"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] of the new tokens -> output [T, Hq, D]; ``window``:
        the layer's sliding window (None: full causal attention)."""
        raise NotImplementedError


def _slots(block_table: list[int], n: int, block_size: int) -> torch.Tensor:
    bt = torch.tensor(block_table, dtype=torch.long)
    return (bt[:, None] * block_size + torch.arange(block_size)).flatten()[:n]


class SdpaBackend(AttentionBackend):
    """torch ``scaled_dot_product_attention`` (CPU and GPU).

    Single-token queries (decode) of all requests run as one padded SDPA call; each multi-token
    query (a prompt chunk or a speculative verify) runs as its own call, with ``is_causal`` when
    it has no cached prefix and an explicit offset-causal mask when it does. Sliding-window
    layers get masks of their own, built at their first use in a step and shared by the others.
    """

    name = "sdpa"

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        meta.prepared = self._build(meta, device, None)
        meta.prepared["device"], meta.prepared["windows"] = device, {}

    def _prepared(self, meta: AttentionMetadata, window: int | None) -> dict:
        """The step's masks and gathers for a layer with ``window``."""
        p = meta.prepared
        if window is None or max(meta.context_lens) <= window:  # the window hides nothing
            return p
        if window not in p["windows"]:
            p["windows"][window] = self._build(meta, p["device"], window)
        return p["windows"][window]

    @staticmethod
    def _build(meta: AttentionMetadata, device: torch.device, window: int | None) -> dict:
        """Masks and gathers for one step; with ``window`` W, key k is visible from the query
        at position p iff p - W < k <= p (HF's sliding_window_overlay on the causal mask)."""
        bs = meta.block_size
        decode_rows = [i for i, q in enumerate(meta.query_lens) if q == 1]
        starts = [0]
        for q in meta.query_lens:
            starts.append(starts[-1] + q)
        p: dict = {"num_tokens": starts[-1], "all_decode": len(decode_rows) == len(meta.query_lens),
                   "block_size": bs}
        if decode_rows:
            # Decode reads whole blocks (one contiguous row of block_size * heads * dim each), not
            # single slots: 16x fewer, larger copies.
            ctx = [meta.context_lens[i] for i in decode_rows]
            lmax = max(ctx)
            nblk = -(-lmax // bs)
            gather = torch.zeros(len(decode_rows), nblk, dtype=torch.long)
            for j, i in enumerate(decode_rows):
                n = -(-ctx[j] // bs)
                gather[j, :n] = torch.tensor(meta.block_tables[i][:n], dtype=torch.long)
            p["dec_tok"] = torch.tensor([starts[i] for i in decode_rows], device=device)
            p["dec_gather"] = gather.to(device)
            p["dec_len"] = lmax
            # Padding keys are masked out; no mask at all when every context has the same length
            # and no window hides a key.
            if window is None and min(ctx) == lmax:
                p["dec_mask"] = None
            else:
                keys, n = torch.arange(lmax)[None, :], torch.tensor(ctx)[:, None]
                visible = keys < n if window is None else (keys < n) & (keys >= n - window)
                p["dec_mask"] = visible[:, None, None, :].to(device)
        ext = []
        for i, q in enumerate(meta.query_lens):
            if q == 1:
                continue
            ctx, cached = meta.context_lens[i], meta.context_lens[i] - q
            windowed = window is not None and ctx > window
            if cached == 0 and not windowed:
                ext.append((starts[i], starts[i + 1], None, None))
                continue
            # keys before the first query's window are no one's: leave them out
            lo = max(0, cached + 1 - window) if windowed else 0
            keys, pos = torch.arange(lo, ctx)[None, :], (cached + torch.arange(q))[:, None]
            mask = (keys <= pos) & (keys > pos - window) if windowed else keys <= pos
            if cached == 0:  # a fresh prompt longer than the window: its own K/V, masked
                ext.append((starts[i], starts[i + 1], None, mask.to(device)))
            else:
                ext.append((starts[i], starts[i + 1], _slots(meta.block_tables[i], ctx, bs)[lo:].to(device),
                            mask.to(device)))
        p["ext"] = ext
        return p

    def forward(self, q, k, v, kv_cache, meta, scale, window=None):
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        p = self._prepared(meta, window)
        gqa = q.shape[1] != k.shape[1]
        if p["all_decode"]:
            return self._decode(q, k_cache, v_cache, p, scale, gqa)
        out = torch.empty_like(q)
        if "dec_tok" in p:
            out[p["dec_tok"]] = self._decode(q[p["dec_tok"]], k_cache, v_cache, p, scale, gqa)
        for start, end, slots, mask in p["ext"]:
            qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
            if slots is None:  # whole context is new: causal attention on the fresh K/V
                ks, vs = k[start:end], v[start:end]
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0),
                                                   vs.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                                   is_causal=mask is None, scale=scale, enable_gqa=gqa)
            else:
                ks, vs = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0),
                                                   vs.transpose(0, 1).unsqueeze(0),
                                                   attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start:end] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, p, scale, gqa):
        g, lmax, bs = p["dec_gather"], p["dec_len"], p["block_size"]
        b, nblk = g.shape
        shape = (b, nblk * bs, *k_cache.shape[1:])
        ks = k_cache.view(-1, bs, *k_cache.shape[1:]).index_select(0, g.view(-1)).view(shape)[:, :lmax]
        vs = v_cache.view(-1, bs, *v_cache.shape[1:]).index_select(0, g.view(-1)).view(shape)[:, :lmax]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                           attn_mask=p["dec_mask"], scale=scale,
                                           enable_gqa=gqa)  # [B, Hq, 1, D]
        return o.squeeze(2)


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 varlen with paged KV via block tables (CUDA only, imported lazily).

    flash-attn's paged KV requires the block size to be a multiple of 256.
    """

    name = "flash_attn"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("attention backend 'flash_attn' needs a CUDA GPU; use 'sdpa' on CPU")
        try:
            from flash_attn import flash_attn_varlen_func  # optional: the pdserve[gpu] extra
        except ImportError as e:
            raise RuntimeError("attention backend 'flash_attn' needs the flash-attn package: "
                               "pip install 'pdserve[gpu]'") from e
        self._fn = flash_attn_varlen_func

    def prepare(self, meta: AttentionMetadata, device: torch.device) -> None:
        if meta.block_size % 256:
            raise ValueError("flash_attn paged KV needs block_size to be a multiple of 256")
        width = max(len(b) for b in meta.block_tables)
        bt = torch.zeros(len(meta.block_tables), width, dtype=torch.int32)
        for i, b in enumerate(meta.block_tables):
            bt[i, :len(b)] = torch.tensor(b, dtype=torch.int32)
        cu_q = torch.tensor([0] + meta.query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0] + meta.context_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta.prepared = {"bt": bt.to(device), "cu_q": cu_q.to(device), "cu_k": cu_k.to(device),
                         "max_q": max(meta.query_lens), "max_k": max(meta.context_lens)}

    def forward(self, q, k, v, kv_cache, meta, scale, window=None):
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        p, bs = meta.prepared, meta.block_size
        shape = (-1, bs, k_cache.shape[1], k_cache.shape[2])
        # causal=True aligns the query block to the end of each context, as decode needs; a
        # window W sees the W - 1 keys before the query and itself: window_size (W - 1, 0).
        return self._fn(q, k_cache.view(shape), v_cache.view(shape), p["cu_q"], p["cu_k"],
                        p["max_q"], p["max_k"], softmax_scale=scale, causal=True, block_table=p["bt"],
                        window_size=(window - 1, 0) if window is not None else (-1, -1))


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": SdpaBackend,
    "flash_attn": FlashAttnBackend,
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Build the backend registered as ``name``; unknown names list the valid ones."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()
