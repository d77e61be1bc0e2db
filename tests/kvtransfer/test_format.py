"""Wire format: header round trip, rejection of every kind of bad frame, zero-copy payloads."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.format import (FORMAT_VERSION, MAX_FRAME_TOKENS, FrameError, FrameHeader,
                               decode_frames, encode_frames, peek_transfer_id)

FIELDS = [f.name for f in dataclasses.fields(FrameHeader)]
FP = "0123456789abcdef"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _header(**changes) -> FrameHeader:
    base = dict(version=FORMAT_VERSION, transfer_id="tx-1", fingerprint=FP, layer=4, token_start=16,
                token_end=33, dtype="bfloat16", num_kv_heads=3, head_start=1, head_end=3, head_dim=64,
                checksum=2**64 - 1)
    return FrameHeader(**{**base, **changes})


def _packed(**changes) -> bytes:
    """A header frame with fields replaced by anything, bypassing FrameHeader's own checks."""
    fields = msgpack.unpackb(_header().encode())
    for name, val in changes.items():
        fields[FIELDS.index(name)] = val
    return msgpack.packb(fields, use_bin_type=True)


def _kv(t: int = 5, h: int = 2, d: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, d, generator=g).to(dtype), torch.randn(t, h, d, generator=g).to(dtype))


def _frames(**kw) -> list:
    k, v = _kv(**kw)
    return [bytes(f) for f in encode_frames("tx-1", FP, 2, 7, k, v, num_kv_heads=3, head_start=1)]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


# ---- header ----------------------------------------------------------------------------------
def test_header_round_trip():
    h = _header()
    data = h.encode()
    assert isinstance(data, bytes) and len(data) < 128
    assert FrameHeader.decode(data) == h
    assert FrameHeader.decode(memoryview(data)) == h and FrameHeader.decode(bytearray(data)) == h
    assert h.payload_nbytes == 17 * 2 * 64 * 2
    assert _header(dtype="float32").payload_nbytes == 17 * 2 * 64 * 4


def test_header_is_msgpack_array_in_documented_order():
    assert msgpack.unpackb(_header().encode()) == [
        1, "tx-1", FP, 4, 16, 33, "bfloat16", 3, 1, 3, 64, 2**64 - 1]


@pytest.mark.parametrize("changes, match", [
    (dict(version=2), "unknown KV frame format version 2"),
    (dict(version=0), "unknown KV frame format version 0"),
    (dict(version="1"), "unknown KV frame format version"),
    (dict(layer="4"), "'layer' must be int"),
    (dict(token_start=16.0), "'token_start' must be int"),
    (dict(head_dim=True), "'head_dim' must be int"),
    (dict(checksum=None), "'checksum' must be int"),
    (dict(transfer_id=b"tx-1"), "'transfer_id' must be str"),
    (dict(fingerprint=7), "'fingerprint' must be str"),
    (dict(dtype="int8"), "unknown payload dtype"),
    (dict(transfer_id=""), "1..256 characters"),
    (dict(layer=-1), "layer -1 out of range"),
    (dict(token_start=-3), "bad token range"),
    (dict(token_start=40, token_end=33), "bad token range"),
    (dict(token_start=33, token_end=33), "bad token range"),
    (dict(token_start=0, token_end=2**40), "more than MAX_FRAME_TOKENS"),
    (dict(head_start=-1), "bad head range"),
    (dict(head_start=2, head_end=1), "bad head range"),
    (dict(head_end=4), "bad head range"),
    (dict(num_kv_heads=0), "num_kv_heads 0 out of range"),
    (dict(head_dim=0), "head_dim 0 out of range"),
    (dict(checksum=-1), "not a uint64"),
])
def test_bad_header_fields_rejected(changes, match):
    with pytest.raises(FrameError, match=match):
        FrameHeader.decode(_packed(**changes))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x00" * 10, b"garbage not msgpack \xff\xfe",
    msgpack.packb({"version": 1}), msgpack.packb(1), msgpack.packb("header"), msgpack.packb([]),
    msgpack.packb([1, "tx"]),  # right version, too few fields
    msgpack.packb(msgpack.unpackb(_header().encode()) + [0]),  # one field too many
    _header().encode() + b"\x00",  # trailing bytes
    msgpack.packb([1] + ["x" * 2000] * 11),  # over the header size limit
    msgpack.packb(msgpack.ExtType(1, b"\x00" * 16)),
])
def test_garbage_header_bytes_rejected(data):
    with pytest.raises(FrameError):
        FrameHeader.decode(data)


def test_truncated_header_rejected_at_every_length():
    data = _header().encode()
    for n in range(len(data)):
        with pytest.raises(FrameError):
            FrameHeader.decode(data[:n])


def test_a_header_that_does_not_decode_still_names_its_transfer_as_far_as_it_unpacks():
    data = _header().encode()
    id_end = len(msgpack.packb([FORMAT_VERSION, "tx-1"]))  # array marker, version, id (fixarray either way)
    for n in range(len(data) + 1):
        assert peek_transfer_id(data[:n]) == ("tx-1" if n >= id_end else None), n
    assert peek_transfer_id(_packed(transfer_id=7)) is None  # not a str: nobody to blame
    assert peek_transfer_id(msgpack.packb({"id": "tx-1"})) is None  # not an array
    assert peek_transfer_id(None) is None and peek_transfer_id(b"\x9c" + b"\xff" * 2000) is None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_peeking_at_random_bytes_never_raises(data):
    assert peek_transfer_id(data) is None or isinstance(peek_transfer_id(data), str)


def test_non_buffer_header_rejected():
    with pytest.raises(FrameError):
        FrameHeader.decode(None)  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_random_header_bytes_raise_only_frame_error(data):
    try:
        FrameHeader.decode(data)
    except FrameError:
        pass


_LEAF = st.one_of(st.integers(min_value=-2**63, max_value=2**64 - 1), st.text(max_size=20),
                  st.binary(max_size=20), st.booleans(), st.none(), st.floats())


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), _LEAF, min_size=1, max_size=4))
def test_mutated_header_fields_raise_only_frame_error(changes):
    # Structured input gets past msgpack, so this exercises the field checks themselves.
    try:
        h = FrameHeader.decode(_packed(**changes))
    except FrameError:
        return
    assert 0 < h.payload_nbytes and h.num_tokens <= MAX_FRAME_TOKENS and h.head_end <= h.num_kv_heads


# ---- frames ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_decode_is_bitwise_exact(dtype):
    k, v = _kv(t=17, h=2, d=64, dtype=dtype, seed=1)
    k[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")]).to(dtype)
    frames = encode_frames("tx-9", FP, 29, 100, k, v, num_kv_heads=3, head_start=1)
    assert len(frames) == 3
    header, k2, v2 = decode_frames([bytes(f) for f in frames], fingerprint=FP)
    assert (header.layer, header.token_start, header.token_end) == (29, 100, 117)
    assert (header.head_start, header.head_end, header.num_kv_heads) == (1, 3, 3)
    assert header.dtype == str(dtype).removeprefix("torch.")
    assert k2.shape == v2.shape == (17, 2, 64)
    assert _bitwise_equal(k, k2) and _bitwise_equal(v, v2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_is_zero_copy(dtype):
    k, v = _kv(dtype=dtype)
    _, kb, vb = encode_frames("tx", FP, 0, 0, k, v, num_kv_heads=2)
    assert kb.nbytes == k.numel() * k.element_size()
    assert torch.frombuffer(kb, dtype=torch.uint8).data_ptr() == k.data_ptr()
    assert torch.frombuffer(vb, dtype=torch.uint8).data_ptr() == v.data_ptr()
    k.zero_()  # the buffer is the tensor's memory: the change shows through
    assert not any(kb)


def test_decode_is_zero_copy_and_accepts_any_buffer():
    frames = _frames()
    k_buf, v_buf = bytearray(frames[1]), bytearray(frames[2])
    _, k, v = decode_frames([frames[0], k_buf, memoryview(v_buf)])
    assert k.data_ptr() == torch.frombuffer(k_buf, dtype=torch.uint8).data_ptr()
    assert v.data_ptr() == torch.frombuffer(v_buf, dtype=torch.uint8).data_ptr()


def test_misaligned_receive_buffer_still_decodes():
    k, v = _kv()
    frames = encode_frames("tx", FP, 0, 0, k, v, num_kv_heads=2)
    shifted = [memoryview(bytearray(b"\x00") + bytes(f))[1:] for f in frames[1:]]  # odd address
    _, k2, v2 = decode_frames([frames[0], *shifted])
    assert k2.data_ptr() % 4 == 0 and torch.equal(k2, k) and torch.equal(v2, v)


def test_non_contiguous_input_is_copied_correctly():
    k, v = _kv(t=6, h=3, d=4)
    ks, vs = k[:, 1:], v[:, 1:]  # a head slice: not contiguous
    _, k2, v2 = decode_frames(encode_frames("tx", FP, 0, 0, ks, vs, num_kv_heads=3, head_start=1))
    assert torch.equal(k2, ks) and torch.equal(v2, vs)


@pytest.mark.parametrize("k, v, match", [
    (torch.zeros(2, 2, 4), torch.zeros(2, 2, 5), "equal shape"),
    (torch.zeros(2, 2, 4), torch.zeros(2, 2, 4, dtype=torch.float16), "equal shape and dtype"),
    (torch.zeros(2, 8), torch.zeros(2, 8), "must be \\[T, H, D\\]"),
    (torch.zeros(2, 2, 4, dtype=torch.int8), torch.zeros(2, 2, 4, dtype=torch.int8), "unsupported KV dtype"),
    (torch.zeros(0, 2, 4), torch.zeros(0, 2, 4), "bad token range"),
    (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), "bad head range"),  # heads 1..4 of 3
])
def test_encode_rejects_bad_tensors(k, v, match):
    with pytest.raises(FrameError, match=match):
        encode_frames("tx", FP, 0, 0, k, v, num_kv_heads=3, head_start=1 if k.shape[-2:] == (3, 4) else 0)


def test_wrong_fingerprint_rejected():
    with pytest.raises(FrameError, match="fingerprint mismatch"):
        decode_frames(_frames(), fingerprint="ffffffffffffffff")
    decode_frames(_frames(), fingerprint=None)  # no check asked for


@pytest.mark.parametrize("n", [0, 1, 2, 4])
def test_wrong_number_of_frames_rejected(n):
    frames = _frames()
    frames = (frames + frames)[:n]
    with pytest.raises(FrameError, match=f"got {n}"):
        decode_frames(frames)


@pytest.mark.parametrize("frames", [None, b"abc", "abc", 3])
def test_message_that_is_not_a_list_rejected(frames):
    with pytest.raises(FrameError):
        decode_frames(frames)  # type: ignore[arg-type]


@pytest.mark.parametrize("which, edit", [
    (1, lambda b: b[:-1]), (1, lambda b: b + b"\x00"), (2, lambda b: b[:-4]), (2, lambda b: b""),
    (1, lambda b: b + b), (2, lambda b: None),
])
def test_payload_length_mismatch_rejected(which, edit):
    frames = _frames()
    frames[which] = edit(frames[which])
    with pytest.raises(FrameError, match="payload has|not a buffer"):
        decode_frames(frames)


@pytest.mark.parametrize("which", [1, 2])
@pytest.mark.parametrize("pos", [0, 37, -1])
def test_corrupted_payload_byte_rejected(which, pos):
    frames = _frames(dtype=torch.bfloat16)
    buf = bytearray(frames[which])
    buf[pos] ^= 0x01  # a single flipped bit
    frames[which] = bytes(buf)
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_frames(frames)


def test_swapped_k_and_v_rejected():
    frames = _frames()
    with pytest.raises(FrameError, match="checksum mismatch"):
        decode_frames([frames[0], frames[2], frames[1]])


@pytest.mark.parametrize("changes", [
    dict(token_start=0, token_end=2**40),  # absurd token count
    dict(token_start=0, token_end=MAX_FRAME_TOKENS, num_kv_heads=4096, head_start=0,
         head_end=4096, head_dim=4096, dtype="float32"),  # in range, but claims 2**46 bytes
])
def test_huge_claimed_size_fails_fast_without_allocating(changes, monkeypatch):
    frames = [_packed(**changes), b"\x00" * 64, b"\x00" * 64]

    def no_allocation(*a, **k):
        raise AssertionError("the decoder allocated a tensor for an unchecked claim")
    for name in ("empty", "zeros", "frombuffer", "from_numpy"):  # what could make room for 2**46 bytes
        monkeypatch.setattr(torch, name, no_allocation)
    with pytest.raises(FrameError, match="token|payload has 64 bytes"):
        decode_frames(frames)
