"""Self-speculation by layer skipping: the target's first N layers and its LM head as the draft.

No extra weights and no extra KV: the draft's layers are the target's first N, so the K/V they
write for a position equal what the target writes there for the same token; the draft uses the
target's cache for those layers and the target's verify rewrites every slot it computes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.spec.model_draft import ModelDraft


class FirstLayers:
    """``target`` (any family of engine/models/registry.py) truncated to its first ``n`` layers,
    then its final norm and LM head."""

    def __init__(self, target: nn.Module, n: int) -> None:
        if not 1 <= n < len(target.layers):
            raise ValueError(f"layer_skip draft_layers must be in 1..{len(target.layers) - 1}, got {n}")
        self.target, self.n = target, n

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        t = self.target
        x = t.embed(input_ids)
        rope = t.rope_tables(positions, x.dtype)
        for layer, kv in zip(t.layers[:self.n], kv_caches[:self.n]):
            x = layer(x, rope, meta, kv)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def layer_skip_draft(target: nn.Module, backend, kv_caches, block_size: int, num_layers: int | None,
                     device: str = "cpu") -> ModelDraft:
    """A draft of the target's first ``num_layers`` layers (default: half of them)."""
    n = num_layers if num_layers is not None else max(1, len(target.layers) // 2)
    draft = ModelDraft(FirstLayers(target, n), backend, kv_caches[:n], block_size, device, shares_target_kv=True)
    draft.name = "layer_skip"
    return draft
