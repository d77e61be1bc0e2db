"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

The block manager only edits block-id lists; the KV tensors themselves live in the runner
(``allocate_kv_tensors``). A block is in exactly one of three places:

- free: ``ref_count == 0`` and no hash, in ``_free`` (FIFO);
- cached: ``ref_count == 0`` but holding a full block of known tokens (hash set), in ``_evictable``
  (LRU order); a new request with the same prefix takes it back, allocation evicts it last;
- used: ``ref_count > 0``, referenced by that many requests (shared prefix blocks have > 1).

Prefix hashes chain: a block's hash covers its tokens and its parent's hash, so equal hashes
mean equal whole prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch


class BlockManager:
    """Allocates and frees KV blocks; prefix-caches full blocks by hash chain."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[bytes, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def hash_block(parent_hash: bytes | None, tokens: Sequence[int]) -> bytes:
        """128-bit BLAKE2b over the parent's digest and the block's token ids.

        A cryptographic digest, not Python's 64-bit ``hash()``: a hit is trusted without
        comparing tokens, so a crafted collision must not let one request read another's KV.
        """
        h = hashlib.blake2b(parent_hash or b"", digest_size=16)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` covering at most ``max_tokens``.

        Takes no references: pass the result to :meth:`allocate` in the same scheduling step.
        """
        hits = self.lookup(token_ids, max_tokens)
        if self.enable_prefix_caching:
            self.prefix_queries += max_tokens
            self.prefix_hits += len(hits) * self.block_size
        return hits

    def lookup(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """:meth:`match_prefix` without counting it in the hit statistics (a question, not a use)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent: bytes | None = None
        for start in range(0, (max_tokens // bs) * bs, bs):
            parent = self.hash_block(parent, token_ids[start:start + bs])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, block_ids: list[int], num_tokens: int, prefix_hits: Sequence[int] = ()) -> bool:
        """Grow ``block_ids`` in place so it covers ``num_tokens`` tokens.

        Args:
            block_ids: the request's block list (edited in place).
            num_tokens: tokens the request's blocks must hold after this step.
            prefix_hits: cached blocks from :meth:`match_prefix`, only for an empty list.
        Returns:
            False, changing nothing, if there are not enough free blocks ("not now").
        """
        assert not prefix_hits or not block_ids, "prefix hits only for a request with no blocks"
        # A hit block that sits in the evictable set is not free for fresh allocation.
        hits_evictable = sum(1 for b in prefix_hits if self.ref_count[b] == 0)
        need = self.blocks_needed(num_tokens) - len(block_ids) - len(prefix_hits)
        if need > self.num_free_blocks - hits_evictable:
            return False
        for b in prefix_hits:
            if self.ref_count[b] == 0:
                del self._evictable[b]
            self.ref_count[b] += 1
            block_ids.append(b)
        for _ in range(max(need, 0)):
            block_ids.append(self._take_block())
        return True

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently used cached block
            del self._hash_to_block[self.block_hash[b]]
            self.block_hash[b] = None
        assert self.ref_count[b] == 0
        self.ref_count[b] = 1
        return b

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block and clear the list.

        Freed in reverse so a request's tail blocks (least likely to be shared) are evicted first.
        """
        for b in reversed(block_ids):
            assert self.ref_count[b] > 0, f"block {b} double-freed"
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        block_ids.clear()

    def trim(self, block_ids: list[int], num_tokens: int) -> None:
        """Release blocks past the first ``num_tokens`` tokens (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        if len(block_ids) > keep:
            tail = block_ids[keep:]
            del block_ids[keep:]
            self.free(tail)

    def cache_blocks(self, block_ids: Sequence[int], token_ids: Sequence[int],
                     num_cached_before: int, num_computed: int) -> None:
        """Register hashes for blocks that became full between the two token counts.

        Args:
            block_ids: the request's blocks.
            token_ids: the request's tokens (at least ``num_computed`` of them).
            num_cached_before: tokens computed before this step.
            num_computed: tokens computed after this step.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, last = num_cached_before // bs, num_computed // bs
        parent = self.block_hash[block_ids[first - 1]] if first > 0 else None
        if first > 0 and parent is None:
            # The chain is broken (a duplicate earlier block was not registered); rebuild it.
            parent = None
            for i in range(first):
                parent = self.hash_block(parent, token_ids[i * bs:(i + 1) * bs])
        for i in range(first, last):
            h = self.hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            b = block_ids[i]
            if self.block_hash[b] is None and h not in self._hash_to_block:
                self.block_hash[b] = h
                self._hash_to_block[h] = b
            parent = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-unused block (e.g. after weights change)."""
        for b in list(self._evictable):
            del self._hash_to_block[self.block_hash[b]]
            self.block_hash[b] = None
            self._free.append(b)
        self._evictable.clear()

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by tests)."""
        free, evict = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not (free & evict)
        for b in range(self.num_blocks):
            rc = self.ref_count[b]
            assert rc >= 0
            if rc == 0:
                assert (b in free) != (b in evict), f"unused block {b} lost"
                assert (self.block_hash[b] is not None) == (b in evict)
            else:
                assert b not in free and b not in evict
        for h, b in self._hash_to_block.items():
            assert self.block_hash[b] == h


def allocate_kv_tensors(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                        head_dim: int, dtype: torch.dtype, device: str = "cpu"
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) tensors shaped ``[num_blocks * block_size, num_kv_heads, head_dim]``.

    Flat token slots (slot = block * block_size + offset) so writes are one index_copy_ and
    reads one gather per layer.
    """
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    alloc = _zero_pages if device == "cpu" else (lambda s, d: torch.zeros(s, dtype=d, device=device))
    return [(alloc(shape, dtype), alloc(shape, dtype)) for _ in range(num_layers)]


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose memory the kernel provides page by page as blocks are first written.

    ``kv_cache_gb: auto`` (engine/kv_budget.py, the default) gives a worker most of its node:
    ``torch.zeros`` would write every page of it at start (seconds, and the whole budget
    resident before the first request). An anonymous mapping reads as zeros and costs memory
    only where written, so resident KV grows with the blocks in use, up to the budget. Advised
    into transparent huge pages where the kernel allows it (attention gathers whole blocks).
    """
    numel = math.prod(shape)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP off in this kernel: 4 KiB pages, still zero until written
            pass
    # (the tensor keeps ``buf`` alive: torch.frombuffer holds a reference to its buffer)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
