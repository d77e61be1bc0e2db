"""KV of the real model survives gather -> encode -> decode -> scatter across different layouts.

The sender prefills a prompt into its blocks; every layer is gathered, encoded, sent as bytes,
decoded and scattered into blocks the receiver reserved (in shuffled order). The receiver's
cache must then hold exactly what its own prefill of the same prompt would have written, for
a different block size, dtype, or head sharding on the two sides.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledRequest, StepPlan
from kvtransfer.format import FrameError, decode_frames, encode_frames, gather_layer, scatter_layer

KV = list[tuple[torch.Tensor, torch.Tensor]]


def _engine(model_path, dtype: str, block_size: int) -> Iterator[LLMEngine]:
    eng = LLMEngine(EngineConfig(
        model=str(model_path), dtype=dtype,
        cache=CacheConfig(block_size=block_size, memory_gb=0.1, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096)), progress=False)
    yield eng
    assert eng.block_manager.num_used_blocks == 0, "a test leaked KV blocks"
    eng.block_manager.check_invariants()


@pytest.fixture(scope="module")
def e16(model_path):
    yield from _engine(model_path, "float32", 16)


@pytest.fixture(scope="module")
def e32(model_path):
    yield from _engine(model_path, "float32", 32)


@pytest.fixture(scope="module")
def b16(model_path):
    yield from _engine(model_path, "bfloat16", 16)


def _prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1234 + n)
    return torch.randint(vocab, (n,), generator=g).tolist()


@contextmanager
def _prefilled(eng: LLMEngine, ids: list[int]) -> Iterator[list[int]]:
    """Prefill ``ids`` into fresh blocks and keep them until the block exits; yields block ids."""
    req = Request("x", ids, SamplingParams(max_tokens=1))
    assert eng.block_manager.allocate(req.block_ids, len(ids))
    try:
        eng.runner.all_logits(StepPlan([ScheduledRequest(req, len(ids))]))
        yield req.block_ids
    finally:
        eng.block_manager.free(req.block_ids)


@contextmanager
def _reserved(eng: LLMEngine, n: int) -> Iterator[list[int]]:
    """Blocks for ``n`` tokens, shuffled so the receiver's block table is nothing like the sender's."""
    blocks: list[int] = []
    assert eng.block_manager.allocate(blocks, n)
    random.Random(n).shuffle(blocks)
    try:
        yield blocks
    finally:
        eng.block_manager.free(blocks)


def _gather_all(eng: LLMEngine, blocks: list[int], n: int) -> KV:
    bs = eng.block_manager.block_size
    return [gather_layer(kv, blocks, bs, 0, n) for kv in eng.runner.kv_caches]


def _send(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int],
          cuts: Sequence[int], heads: Sequence[tuple[int, int]] = ((0, 3),)) -> int:
    """Move every layer, in token chunks [cuts[i], cuts[i+1]) and head shards; returns frame count."""
    fp = src.model_config.fingerprint()
    n_heads = src.model_config.num_kv_heads
    sent = 0
    for layer, kv in enumerate(src.runner.kv_caches):
        for t0, t1 in zip(cuts, cuts[1:]):
            for h0, h1 in heads:
                k, v = gather_layer(kv, src_blocks, src.block_manager.block_size, t0, t1, h0, h1)
                frames = encode_frames("tx", fp, layer, t0, k, v, n_heads, head_start=h0)
                wire = [bytes(f) for f in frames]  # what a socket would deliver
                header, rk, rv = decode_frames(wire, fingerprint=dst.model_config.fingerprint())
                assert header.layer == layer
                scatter_layer(dst.runner.kv_caches[layer], dst_blocks, dst.block_manager.block_size,
                              header, rk, rv)
                sent += 1
    return sent


def _transfer(src: LLMEngine, dst: LLMEngine, ids: list[int], cuts: Sequence[int],
              heads: Sequence[tuple[int, int]] = ((0, 3),)) -> tuple[KV, KV]:
    """(KV the sender computed, KV the receiver ended up with), both gathered token-major."""
    n = len(ids)
    with _prefilled(src, ids) as src_blocks, _reserved(dst, n) as dst_blocks:
        assert _send(src, src_blocks, dst, dst_blocks, cuts, heads) == src.model_config.num_layers * (
            len(cuts) - 1) * len(heads)
        return _gather_all(src, src_blocks, n), _gather_all(dst, dst_blocks, n)


def _local_prefill(eng: LLMEngine, ids: list[int]) -> KV:
    with _prefilled(eng, ids) as blocks:
        return _gather_all(eng, blocks, len(ids))


def _assert_kv_equal(got: KV, want: KV) -> None:
    assert len(got) == len(want)
    for layer, ((gk, gv), (wk, wv)) in enumerate(zip(got, want)):
        assert gk.dtype == wk.dtype and gk.shape == wk.shape
        assert torch.equal(gk, wk) and torch.equal(gv, wv), f"layer {layer} differs"


# ---- the real model, across layouts ------------------------------------------------------------
@pytest.mark.parametrize("src_name, dst_name, n, cuts", [
    ("e16", "e32", 1, (0, 1)),
    ("e16", "e32", 17, (0, 5, 17)),  # chunks straddle both sides' block boundaries
    ("e32", "e16", 1, (0, 1)),
    ("e32", "e16", 17, (0, 17)),
])
def test_block_size_change_is_bitwise_exact(request, src_name, dst_name, n, cuts):
    src, dst = request.getfixturevalue(src_name), request.getfixturevalue(dst_name)
    assert src.block_manager.block_size != dst.block_manager.block_size
    ids = _prompt(n, src.model_config.vocab_size)
    sent, received = _transfer(src, dst, ids, cuts)
    _assert_kv_equal(received, _local_prefill(dst, ids))
    _assert_kv_equal(received, sent)
    assert received[0][0].abs().sum() > 0  # not a vacuous all-zero match


def test_long_prompt_block_size_change_is_bitwise_exact(e16, e32):
    # 2,000 tokens in uneven chunks over 125 sender / 63 receiver blocks. Compared with the
    # sender's KV only: a second 2,000-token prefill costs ~12 s on 2 cores, and that the two
    # engines' prefills agree bitwise across block sizes is shown by the short prompts above.
    ids = _prompt(2000, e16.model_config.vocab_size)
    sent, received = _transfer(e16, e32, ids, (0, 700, 1503, 2000))
    _assert_kv_equal(received, sent)
    assert received[-1][1][-1].abs().sum() > 0


@pytest.mark.parametrize("n", [1, 17])
def test_bf16_sender_to_fp32_receiver(b16, e32, n):
    ids = _prompt(n, b16.model_config.vocab_size)
    sent, received = _transfer(b16, e32, ids, (0, n))
    assert sent[0][0].dtype == torch.bfloat16 and received[0][0].dtype == torch.float32
    # Upcasting is exact: the receiver holds precisely the bf16 prefill's values.
    _assert_kv_equal(received, [(k.float(), v.float()) for k, v in _local_prefill(b16, ids)])
    # ...which are close to (not equal to) what an fp32 prefill computes, at the first layer.
    own = _local_prefill(e32, ids)
    torch.testing.assert_close(received[0][0], own[0][0], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("n", [1, 17])
def test_head_shards_assemble_into_full_receiver(e16, e32, n):
    assert e16.model_config.num_kv_heads == 3
    ids = _prompt(n, e16.model_config.vocab_size)
    # Two shards from one sender, in reverse order, into a receiver holding all heads.
    _, received = _transfer(e16, e32, ids, (0, n), heads=((1, 3), (0, 1)))
    _assert_kv_equal(received, _local_prefill(e32, ids))


def test_receiver_blocks_outside_the_transfer_are_untouched(e16, e32):
    ids = _prompt(17, e16.model_config.vocab_size)
    with _reserved(e32, 64) as bystander:
        before = _gather_all(e32, bystander, 64)
        _transfer(e16, e32, ids, (0, 17))
        _assert_kv_equal(_gather_all(e32, bystander, 64), before)


# ---- gather/scatter on small synthetic caches ------------------------------------------------
def _cache(num_slots: int, heads: int, dim: int = 2, dtype=torch.float32):
    return torch.zeros(num_slots, heads, dim, dtype=dtype), torch.zeros(num_slots, heads, dim, dtype=dtype)


def _frame(t0: int, t1: int, h0: int, h1: int, n_heads: int = 3, dim: int = 2):
    k = torch.arange((t1 - t0) * (h1 - h0) * dim, dtype=torch.float32).view(t1 - t0, h1 - h0, dim) + 1
    return decode_frames(encode_frames("tx", "fp", 0, t0, k, -k, n_heads, head_start=h0))


def test_gather_maps_positions_through_the_block_table():
    k = torch.arange(4 * 4, dtype=torch.float32).view(16, 1, 1).expand(16, 3, 2).contiguous()
    got_k, got_v = gather_layer((k, -k), [2, 0, 3], 4, 3, 9, head_start=1)
    # positions 3..8 -> slots 2*4+3, then block 0 (slots 0..3), then block 3 (slot 12)
    assert got_k[:, 0, 0].tolist() == [11, 0, 1, 2, 3, 12]
    assert got_k.shape == (6, 2, 2) and got_k.is_contiguous() and torch.equal(got_v, -got_k)


@pytest.mark.parametrize("t0, t1, h0, h1", [(0, 9, 0, 1), (-1, 3, 0, 1), (3, 3, 0, 1), (0, 3, 2, 4), (0, 3, 1, 1)])
def test_gather_rejects_bad_ranges(t0, t1, h0, h1):
    with pytest.raises(ValueError):
        gather_layer(_cache(16, 3), [0, 1], 4, t0, t1, h0, h1)


def test_shard_receiver_takes_its_part_of_a_full_frame():
    header, k, v = _frame(0, 5, 0, 3)
    cache = _cache(8, 2)  # holds model heads [1, 3)
    scatter_layer(cache, [1, 0], 4, header, k, v, local_head_start=1)
    got_k, got_v = gather_layer(cache, [1, 0], 4, 0, 5)
    assert torch.equal(got_k, k[:, 1:3]) and torch.equal(got_v, v[:, 1:3])


def test_partially_overlapping_shard_writes_only_the_overlap():
    header, k, v = _frame(0, 4, 0, 2)
    cache = _cache(4, 2)  # model heads [1, 3): only head 1 is in the frame
    scatter_layer(cache, [0], 4, header, k, v, local_head_start=1)
    assert torch.equal(cache[0][:, 0], k[:, 1]) and not cache[0][:, 1].any()


def test_scatter_converts_to_cache_dtype():
    header, k, v = _frame(2, 6, 0, 3)
    cache = _cache(8, 3, dtype=torch.float16)
    scatter_layer(cache, [1, 0], 4, header, k, v)
    got_k, _ = gather_layer(cache, [1, 0], 4, 2, 6)
    assert got_k.dtype == torch.float16 and torch.equal(got_k, k.half())


@pytest.mark.parametrize("blocks, heads, local_start, dim, match", [
    ([0], 3, 0, 2, "exceeds the 1 reserved blocks"),  # tokens 0..5 need 2 blocks of 4
    ([0, 1], 1, 3, 2, "fall outside local heads"),
    ([0, 1], 3, 0, 4, "head_dim"),
])
def test_scatter_rejects_frames_that_do_not_fit(blocks, heads, local_start, dim, match):
    header, k, v = _frame(0, 5, 0, 3)
    cache = _cache(8, heads, dim)
    with pytest.raises(FrameError, match=match):
        scatter_layer(cache, blocks, 4, header, k, v, local_head_start=local_start)
    assert not cache[0].any() and not cache[1].any()  # nothing written


def test_scatter_rejects_tensors_that_disagree_with_the_header():
    header, k, v = _frame(0, 4, 0, 3)
    with pytest.raises(FrameError, match="disagree"):
        scatter_layer(_cache(8, 3), [0, 1], 4, header, k[:3], v[:3])
