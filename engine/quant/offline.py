"""Offline conversion: full-precision folder -> calibrated, quality-checked quantized folder.

``convert`` is what ``pdserve quantize`` runs: load the model (plain linears), read the
calibration text, measure quality before, compute the integer weights by the chosen method,
optionally scan sensitivity and protect the fewest layers that keep the calibration perplexity
within budget, measure quality after, save the checkpoint with a report beside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.layers.attention import get_attention_backend
from engine.models.loader import load_model
from engine.quant.calib import calib_sequences, load_calib_texts, mean_nll
from engine.quant.checkpoint import save_quantized
from engine.quant.config import QuantConfig
from engine.quant.eval import HELDOUT, perplexity
from engine.quant.formats import QuantizedWeight
from engine.quant.hf_export import save_hf_gptq
from engine.quant.quantize import compute_weights, plan_targets
from engine.quant.sensitivity import choose_protection, format_table, scan
from engine.quant.swap import swap_in

Log = Callable[[str], None]
LAYOUTS = ("pdserve", "gptq")


def load_plain(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Our model with plain ``nn.Linear`` layers (what quantization and saving need)."""
    return load_model(Path(path), get_attention_backend("sdpa"), dtype, prepack=False)


def quality(model: nn.Module, tokenizer, seqs: list[list[int]], heldout_tokens: int = 1024) -> dict[str, float]:
    """Calibration perplexity and held-out prose/code perplexity (first ``heldout_tokens``)."""
    out = {"calib_ppl": math.exp(mean_nll(model, seqs))}
    for kind, f in HELDOUT.items():
        ids = tokenizer(f.read_text())["input_ids"]
        out[f"{kind}_ppl"] = perplexity(model, ids, max_tokens=heldout_tokens)
    return out


def convert(model_path: str | Path, cfg: QuantConfig, out_dir: str | Path | None = None,
            calib: str | Path | None = None, auto_protect: float | None = None, scan_unit: str = "linear",
            calib_tokens: int = 2048, seq_len: int = 512, heldout_tokens: int = 1024, log: Log = print,
            progress: Callable[[str], None] | None = None, layout: str = "pdserve") -> tuple[nn.Module, QuantConfig, dict[str, Any]]:
    """Quantize the model at ``model_path``; save to ``out_dir`` when given.

    Args:
        cfg: the format and method (its ``protect`` patterns are kept in full precision).
        calib: calibration .txt/.jsonl (None = the bundled sample).
        auto_protect: a ppl-increase budget (fraction): scan and protect the fewest units; the
            last quarter of the calibration sequences is held back from fitting to measure it.
        scan_unit: "linear" or "layer" granularity for the scan.
        layout: the saved folder's layout: "pdserve" (every format) or "gptq" (Hugging Face GPTQ,
            INT4 only, read by vLLM, transformers, GPTQModel: engine/quant/hf_export.py).
        heldout_tokens: tokens of each held-out text scored before and after.
    Returns:
        (the quantized model, the final config with every protected name, the report).
    Raises:
        ValueError: bad config or calibration file (before any heavy work).
    """
    from transformers import AutoTokenizer  # heavy: transformers

    _check_layout(layout, cfg)
    t0 = time.monotonic()
    model = load_plain(model_path)
    tok = AutoTokenizer.from_pretrained(str(model_path))
    seqs = calib_sequences(tok, load_calib_texts(calib), seq_len, calib_tokens)
    targets, protected = plan_targets(model, cfg)  # validates patterns and group sizes first
    if layout == "gptq":  # what the layout cannot say, refused before the heavy work
        _check_gptq_plan(cfg, targets, protected, auto_protect)
    log(f"{len(targets)} linear layers to quantize ({cfg.name}, {cfg.method}), {len(protected)} protected; "
        f"calibration: {sum(map(len, seqs))} tokens in {len(seqs)} sequences")
    before = quality(model, tok, seqs, heldout_tokens)
    log("before: " + _fmt(before))
    report: dict[str, Any] = {"before": before, "method": cfg.method}
    fit, val = _held_back(seqs, auto_protect is not None)
    weights, in_scales = compute_weights(model, cfg, targets, fit, progress, swap=False)
    if auto_protect is not None:
        chosen, scanned = _auto_protect(model, cfg, weights, val, scan_unit, auto_protect, log, progress)
        cfg = dataclasses.replace(cfg, protect=tuple(cfg.protect) + tuple(chosen))
        weights = {n: w for n, w in weights.items() if n not in chosen}
        report.update(scanned)
    swap_in(model, weights, cfg, in_scales)
    after = quality(model, tok, seqs, heldout_tokens)
    report["after"] = after
    log("after:  " + _fmt(after))
    log("change: " + ", ".join(f"{k} {100 * (after[k] / before[k] - 1):+.2f}%" for k in before))
    report["seconds"] = round(time.monotonic() - t0, 1)
    if out_dir is not None:
        save = save_hf_gptq if layout == "gptq" else save_quantized
        save(model, cfg, out_dir, model_path, report)
        log(f"saved {cfg.name} checkpoint ({layout} layout) to {out_dir} ({report['seconds']} s)")
    return model, cfg, report


def _check_layout(layout: str, cfg: QuantConfig) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "gptq" and (cfg.bits != 4 or cfg.activations != "none"):
        raise ValueError("the gptq layout holds 4-bit weight-only formats: use --bits 4 (or the pdserve layout)")


def _check_gptq_plan(cfg: QuantConfig, targets: dict[str, nn.Linear], protected: set[str],
                     auto_protect: float | None) -> None:
    """One group size and no per-layer exceptions: what the gptq layout can say."""
    groups = {cfg.group_for(m.in_features, n) for n, m in targets.items()}
    if len(groups) != 1:
        raise ValueError(f"the gptq layout has one group size; these layers would use {sorted(groups)}: "
                         "give --group-size (one that divides every layer's input)")
    if protected or auto_protect is not None:
        raise ValueError("the gptq layout has no per-layer exceptions that every reader honours: "
                         "drop --protect (or use the pdserve layout)")


def _held_back(seqs: list[list[int]], scanning: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(sequences the method fits on, sequences the protection budget is checked on).

    The budget is checked on calibration sequences the method did not fit: GPTQ/AWQ weights
    look better on their own calibration data than on new text (measured on SmolLM2).
    """
    n_val = max(1, len(seqs) // 4) if scanning and len(seqs) >= 2 else 0
    return (seqs[:-n_val], seqs[-n_val:]) if n_val else (seqs, seqs)


def _auto_protect(model: nn.Module, cfg: QuantConfig, weights: dict[str, QuantizedWeight], val: list[list[int]],
                  scan_unit: str, budget: float, log: Log,
                  progress: Callable[[str], None] | None) -> tuple[list[str], dict[str, Any]]:
    """Scan each unit's sensitivity on ``val`` and choose the fewest units to keep in full
    precision for a calibration ppl increase within ``budget``.

    Returns:
        (the chosen module names, the report's entries for the scan).
    """
    base, rows = scan(model, cfg, weights, val, scan_unit, progress)
    log("sensitivity (one unit quantized at a time, loss on held-back calibration text):\n"
        + format_table(rows))
    chosen, inc = choose_protection(model, cfg, weights, val, rows, base, budget, progress)
    log(f"auto-protect: {len(chosen)} module(s) kept in full precision for ppl {100 * inc:+.2f}% "
        f"<= {100 * budget:.2f}% on {sum(map(len, val))} held-back calibration tokens: "
        f"{', '.join(chosen) or '(none)'}")
    return chosen, dict(scan=[dataclasses.asdict(r) for r in rows], auto_protect_budget=budget,
                        auto_protected=chosen, auto_protect_calib_increase=inc)


def _fmt(q: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in q.items())
