"""Q4_K and Q6_K dequantized by engine/models/gguf_codes.py with torch equal gguf-py's (and so
HF's) values bit for bit: on random blocks (every code, scale and sign) and on the real files'
tensors of both types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.models import gguf, gguf_codes
from tests.pulled import gguf_file

SIZES = {"Q4_K": 144, "Q6_K": 210}


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.int32),
                                                 np.ascontiguousarray(b).view(np.int32))


def _random_blocks(kind: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes, with each block's fp16 scales made finite (random bits would include NaNs,
    whose payloads the two libraries need not keep alike)."""
    gen = np.random.default_rng(seed)
    b = gen.integers(0, 256, (rows * blocks_per_row, SIZES[kind]), dtype=np.uint8)
    scales = gen.standard_normal((rows * blocks_per_row, 2)).astype(np.float16) * np.float16(0.01)
    if kind == "Q4_K":  # d, dmin first
        b[:, :4] = scales.view(np.uint8)
    else:  # d last
        b[:, 208:210] = scales[:, :1].view(np.uint8)
    return b.reshape(rows, blocks_per_row * SIZES[kind])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_random_blocks_bit_for_bit(kind):
    qtype = GGMLQuantizationType[kind]
    for seed, (rows, per_row) in enumerate([(1, 1), (7, 6), (300, 35)]):
        data = _random_blocks(kind, rows, per_row, seed)
        ours = gguf_codes._dequantize(data, qtype)
        assert ours.dtype == np.float32 and _bits_equal(ours, dequantize(data, qtype)), (kind, rows, per_row)


def test_real_tensors_bit_for_bit():
    """Every Q4_K and Q6_K tensor of the three catalogue files (their first 512 rows: the arithmetic
    is per block, and rows are blocks), through the function the loader calls."""
    seen = set()
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        for t in gguf.open_reader(gguf_file(name)).tensors:
            kind = t.tensor_type.name
            if kind not in SIZES or t.data.ndim != 2:
                continue
            seen.add(kind)
            got = gguf_codes.dequantized(t, slice(0, 512))
            want = dequantize(t.data[:512], t.tensor_type)
            assert _bits_equal(got.numpy(), want), (name, t.name)
    assert seen == set(SIZES)


def test_chunks_of_rows_join_into_the_whole():
    """A tensor longer than CHUNK_ROWS is dequantized a chunk at a time into one array."""
    class T:  # a ReaderTensor's two attributes dequantized() reads
        tensor_type = GGMLQuantizationType.Q6_K
        data = _random_blocks("Q6_K", gguf_codes.CHUNK_ROWS + 5, 1, 9)
    got = gguf_codes.dequantized(T)
    assert isinstance(got, torch.Tensor) and _bits_equal(got.numpy(), dequantize(T.data, T.tensor_type))
