"""The simulator against the real cluster on the same arrivals: the trace both replay, the four
figures compared, and the table and JSON that report them (``python -m bench.simulate --validate``).

A real run sends a workload (bench/loadgen.py ``make_workload``) at Poisson arrivals
(``loadgen.poisson_arrivals``); :func:`sim_trace` turns the same requests and the same
schedule into the simulator's trace: the same token ids (so shared prompts share block hashes,
as the router's prefix index sees them), the same answer lengths, the same arrival times.

Both sides reduce to one :class:`Figures` by the same rules: TTFT = first token - arrival (the
real side's ``Result.ttft``, measured by the client from its send), TPOT = (last - first token)
/ (tokens - 1), percentiles by ``loadgen.percentile``. A :class:`Cell` is one figure of one mode
on one load, real and simulated; its relative error is |sim - real| / real.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from bench.loadgen import RequestSpec, percentile
from bench.sim.report import table
from bench.sim.traces import Spec

FIGURES = ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90")
TOLERANCE = 0.10  # the target: every cell within 10%


def sim_trace(specs: Sequence[RequestSpec], arrivals: Sequence[float]) -> list[Spec]:
    """The simulator's trace of ``specs`` sent at ``arrivals`` (seconds after the run starts).

    Raises:
        ValueError: lengths differ, or a request has no token ids (a text prompt's tokens are
            the server's tokenizer's: not known here).
    """
    if len(specs) != len(arrivals):
        raise ValueError(f"{len(specs)} requests but {len(arrivals)} arrival times")
    out = []
    for i, (s, at) in enumerate(zip(specs, arrivals)):
        if not s.token_ids:
            raise ValueError(f"request {i} ({s.kind}) has a text prompt: the simulator needs token ids")
        out.append(Spec(i, at, s.kind, list(s.token_ids), s.max_tokens))
    return out


@dataclass(frozen=True)
class Figures:
    """The four latency figures (ms) of one run; None where there is no sample (no request
    of more than one token: no TPOT)."""

    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    tpot_ms_p50: float | None
    tpot_ms_p90: float | None

    @classmethod
    def of(cls, ttfts_s: Iterable[float | None], tpots_s: Iterable[float | None]) -> Figures:
        """From per-request TTFTs and TPOTs in seconds (None entries skipped)."""
        t = [x for x in ttfts_s if x is not None]
        p = [x for x in tpots_s if x is not None]

        def ms(xs: list[float], q: float) -> float | None:
            v = percentile(xs, q)
            return None if v is None else v * 1e3
        return cls(ms(t, 50), ms(t, 90), ms(p, 50), ms(p, 90))


@dataclass(frozen=True)
class Cell:
    mode: str
    load: str
    figure: str  # one of FIGURES
    real_ms: float | None
    sim_ms: float | None

    @property
    def rel_error(self) -> float | None:
        """|sim - real| / real; None where either is missing or the real one is not > 0."""
        if self.real_ms is None or self.sim_ms is None or not self.real_ms > 0:
            return None
        return abs(self.sim_ms - self.real_ms) / self.real_ms

    def to_json(self) -> dict:
        e = self.rel_error
        return {**asdict(self), "rel_error": None if e is None else round(e, 4)}


def cells(mode: str, load: str, real: Figures, sim: Figures) -> list[Cell]:
    return [Cell(mode, load, f, getattr(real, f), getattr(sim, f)) for f in FIGURES]


def worst(cs: Iterable[Cell], k: int | None = None) -> list[Cell]:
    """The cells with a relative error, largest first (ties: input order); the first ``k``."""
    ranked = sorted((c for c in cs if c.rel_error is not None), key=lambda c: -c.rel_error)
    return ranked if k is None else ranked[:k]


def max_rel_error(cs: Iterable[Cell]) -> float | None:
    """The largest relative error over every cell (None: no cell has one)."""
    w = worst(cs, 1)
    return w[0].rel_error if w else None


def _err(c: Cell, tolerance: float) -> str:
    e = c.rel_error
    if e is None:
        return "-"
    sign = "+" if (c.sim_ms or 0) >= (c.real_ms or 0) else "-"
    return f"{sign}{e * 100:.0f}%" + ("*" if e > tolerance else "")


def render_table(cs: Sequence[Cell], tolerance: float = TOLERANCE, other: str = "sim") -> str:
    """One row per (mode, load): each figure real / sim (ms) and the signed error (sim above
    real: +); ``*`` marks a cell over ``tolerance``. ``other`` names the second column (a
    second real run: ``real 2``)."""
    rows: dict[tuple[str, str], dict] = {}
    for c in cs:
        r = rows.setdefault((c.mode, c.load), {"mode": c.mode, "load": c.load})
        r[f"{c.figure}_real"], r[f"{c.figure}_sim"], r[f"{c.figure}_err"] = c.real_ms, c.sim_ms, _err(c, tolerance)
    cols = [("mode", "mode", "s"), ("load", "load", "s")]
    for f in FIGURES:
        name = f.replace("_ms_", " ").upper().replace("P50", "p50").replace("P90", "p90")
        cols += [(f"{f}_real", f"{name} real", ".0f"), (f"{f}_sim", other, ".0f"), (f"{f}_err", "err", "s")]
    return table(list(rows.values()), cols)


def report(cs: Sequence[Cell], meta: dict, tolerance: float = TOLERANCE,
           key: str = "sim_vs_real_max_rel_error") -> dict:
    """The JSON line: ``key`` (the largest error), the worst cells, how many missed
    ``tolerance``, every cell, and ``meta`` (what ran: model, loads, seeds, cost models)."""
    over = [c for c in cs if c.rel_error is not None and c.rel_error > tolerance]
    m = max_rel_error(cs)
    return {key: None if m is None else round(m, 4), "tolerance": tolerance,
            "cells_over_tolerance": len(over), "cells_compared": sum(c.rel_error is not None for c in cs),
            "worst": [c.to_json() for c in worst(cs, 5)], **meta, "cells": [c.to_json() for c in cs]}
