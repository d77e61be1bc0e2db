"""Calibration data and whole-sequence forwards outside the serving engine.

Quantization and evaluation run the model on plain token sequences, one at a time, each with
its own small KV cache (no scheduler, no paging beyond one block table). ``SequenceForward``
exposes the decoder layer by layer so GPTQ/AWQ can quantize layer i and feed its quantized
output to layer i+1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_CALIB = DATA_DIR / "calib_default.txt"
_BLOCK = 16


def load_calib_texts(path: str | Path | None) -> list[str]:
    """Texts from a ``.txt`` file (one document; blank-line separated paragraphs are joined) or
    a ``.jsonl`` file (one object per line with a ``"text"`` key, or a JSON string per line).
    ``None`` = the bundled default sample.

    Raises:
        ValueError: the file is missing, unreadable, not valid JSONL, or holds no text.
    """
    p = Path(path) if path is not None else DEFAULT_CALIB
    if not p.is_file():
        raise ValueError(f"calibration file {str(p)!r} does not exist (give a .txt or .jsonl file)")
    raw = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix.lower() in (".jsonl", ".json"):
        texts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"calibration file {str(p)!r} line {i} is not JSON: {e.msg}") from None
            t = obj.get("text") if isinstance(obj, dict) else obj
            if not isinstance(t, str):
                raise ValueError(f"calibration file {str(p)!r} line {i}: expected a string or an object "
                                 "with a \"text\" string")
            texts.append(t)
    else:
        texts = [raw]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"calibration file {str(p)!r} is empty: it needs some text to calibrate on")
    return texts


def calib_sequences(tokenizer, texts: list[str], seq_len: int = 512, max_tokens: int = 4096) -> list[list[int]]:
    """Tokenize and cut into sequences of ``seq_len`` tokens (the last may be shorter, >= 32),
    at most ``max_tokens`` tokens in all."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    seqs = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    seqs = [s for s in seqs if len(s) >= 32] or seqs[:1]
    if not seqs or not seqs[0]:
        raise ValueError("calibration text tokenizes to nothing")
    return seqs


class SequenceForward:
    """Runs ``model`` (any family of engine/models/registry.py) over one token sequence at a
    time, layer by layer."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.backend = model.layers[0].self_attn.backend
        self.nkv, self.hd = cfg.num_kv_heads, cfg.head_dim
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device

    def start(self, ids: list[int]) -> tuple[torch.Tensor, tuple]:
        """Embeddings [T, H] and the per-sequence context (rope, metadata, one layer's KV)."""
        t = len(ids)
        nb = -(-t // _BLOCK)
        dev = self.device
        meta = AttentionMetadata(torch.arange(t, device=dev), [t], [t], [list(range(nb))], _BLOCK)
        self.backend.prepare(meta, dev)
        kv = (torch.zeros(nb * _BLOCK, self.nkv, self.hd, dtype=self.dtype, device=dev),
              torch.zeros(nb * _BLOCK, self.nkv, self.hd, dtype=self.dtype, device=dev))
        x = self.model.embed(torch.tensor(ids, device=dev))
        rope = self.model.rope_tables(torch.arange(t, device=dev), x.dtype)
        return x, (rope, meta, kv)

    def layer(self, i: int, x: torch.Tensor, ctx: tuple) -> torch.Tensor:
        rope, meta, kv = ctx
        return self.model.layers[i](x, rope, meta, kv)

    @torch.inference_mode()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        x, ctx = self.start(ids)
        for i in range(len(self.model.layers)):
            x = self.layer(i, x, ctx)
        return x

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] of every position."""
        return self.model.compute_logits(self.hidden(ids))

    @torch.inference_mode()
    def nll(self, ids: list[int], score_from: int = 0) -> tuple[float, int]:
        """(sum of -log p(token), count) over next-token predictions for positions >= score_from."""
        logits = self.logits(ids)[:-1]
        target = torch.tensor(ids[1:], device=logits.device)
        lp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
        lp = lp[max(0, score_from - 1):]
        return float(-lp.sum()), lp.numel()


def mean_nll(model: nn.Module, seqs: list[list[int]]) -> float:
    """Mean next-token negative log-likelihood over ``seqs`` (log of the perplexity)."""
    fwd = SequenceForward(model)
    tot, n = 0.0, 0
    for s in seqs:
        a, b = fwd.nll(s)
        tot, n = tot + a, n + b
    return tot / max(n, 1)


def iter_linears(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Linear]]:
    for name, m in module.named_modules(prefix=prefix):
        if isinstance(m, nn.Linear):
            yield name, m
