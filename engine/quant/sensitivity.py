"""Sensitivity scan and automatic protection under a quality budget.

Scan: quantize one unit at a time (a linear, or a whole decoder layer), everything else in
full precision, and measure the loss increase on the calibration sequences. Protection: sort
units by that increase and find the smallest k such that quantizing everything except the k
most sensitive units keeps ``ppl_q / ppl_fp - 1 <= max_ppl_increase`` (binary search over k;
the loss is close to monotone in k, and the chosen k is always verified by a real measurement).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from engine.quant.calib import mean_nll
from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight
from engine.quant.swap import make_module, set_module


@dataclass
class ScanRow:
    unit: str              # a module name, or "layers.N" for a whole layer
    modules: list[str]
    nll_increase: float    # mean NLL with only this unit quantized, minus full precision

    @property
    def ppl_increase(self) -> float:
        return math.exp(self.nll_increase) - 1


def units_of(names: list[str], unit: str) -> dict[str, list[str]]:
    """Group module names into scan units: "linear" (each alone) or "layer" (per decoder layer)."""
    if unit not in ("linear", "layer"):
        raise ValueError(f"scan unit must be 'linear' or 'layer', got {unit!r}")
    out: dict[str, list[str]] = {}
    for n in names:
        key = n if unit == "linear" or not n.startswith("layers.") else ".".join(n.split(".")[:2])
        out.setdefault(key, []).append(n)
    return out


class _Swapper:
    """Swap quantized modules in and the fp linears back, by name."""

    def __init__(self, model: nn.Module, weights: dict[str, QuantizedWeight], cfg: QuantConfig) -> None:
        self.model, self.cfg = model, cfg
        self.fp = {n: model.get_submodule(n) for n in weights}
        self.q = {n: make_module(w, self.fp[n].bias, cfg) for n, w in weights.items()}

    def quantized(self, names) -> None:
        for n in self.fp:
            set_module(self.model, n, self.q[n] if n in names else self.fp[n])

    def restore(self) -> None:
        self.quantized(())


def scan(model: nn.Module, cfg: QuantConfig, weights: dict[str, QuantizedWeight], seqs: list[list[int]],
         unit: str = "linear", progress: Callable[[str], None] | None = None) -> tuple[float, list[ScanRow]]:
    """(full-precision mean NLL, rows sorted by decreasing loss increase)."""
    sw = _Swapper(model, weights, cfg)
    base = mean_nll(model, seqs)
    rows = []
    groups = units_of(list(weights), unit)
    try:
        for i, (u, names) in enumerate(groups.items(), 1):
            sw.quantized(set(names))
            rows.append(ScanRow(u, names, mean_nll(model, seqs) - base))
            if progress:
                progress(f"scan {i}/{len(groups)} {u}")
    finally:
        sw.restore()
    rows.sort(key=lambda r: r.nll_increase, reverse=True)
    return base, rows


def choose_protection(model: nn.Module, cfg: QuantConfig, weights: dict[str, QuantizedWeight],
                      seqs: list[list[int]], rows: list[ScanRow], base_nll: float, max_ppl_increase: float,
                      progress: Callable[[str], None] | None = None) -> tuple[list[str], float]:
    """Smallest set of most-sensitive units to keep in full precision within the budget.

    Returns:
        (protected module names, the measured ppl increase with them protected).
    """
    if max_ppl_increase < 0:
        raise ValueError(f"max_ppl_increase must be >= 0, got {max_ppl_increase}")
    sw = _Swapper(model, weights, cfg)
    cache: dict[int, float] = {}

    def increase(k: int) -> float:
        if k not in cache:
            protected = {n for r in rows[:k] for n in r.modules}
            sw.quantized(set(weights) - protected)
            cache[k] = math.exp(mean_nll(model, seqs) - base_nll) - 1
            if progress:
                progress(f"protect {k} most sensitive: ppl {100 * cache[k]:+.2f}%")
        return cache[k]

    try:
        lo, hi = 0, len(rows)  # increase(len(rows)) == 0: everything protected meets any budget
        cache[hi] = 0.0
        while lo < hi:
            mid = (lo + hi) // 2
            if increase(mid) <= max_ppl_increase:
                hi = mid
            else:
                lo = mid + 1
        k = lo
        measured = increase(k)
    finally:
        sw.restore()
    return [n for r in rows[:k] for n in r.modules], measured


def format_table(rows: list[ScanRow], top: int = 15) -> str:
    """The ranked table the CLI prints."""
    lines = [f"{'rank':>4}  {'unit':<32} {'loss +':>9} {'ppl +':>8}"]
    for i, r in enumerate(rows[:top], 1):
        lines.append(f"{i:>4}  {r.unit:<32} {r.nll_increase:>9.5f} {100 * r.ppl_increase:>7.3f}%")
    if len(rows) > top:
        lines.append(f"      ... {len(rows) - top} more")
    return "\n".join(lines)
