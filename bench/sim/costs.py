"""The simulator's cost model: what one engine step, one KV transfer and one role switch cost.

One engine step is one model forward over a batch (engine.scheduler ``StepPlan``): decodes of
``batch`` running requests whose contexts sum to ``ctx`` tokens, and prompt chunks of ``n``
tokens after ``past`` tokens already computed. Its time, fitted to the engine's measurements
(``bench.sim.profile``) by least squares, is linear in what the forward touches::

    step_ms = base_ms                                  # launch, sampling, the weights' first pass
            + per_seq_ms        * batch                # per decode row: the weights' matmuls
            + per_ctx_ktok_ms   * ctx / 1e3            # decode attention over the KV read
            + per_prefill_tok_ms * n                   # per prompt token: the matmuls
            + per_prefill_attn_ms * n * (past + n / 2) / 1e6   # prompt attention (quadratic)

so a run of decode-only steps has a closed-form duration (``decode_run_ms``): the simulator
advances a batch many steps per event instead of one.

Workers that share a node share its memory bandwidth and caches: a step while another worker on
the node computes takes longer (measured by ``bench.sim.profile.measure_node``, two engines on
two cores, one stepping while the other runs prompts or decodes; 1 when not measured)::

    node_decode_x   a decode-only step's time, a neighbour busy / alone (decode reads weights
                    and KV: it is the one bandwidth-bound, so the one that slows most)
    node_prefill_x  a step with prompt tokens, a neighbour busy / alone

A worker in a cluster does more than ``engine.step()``, and a request crosses more than the
engine (both measured on a running cluster by ``bench.sim.profile``; 0 when not measured):

    loop_ms     per step of a worker's loop beyond the engine's step: its report to the
                router and the new tokens' trip to the client (added to every step)
    request_ms  per request, between the client and the engine: the gRPC call, the router's
                placement, the Ray calls to the workers and the first token's way back (added
                to its TTFT: the simulated router sees it this much after it is sent)
    prefill_x   a prompt's tokens in a cluster worker against the engine's own (lone long
                prompts' TTFT; >= 1): a worker's threads share the node's cores with the
                router, the client and its own loop, and a team waits for its slowest thread
    land_ms_per_ktok  what a decode worker spends taking in a transferred prompt's KV, per
                1,000 of its tokens, before its next step (lone long prompts' answer time less
                its decode steps; every stream it decodes waits that long)

JSON format (``format: pdserve-sim-cost/1``): ``model``, ``machine``, ``threads``,
``block_size``, ``kv_bytes_per_token``, ``kv_blocks`` (one worker's KV cache, in blocks),
``max_num_seqs``, ``max_batched_tokens``, ``step`` (the five coefficients above),
``cluster`` (``loop_ms``, ``request_ms``, ``land_ms_per_ktok``, absent: 0; ``prefill_x``, absent:
1), ``node`` (``decode_x``, ``prefill_x``; absent: 1),
``transfer`` (``gbps``, ``latency_ms``), ``switch_ms`` (a role switch's rewiring once the
worker is drained), ``sources`` (where each figure came from: measured or assumed) and
``samples`` (the raw measurements the fit came from).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "pdserve-sim-cost/1"
CACHE = Path("~/.cache/pdserve/sim").expanduser()  # this machine's profiles (bench.sim.profile)
STEP_KEYS = ("base_ms", "per_seq_ms", "per_ctx_ktok_ms", "per_prefill_tok_ms", "per_prefill_attn_ms")


@dataclass(frozen=True)
class StepCost:
    base_ms: float
    per_seq_ms: float
    per_ctx_ktok_ms: float
    per_prefill_tok_ms: float
    per_prefill_attn_ms: float

    def __post_init__(self) -> None:
        for k in STEP_KEYS:
            if not math.isfinite(getattr(self, k)) or getattr(self, k) < 0:
                raise ValueError(f"cost model step.{k} must be a finite number >= 0, got {getattr(self, k)!r}")


@dataclass(frozen=True)
class CostModel:
    """One worker's costs (module doc). Frozen; built by :func:`load` or the profiler."""

    model: str
    step: StepCost
    block_size: int = 16
    kv_bytes_per_token: int = 0
    kv_blocks: int = 4096
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    transfer_gbps: float = 1.0
    transfer_latency_ms: float = 1.0
    switch_ms: float = 500.0
    loop_ms: float = 0.0  # per step in a cluster worker's loop (module doc)
    request_ms: float = 0.0  # per request between the client and the engine (module doc)
    prefill_x: float = 1.0  # a cluster worker's prompt tokens against the engine's own (module doc)
    land_ms_per_ktok: float = 0.0  # a decode worker's intake of transferred KV (module doc)
    node_decode_x: float = 1.0  # a decode-only step beside a busy neighbour / alone (module doc)
    node_prefill_x: float = 1.0  # a step with prompt tokens beside a busy neighbour / alone
    machine: str = ""
    threads: int = 1
    sources: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.kv_blocks < 1 or self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError("cost model block_size, kv_blocks, max_num_seqs, max_batched_tokens must be >= 1")
        if self.transfer_gbps <= 0:
            raise ValueError(f"cost model transfer.gbps must be > 0, got {self.transfer_gbps}")
        for k in ("loop_ms", "request_ms", "land_ms_per_ktok"):
            if not math.isfinite(getattr(self, k)) or getattr(self, k) < 0:
                raise ValueError(f"cost model cluster.{k} must be a finite number >= 0, got {getattr(self, k)!r}")
        for k in ("node_decode_x", "node_prefill_x"):
            if not (math.isfinite(getattr(self, k)) and getattr(self, k) >= 1.0):
                raise ValueError(f"cost model node.{k[5:]} must be a finite number >= 1, got {getattr(self, k)!r}")
        if not (math.isfinite(self.prefill_x) and self.prefill_x >= 1.0):
            raise ValueError(f"cost model cluster.prefill_x must be a finite number >= 1, got {self.prefill_x!r}")

    # ---- what the simulator asks ----------------------------------------------------------
    def _rows_ms(self, batch: int, ctx: int) -> float:
        """A step's cost without prompt chunks: ``batch`` decode rows over ``ctx`` tokens."""
        s = self.step
        return s.base_ms + self.loop_ms + s.per_seq_ms * batch + s.per_ctx_ktok_ms * ctx / 1e3

    def step_ms(self, batch: int, ctx: int, chunks: list[tuple[int, int]] = ()) -> float:
        """One forward: ``batch`` decode rows over ``ctx`` context tokens in all, plus prompt
        ``chunks`` of (tokens, tokens already computed before them)."""
        s, ms = self.step, self._rows_ms(batch, ctx)
        for n, past in chunks:
            ms += (s.per_prefill_tok_ms * n + s.per_prefill_attn_ms * n * (past + n / 2) / 1e6) * self.prefill_x
        return ms

    def decode_run_ms(self, batch: int, ctx: int, k: int) -> float:
        """``k`` decode-only steps of a fixed batch whose context sum starts at ``ctx`` and
        grows by ``batch`` a step: sum over i < k of step_ms(batch, ctx + i * batch)."""
        return k * self._rows_ms(batch, ctx) + self.step.per_ctx_ktok_ms * batch / 1e3 * k * (k - 1) / 2

    def decode_steps_within(self, batch: int, ctx: int, ms: float) -> int:
        """The most whole steps of such a run that end within ``ms`` (the inverse of
        :meth:`decode_run_ms`)."""
        if ms <= 0:
            return 0
        a = self._rows_ms(batch, ctx)
        c = self.step.per_ctx_ktok_ms * batch / 1e3 / 2  # T(k) = c k^2 + (a - c) k
        if c <= 0:
            k = int(ms // a) if a > 0 else 10**9
        else:
            b = a - c
            k = int((-b + math.sqrt(b * b + 4 * c * ms)) / (2 * c))
        while k > 0 and self.decode_run_ms(batch, ctx, k) > ms:
            k -= 1
        while self.decode_run_ms(batch, ctx, k + 1) <= ms:
            k += 1
        return k

    def transfer_ms(self, tokens: int) -> float:
        """Sending ``tokens`` tokens' KV from a prefill to a decode worker (0 tokens: nothing)."""
        if tokens <= 0:
            return 0.0
        return self.transfer_latency_ms + tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9) * 1e3

    def land_ms(self, tokens: int) -> float:
        """A decode worker taking in ``tokens`` transferred tokens' KV (module doc)."""
        return self.land_ms_per_ktok * max(0, tokens) / 1e3

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- files ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d = {"format": FORMAT, **{k: v for k, v in d.items()
                                  if k not in ("transfer_gbps", "transfer_latency_ms", "loop_ms", "request_ms",
                                               "prefill_x", "land_ms_per_ktok", "node_decode_x", "node_prefill_x")}}
        d["transfer"] = {"gbps": self.transfer_gbps, "latency_ms": self.transfer_latency_ms}
        d["cluster"] = {"loop_ms": self.loop_ms, "request_ms": self.request_ms, "prefill_x": self.prefill_x,
                        "land_ms_per_ktok": self.land_ms_per_ktok}
        d["node"] = {"decode_x": self.node_decode_x, "prefill_x": self.node_prefill_x}
        return d

    def save(self, path: str | Path) -> Path:
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return p


def from_json(d: dict, source: str = "cost model") -> CostModel:
    """A CostModel from its JSON form.

    Raises:
        ValueError: a wrong format tag, a missing or bad field (named).
    """
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{source}: not a {FORMAT} file (its `format` field)")
    try:
        step = StepCost(**{k: float(d["step"][k]) for k in STEP_KEYS})
        t, c, nd = d.get("transfer", {}), d.get("cluster", {}), d.get("node", {})
        keys = ("block_size", "kv_bytes_per_token", "kv_blocks", "max_num_seqs", "max_batched_tokens", "threads")
        return CostModel(model=str(d["model"]), step=step, transfer_gbps=float(t.get("gbps", 1.0)),
                         transfer_latency_ms=float(t.get("latency_ms", 1.0)),
                         switch_ms=float(d.get("switch_ms", 500.0)), machine=str(d.get("machine", "")),
                         loop_ms=float(c.get("loop_ms", 0.0)), request_ms=float(c.get("request_ms", 0.0)),
                         prefill_x=float(c.get("prefill_x", 1.0)),
                         land_ms_per_ktok=float(c.get("land_ms_per_ktok", 0.0)),
                         node_decode_x=float(nd.get("decode_x", 1.0)), node_prefill_x=float(nd.get("prefill_x", 1.0)),
                         sources=dict(d.get("sources", {})), samples=dict(d.get("samples", {})),
                         **{k: int(d[k]) for k in keys if k in d})
    except KeyError as e:
        raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def cached_path(model: str, threads: int = 1) -> Path:
    """Where this machine's profile of ``model`` at ``threads`` engine threads is kept (a
    colocated worker runs 2 threads: another cost model than a 1-thread worker's)."""
    return CACHE / (f"cost_{model}.json" if threads == 1 else f"cost_{model}_t{threads}.json")


def load(path: str | Path) -> CostModel:
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"cannot read cost model {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"cost model {p} is not JSON: {e}") from None
    return from_json(data, str(p))


def fit_step(prefill: list[tuple[int, int, float]], decode: list[tuple[int, int, float]]) -> StepCost:
    """Least-squares step coefficients from measured (chunk tokens, past tokens, ms) prefill
    steps and (batch, context sum, ms) decode steps, clipped at 0 (a negative term is noise)."""
    # (heavy: numpy, loaded only by what uses them)
    import numpy as np
    rows, ys = [], []
    for b, ctx, ms in decode:
        rows.append([1.0, b, ctx / 1e3, 0.0, 0.0])
        ys.append(ms)
    for n, past, ms in prefill:
        rows.append([1.0, 0.0, 0.0, n, n * (past + n / 2) / 1e6])
        ys.append(ms)
    # Relative error: a 2 ms decode step weighs as much as a 400 ms prompt chunk.
    a, y = np.array(rows), np.array(ys)
    w = 1.0 / np.maximum(y, 1e-3)
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    return StepCost(*(max(0.0, float(c)) for c in coef))
