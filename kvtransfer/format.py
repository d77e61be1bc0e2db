"""KV-cache wire format: one message per (layer, token range, head range) of one transfer.

A message is three frames (see FORMAT.md for the full specification)::

    [header (msgpack array), K bytes, V bytes]

K and V are token-major ``[T, H, D]`` row-major arrays in native (little-endian) byte order,
so the payload does not depend on either side's block size: the sender gathers its paged
blocks into contiguous tensors (:func:`gather_layer`), the receiver scatters them into its own
blocks (:func:`scatter_layer`), converting dtype and selecting heads as needed.

Decoding never trusts the header: every field is type- and range-checked, sizes are compared
with the received buffers before anything is allocated, and the payload checksum is verified
(except for payloads in GPU memory marked "not checksummed", checksum 0: see FORMAT.md).
Anything wrong raises :class:`FrameError`; what happens to the transfer then (it is marked
FAILED) is the lifecycle's job, not this module's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields

import msgpack
import torch
import xxhash

FORMAT_VERSION: int = 1
MAX_FRAME_TOKENS: int = 1 << 20  # sanity cap on token_end - token_start
MAX_HEADER_BYTES = 1024  # a real header is ~100 bytes; refuse to even unpack more
_MAX_HEADS = 1 << 12
_MAX_HEAD_DIM = 1 << 12
_MAX_LAYERS = 1 << 16
_MAX_POSITION = 1 << 40  # token positions; far beyond any context length
_MAX_ID_CHARS = 256

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
_ELEM_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class FrameError(ValueError):
    """A malformed, mismatched or corrupt frame (or arguments that would make one)."""


@dataclass(frozen=True)
class FrameHeader:
    """Metadata of one KV message; validated when built, so every instance is well-formed.

    Attributes:
        version: wire format version (``FORMAT_VERSION``).
        transfer_id: the transfer this frame belongs to.
        fingerprint: ``ModelConfig.fingerprint()`` of the sender's model.
        layer: decoder layer index.
        token_start, token_end: sequence positions [start, end) carried (at least one token).
        dtype: payload dtype name: "float32", "bfloat16" or "float16".
        num_kv_heads: KV heads of the whole model.
        head_start, head_end: the heads [start, end) carried by this frame.
        head_dim: elements per head.
        checksum: ``xxhash.xxh3_64`` over the K bytes then the V bytes (uint64); 0 for
            payloads sent from GPU memory: "not checksummed" (accepted only for device payloads).
    """

    version: int
    transfer_id: str
    fingerprint: str
    layer: int
    token_start: int
    token_end: int
    dtype: str
    num_kv_heads: int
    head_start: int
    head_end: int
    head_dim: int
    checksum: int

    def __post_init__(self) -> None:
        for f in fields(self):
            val = getattr(self, f.name)
            want = str if f.type == "str" else int
            if type(val) is not want:  # exact: bool is not an int here, str subclasses are refused
                raise FrameError(f"header field {f.name!r} must be {want.__name__}, got {type(val).__name__}")
        if self.version != FORMAT_VERSION:
            raise FrameError(f"unknown KV frame format version {self.version} (this side speaks {FORMAT_VERSION})")
        for name in ("transfer_id", "fingerprint"):
            if not 0 < len(getattr(self, name)) <= _MAX_ID_CHARS:
                raise FrameError(f"header field {name!r} must have 1..{_MAX_ID_CHARS} characters")
        if self.dtype not in DTYPES:
            raise FrameError(f"unknown payload dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if not 0 <= self.layer < _MAX_LAYERS:
            raise FrameError(f"layer {self.layer} out of range [0, {_MAX_LAYERS})")
        if not 0 <= self.token_start < self.token_end <= _MAX_POSITION:
            raise FrameError(f"bad token range [{self.token_start}, {self.token_end}): need 0 <= start < end")
        if self.token_end - self.token_start > MAX_FRAME_TOKENS:
            raise FrameError(f"frame claims {self.token_end - self.token_start} tokens, "
                             f"more than MAX_FRAME_TOKENS={MAX_FRAME_TOKENS}")
        if not 0 < self.num_kv_heads <= _MAX_HEADS:
            raise FrameError(f"num_kv_heads {self.num_kv_heads} out of range [1, {_MAX_HEADS}]")
        if not 0 <= self.head_start < self.head_end <= self.num_kv_heads:
            raise FrameError(f"bad head range [{self.head_start}, {self.head_end}) "
                             f"for {self.num_kv_heads} KV heads")
        if not 0 < self.head_dim <= _MAX_HEAD_DIM:
            raise FrameError(f"head_dim {self.head_dim} out of range [1, {_MAX_HEAD_DIM}]")
        if not 0 <= self.checksum < 1 << 64:
            raise FrameError(f"checksum {self.checksum} is not a uint64")

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def num_heads(self) -> int:
        """Heads carried by this frame."""
        return self.head_end - self.head_start

    @property
    def shape(self) -> tuple[int, int, int]:
        """Shape [T, H, D] of each of K and V."""
        return self.num_tokens, self.num_heads, self.head_dim

    @property
    def payload_nbytes(self) -> int:
        """Bytes of ONE of K or V: tokens * heads * head_dim * element size."""
        return self.num_tokens * self.num_heads * self.head_dim * _ELEM_SIZE[self.dtype]

    def encode(self) -> bytes:
        """The header frame: a msgpack array of the fields in declaration order."""
        return msgpack.packb([getattr(self, f.name) for f in fields(self)], use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> FrameHeader:
        """Parse and validate a header frame; never allocates based on claimed sizes.

        Args:
            data: the header frame's bytes.
        Returns:
            The validated header.
        Raises:
            FrameError: garbage, wrong types, unknown version, bad or absurd ranges.
        """
        try:
            raw = memoryview(data)
        except TypeError as e:
            raise FrameError(f"header frame is not a buffer: {type(data).__name__}") from e
        if raw.nbytes > MAX_HEADER_BYTES:
            raise FrameError(f"header frame has {raw.nbytes} bytes, more than {MAX_HEADER_BYTES}")
        try:
            obj = msgpack.unpackb(raw.cast("B") if raw.ndim != 1 or raw.format != "B" else raw,
                                  raw=False, strict_map_key=True, use_list=True,
                                  max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
                                  max_array_len=64, max_map_len=64, max_ext_len=MAX_HEADER_BYTES)
        except Exception as e:  # msgpack raises several types (ValueError, TypeError, ExtraData...)
            raise FrameError(f"header frame is not valid msgpack: {e}") from e
        if not isinstance(obj, list):
            raise FrameError(f"header must be a msgpack array, got {type(obj).__name__}")
        # Check the version first, so a newer peer gets "unknown version", not "wrong length".
        if not obj or type(obj[0]) is not int or obj[0] != FORMAT_VERSION:
            version = obj[0] if obj else None
            raise FrameError(f"unknown KV frame format version {version!r} (this side speaks {FORMAT_VERSION})")
        n = len(fields(cls))
        if len(obj) != n:
            raise FrameError(f"header has {len(obj)} fields, version {FORMAT_VERSION} has {n}")
        return cls(*obj)


def peek_transfer_id(data: object) -> str | None:
    """Best effort, for a header that does not decode: its ``transfer_id`` field, if the
    msgpack array unpacks that far and it is a str (the receiver then knows whom to blame).

    Returns:
        The id, or None (not a buffer, too big, not an array, or cut before the field).
    """
    try:
        raw = bytes(memoryview(data).cast("B"))
        if len(raw) > MAX_HEADER_BYTES:
            return None
        # an id has at most _MAX_ID_CHARS characters of up to 4 UTF-8 bytes each
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_HEADER_BYTES, max_str_len=_MAX_ID_CHARS * 4)
        unpacker.feed(raw)
        if unpacker.read_array_header() < 2:
            return None
        unpacker.skip()  # version
        tid = unpacker.unpack()
    except Exception:  # msgpack raises several types for garbage; any of them: no id
        return None
    return tid if isinstance(tid, str) and 0 < len(tid) <= _MAX_ID_CHARS else None


def _as_bytes_view(buf: object, what: str) -> memoryview:
    """A flat unsigned-byte view of any buffer (bytes, bytearray, memoryview, zmq frame...)."""
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise FrameError(f"{what} frame is not a buffer: {type(buf).__name__}") from e
    if not mv.contiguous:
        raise FrameError(f"{what} frame buffer is not contiguous")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy flat byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    # Reinterpreting as uint8 avoids numpy's lack of bfloat16; the numpy array keeps t alive.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _checksum(k: memoryview | torch.Tensor, v: memoryview | torch.Tensor) -> int:
    h = xxhash.xxh3_64()
    for b in (k, v):
        h.update(_tensor_bytes(b.cpu()) if isinstance(b, torch.Tensor) else b)  # device: host copy
    return h.intdigest()


def _is_device_frame(buf: object) -> bool:
    return isinstance(buf, torch.Tensor) and buf.device.type != "cpu"


def _device_bytes(t: object, what: str) -> torch.Tensor:
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise FrameError(f"{what} device frame must be a contiguous 1-D uint8 tensor, "
                         f"got {t.dtype} of shape {tuple(t.shape)}")
    return t


def _device_view(t: torch.Tensor, header: FrameHeader) -> torch.Tensor:
    dtype = DTYPES[header.dtype]
    if t.storage_offset() % dtype.itemsize:
        t = t.clone()  # misaligned: reinterpreting would fail
    return t.view(dtype).view(header.shape)


def encode_frames(transfer_id: str, fingerprint: str, layer: int, token_start: int,
                  k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
                  head_start: int = 0,
                  keep_on_device: bool = False) -> list[bytes | memoryview | torch.Tensor]:
    """Build the message ``[header, K bytes, V bytes]`` for one layer's token range.

    Args:
        transfer_id: the transfer this frame belongs to.
        fingerprint: the sender model's ``ModelConfig.fingerprint()``.
        layer: layer index.
        token_start: sequence position of the first token in ``k``/``v``.
        k, v: ``[T, H_carried, D]`` token-major tensors (e.g. from :func:`gather_layer`).
            CPU contiguous tensors are sent zero-copy, so they must stay unchanged until
            the transport has sent them; others are copied first.
        num_kv_heads: KV heads of the whole model.
        head_start: model head index of ``k[:, 0]``.
        keep_on_device: for K/V on a GPU, send them from there (a transport with
            ``device_frames``): the payload frames are contiguous uint8 CUDA tensors (no host
            copy) and the checksum is 0, "not checksummed". Otherwise (default) everything is
            on the host and checksummed, as before.
    Returns:
        Three buffers: header bytes, then K's and V's bytes as memoryviews (host) or flat
        uint8 tensors (device).
    Raises:
        FrameError: shapes, dtypes or ranges that make no valid frame.
    """
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype:
        raise FrameError(f"k and v must be [T, H, D] of equal shape and dtype, "
                         f"got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
    if k.dtype not in _DTYPE_NAMES:
        raise FrameError(f"unsupported KV dtype {k.dtype}; valid: {', '.join(DTYPES)}")
    on_device = keep_on_device and k.device.type != "cpu"
    if on_device:  # hashing device memory would need the host copy we avoid: checksum 0
        k, v = k.detach().contiguous(), v.detach().to(k.device).contiguous()
        kb, vb = k.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
    else:
        k, v = (t.detach().cpu().contiguous() for t in (k, v))
        kb, vb = _tensor_bytes(k), _tensor_bytes(v)
    t, h, d = k.shape
    header = FrameHeader(FORMAT_VERSION, transfer_id, fingerprint, layer, token_start,
                         token_start + t, _DTYPE_NAMES[k.dtype], num_kv_heads, head_start,
                         head_start + h, d, 0 if on_device else _checksum(kb, vb))
    return [header.encode(), kb, vb]


def _frombuffer(mv: memoryview, header: FrameHeader) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only buffers (bytes) are fine: the tensors are only read, never written.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(mv, dtype=DTYPES[header.dtype])
    if t.data_ptr() % t.element_size():
        t = t.clone()  # misaligned receive buffer: copy rather than risk unaligned vector loads
    return t.view(header.shape)


def decode_frames(frames: Sequence[bytes | memoryview],
                  fingerprint: str | None = None) -> tuple[FrameHeader, torch.Tensor, torch.Tensor]:
    """Validate one received message and view its K and V as tensors.

    Args:
        frames: the message: exactly ``[header, K bytes, V bytes]``; K and V may be host
            buffers or flat uint8 GPU tensors (e.g. from a UCX device receive).
        fingerprint: this side's model fingerprint; the header must match it when given.
    Returns:
        (header, K, V) with K, V ``[T, H, D]`` of ``header.dtype``: zero-copy views of the
        received buffers where possible, on the device the payload is on (treat them as
        read-only).
    Raises:
        FrameError: wrong frame count, bad header, fingerprint mismatch, payload length
            mismatch, or checksum mismatch (checksum 0 is accepted unchecked only when both
            K and V are in GPU memory).
    """
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise FrameError(f"a KV message is a list of 3 frames, got {type(frames).__name__}")
    if len(frames) != 3:
        raise FrameError(f"a KV message has 3 frames [header, K, V], got {len(frames)}")
    header = FrameHeader.decode(frames[0])
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise FrameError(f"model fingerprint mismatch: frame {header.fingerprint!r}, "
                         f"this side {fingerprint!r} (different model or architecture)")
    kb, vb = (_device_bytes(f, name) if _is_device_frame(f) else _as_bytes_view(f, name)
              for f, name in ((frames[1], "K"), (frames[2], "V")))
    want = header.payload_nbytes
    for name, b in (("K", kb), ("V", vb)):
        n = b.numel() if isinstance(b, torch.Tensor) else b.nbytes
        if n != want:
            raise FrameError(f"{name} payload has {n} bytes, header says "
                             f"{header.shape} {header.dtype} = {want}")
    on_device = isinstance(kb, torch.Tensor) and isinstance(vb, torch.Tensor)
    if not (on_device and header.checksum == 0):  # 0 on device: "not checksummed" (FORMAT.md)
        got = _checksum(kb, vb)
        if got != header.checksum:
            why = (" (0 means 'not checksummed', allowed only for payloads in GPU memory)"
                   if header.checksum == 0 else "")
            raise FrameError(f"payload checksum mismatch (got {got:#018x}, header {header.checksum:#018x})"
                             f"{why}: corrupt KV frame for layer {header.layer}")
    return header, *(_device_view(b, header) if isinstance(b, torch.Tensor) else _frombuffer(b, header)
                     for b in (kb, vb))


def _slots(block_ids: Sequence[int], block_size: int, token_start: int, token_end: int,
           device: torch.device) -> torch.Tensor:
    """Flat cache slots of positions [token_start, token_end): block_ids[p // bs] * bs + p % bs."""
    table = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    pos = torch.arange(token_start, token_end, dtype=torch.long, device=device)
    return table[pos // block_size] * block_size + pos % block_size


def _check_tokens(block_ids: Sequence[int], block_size: int, token_start: int, token_end: int,
                  err: type[ValueError]) -> None:
    if not 0 <= token_start < token_end:
        raise err(f"bad token range [{token_start}, {token_end})")
    if token_end > len(block_ids) * block_size:
        raise err(f"token range [{token_start}, {token_end}) exceeds the {len(block_ids)} reserved "
                  f"blocks of {block_size} tokens ({len(block_ids) * block_size} tokens)")


def gather_layer(kv: tuple[torch.Tensor, torch.Tensor], block_ids: Sequence[int], block_size: int,
                 token_start: int, token_end: int, head_start: int = 0,
                 head_end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy a token range and head range of one sequence out of a paged layer cache.

    Args:
        kv: the layer's (K, V), each ``[num_blocks * block_size, H_local, D]``.
        block_ids: the sequence's blocks, in order.
        block_size: tokens per block of this cache.
        token_start, token_end: positions [start, end) to copy.
        head_start, head_end: local head indices [start, end) to copy (default: all).
    Returns:
        Contiguous ``[T, H, D]`` K and V (one index_select each).
    Raises:
        ValueError: empty or out-of-range token or head range.
    """
    k_cache, v_cache = kv
    h_local = k_cache.shape[1]
    head_end = h_local if head_end is None else head_end
    if not 0 <= head_start < head_end <= h_local:
        raise ValueError(f"bad head range [{head_start}, {head_end}) for a cache of {h_local} heads")
    _check_tokens(block_ids, block_size, token_start, token_end, ValueError)
    slots = _slots(block_ids, block_size, token_start, token_end, k_cache.device)
    # Slicing heads first is a view; index_select then writes one contiguous copy.
    return (k_cache[:, head_start:head_end].index_select(0, slots),
            v_cache[:, head_start:head_end].index_select(0, slots))


def scatter_layer(kv: tuple[torch.Tensor, torch.Tensor], block_ids: Sequence[int], block_size: int,
                  header: FrameHeader, k: torch.Tensor, v: torch.Tensor,
                  local_head_start: int = 0) -> None:
    """Write a decoded frame into this side's paged layer cache, at this side's block layout.

    Positions map to slots through THIS side's ``block_ids``/``block_size``. The cache holds
    model heads [local_head_start, local_head_start + H_local); the frame's heads
    [head_start, head_end) are written where the two ranges overlap. So a receiver with all
    heads assembles shards from several senders, and a receiver holding a shard takes its part
    of a wider frame. Dtype and device are converted to the cache's (no copy through the host
    when the frame and the cache are on the same GPU).

    Args:
        kv: the layer's (K, V), each ``[num_blocks * block_size, H_local, D]``.
        block_ids: blocks this side reserved for the sequence, in order.
        block_size: tokens per block of this cache.
        header: the frame's header (from :func:`decode_frames`).
        k, v: the frame's ``[T, H, D]`` tensors.
        local_head_start: model head index of the cache's head 0.
    Raises:
        FrameError: tokens beyond the reserved blocks, no head in common with the local
            cache, or shapes that disagree with the header or the cache.
    """
    k_cache, v_cache = kv
    h_local, d_local = k_cache.shape[1], k_cache.shape[2]
    if header.head_dim != d_local:
        raise FrameError(f"frame head_dim {header.head_dim} != local cache head_dim {d_local}")
    if tuple(k.shape) != header.shape or tuple(v.shape) != header.shape:
        raise FrameError(f"K/V shapes {tuple(k.shape)}, {tuple(v.shape)} disagree with header {header.shape}")
    lo = max(header.head_start, local_head_start)
    hi = min(header.head_end, local_head_start + h_local)
    if lo >= hi:
        raise FrameError(f"frame heads [{header.head_start}, {header.head_end}) fall outside local heads "
                         f"[{local_head_start}, {local_head_start + h_local})")
    _check_tokens(block_ids, block_size, header.token_start, header.token_end, FrameError)
    slots = _slots(block_ids, block_size, header.token_start, header.token_end, k_cache.device)
    src = slice(lo - header.head_start, hi - header.head_start)
    dst = slice(lo - local_head_start, hi - local_head_start)
    for cache, t in ((k_cache, k), (v_cache, v)):
        part = t[:, src].to(device=cache.device, dtype=cache.dtype)
        target = cache if (dst.start, dst.stop) == (0, h_local) else cache[:, dst]
        target.index_copy_(0, slots, part)  # in place: a head slice is a view of the cache
