"""Attention backends against a naive reference on random data and scattered block tables."""

from __future__ import annotations

import random

import pytest
import torch

from engine.layers.attention import AttentionMetadata, get_attention_backend


def _reference(q, k_all, v_all, cached, window=None):
    """Naive causal attention of q [q, Hq, D] over k/v [ctx, Hk, D]; query i sees keys <= cached + i
    (and, with a window W, > cached + i - W: HF's sliding window)."""
    hq, hk = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(hq // hk, dim=1).double()
    v = v_all.repeat_interleave(hq // hk, dim=1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    ctx = k.shape[0]
    pos = (cached + torch.arange(q.shape[0]))[:, None]
    mask = torch.arange(ctx)[None, :] <= pos
    if window is not None:
        mask &= torch.arange(ctx)[None, :] > pos - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


@pytest.mark.parametrize("backend_name", ["sdpa"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_matches_reference(backend_name, window, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    hq, hk, d, bs, num_blocks = 6, 2, 16, 4, 64
    backend = get_attention_backend(backend_name)
    k_cache = torch.zeros(num_blocks * bs, hk, d)
    v_cache = torch.zeros(num_blocks * bs, hk, d)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous block tables
    # (cached tokens, new tokens): decodes, a fresh prompt, a chunk on top of a cached prefix.
    shapes = [(9, 1), (0, 7), (3, 1), (13, 5), (0, 1), (20, 1)]
    rng.shuffle(shapes)
    tables, full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // bs))]
        tables.append(table)
        kk, vv = torch.randn(ctx, hk, d), torch.randn(ctx, hk, d)
        full_k.append(kk); full_v.append(vv)
        pos_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
        k_cache[pos_slots[:cached]] = kk[:cached]  # the prefix is already in the cache
        v_cache[pos_slots[:cached]] = vv[:cached]
        qs.append(torch.randn(new, hq, d)); ks.append(kk[cached:]); vs.append(vv[cached:])
        slots.append(pos_slots[cached:])
    meta = AttentionMetadata(torch.cat(slots), [n for _, n in shapes], [c + n for c, n in shapes],
                             tables, bs)
    backend.prepare(meta, torch.device("cpu"))
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), (k_cache, v_cache), meta, d ** -0.5,
                          window=window)
    start = 0
    for i, (cached, new) in enumerate(shapes):
        want = _reference(qs[i], full_k[i], full_v[i], cached, window)
        torch.testing.assert_close(out[start:start + new], want, atol=1e-5, rtol=1e-4)
        start += new
    # New tokens' K/V landed in their slots.
    torch.testing.assert_close(k_cache[torch.cat(slots)], torch.cat(ks))


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError, match="sdpa.*flash_attn"):
        get_attention_backend("paged_magic")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash_attn needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 16], ids=["full", "window16"])
def test_flash_attn_matches_sdpa_on_gpu(window):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (pip install 'pdserve[gpu]')")
    torch.manual_seed(0)
    hq, hk, d, bs = 8, 2, 64, 256
    dev = torch.device("cuda")
    k_cache = torch.randn(4 * bs, hk, d, device=dev, dtype=torch.float16)
    v_cache = torch.randn(4 * bs, hk, d, device=dev, dtype=torch.float16)
    tables, shapes = [[2, 0], [3]], [(300, 1), (0, 40)]
    slots = torch.cat([torch.tensor([t[p // bs] * bs + p % bs for p in range(c, c + n)])
                       for t, (c, n) in zip(tables, shapes)]).to(dev)
    t = sum(n for _, n in shapes)
    q = torch.randn(t, hq, d, device=dev, dtype=torch.float16)
    k = torch.randn(t, hk, d, device=dev, dtype=torch.float16)
    v = torch.randn(t, hk, d, device=dev, dtype=torch.float16)
    outs = []
    for name in ("sdpa", "flash_attn"):
        b = get_attention_backend(name)
        meta = AttentionMetadata(slots, [n for _, n in shapes], [c + n for c, n in shapes], tables, bs)
        b.prepare(meta, dev)
        outs.append(b.forward(q, k, v, (k_cache.clone(), v_cache.clone()), meta, d ** -0.5, window=window))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-3)
