"""``quantize(model, config)``: choose the layers, compute integer weights, swap the modules.

Steps: (1) every ``nn.Linear`` of the model is a candidate (the LM head only if
``config.lm_head``), minus the ``protect`` patterns; (2) the method (RTN, GPTQ, AWQ, or
SmoothQuant for W8A8) computes a :class:`QuantizedWeight` per target, calibrated methods on
token sequences; (3) each target ``nn.Linear`` is replaced by its quantized module. Must run on
the plain model, before the fp32 linears are prepacked (the loader does it in that order).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.memory import release_freed_memory
from engine.quant.awq import awq_model
from engine.quant.calib import iter_linears
from engine.quant.config import QuantConfig
from engine.quant.formats import QuantizedWeight, quantize_weight
from engine.quant.gptq import gptq_model
from engine.quant.smoothquant import smooth_model
from engine.quant.swap import swap_in

# HF projection names -> our fused modules, so `--protect q_proj` does what the user means.
ALIASES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

Progress = Callable[[str], None]


def match_protect(name: str, pattern: str, num_layers: int) -> bool:
    """Does module ``name`` match a protect pattern?

    Patterns: a glob on the full name (``layers.2?.mlp.*``); a bare name matching whole dotted
    components anywhere (``o_proj``, ``mlp.down_proj``, ``layers.29``, ``lm_head``; HF names
    q/k/v_proj, gate/up_proj map to our fused qkv_proj / gate_up_proj); ``last:N`` / ``first:N``
    for the last or first N decoder layers.
    """
    p = pattern.strip()
    m = re.fullmatch(r"(last|first):(\d+)", p)
    if m:
        k = int(m.group(2))
        lm = re.match(r"layers\.(\d+)\.", name)
        if not lm:
            return False
        i = int(lm.group(1))
        return i >= num_layers - k if m.group(1) == "last" else i < k
    if any(c in p for c in "*?["):
        return fnmatch.fnmatchcase(name, p)
    p = ".".join(ALIASES.get(part, part) for part in p.split("."))
    return re.search(rf"(^|\.){re.escape(p)}($|\.)", name) is not None


def resolve_protect(names: Iterable[str], patterns: Iterable[str], num_layers: int) -> set[str]:
    """Module names matched by any pattern.

    Raises:
        ValueError: a pattern that matches no quantizable layer (a typo would otherwise
            silently protect nothing).
    """
    names = list(names)
    out: set[str] = set()
    for p in patterns:
        hit = {n for n in names if match_protect(n, p, num_layers)}
        if not hit:
            raise ValueError(f"protect pattern {p!r} matches no quantizable layer; layer names look like "
                             f"{', '.join(names[:4])} ... {names[-1]} (globs, bare names like o_proj, "
                             "layers.29, lm_head, or last:N)")
        out |= hit
    return out


def plan_targets(model: nn.Module, cfg: QuantConfig) -> tuple[dict[str, nn.Linear], set[str]]:
    """(the linears to quantize by name, the protected names). Checks group sizes now.

    Raises:
        ValueError: bad protect pattern, a group size that does not divide a layer's input.
    """
    lin = dict(iter_linears(model))
    if not lin:
        raise ValueError("no nn.Linear layers to quantize (is the model already quantized or prepacked?)")
    cand = {n: m for n, m in lin.items() if cfg.lm_head or n != "lm_head"}
    protected = resolve_protect(cand, cfg.protect, len(getattr(model, "layers", [])))
    targets = {n: m for n, m in cand.items() if n not in protected}
    for n, m in targets.items():
        cfg.group_for(m.in_features, n)
    return targets, protected


def rtn_weights(targets: dict[str, nn.Linear], cfg: QuantConfig) -> dict[str, QuantizedWeight]:
    """Round-to-nearest: each weight alone, no data."""
    return {n: quantize_weight(m.weight.detach(), cfg.bits, cfg.group_for(m.in_features, n), cfg.symmetric)
            for n, m in targets.items()}


@torch.no_grad()
def compute_weights(model: nn.Module, cfg: QuantConfig, targets: dict[str, nn.Linear],
                    seqs: list[list[int]] | None = None, progress: Progress | None = None,
                    swap: bool = False) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Integer weights for ``targets`` by ``cfg.method`` (AWQ/SmoothQuant also rescale the
    model's fp weights and norms in place, an exact re-parametrization).

    Returns:
        (weights by name, per-layer input scales for W8A8 layers that could not fold them).
    """
    if cfg.activations == "int8":
        in_scales = smooth_model(model, targets, _need(seqs, "SmoothQuant"), cfg.smooth_alpha, progress)
        targets = {n: model.get_submodule(n) for n in targets}  # smoothing may have untied lm_head
        return rtn_weights(targets, cfg), in_scales
    if cfg.method == "rtn":
        return rtn_weights(targets, cfg), {}
    if cfg.method == "gptq":
        return gptq_model(model, cfg, targets, _need(seqs, "GPTQ"), progress, swap=swap), {}
    return awq_model(model, cfg, targets, _need(seqs, "AWQ"), progress, swap=swap), {}


def _need(seqs: list[list[int]] | None, what: str) -> list[list[int]]:
    if not seqs:
        raise ValueError(f"{what} needs calibration sequences (token ids); got none")
    return seqs


def quantize(model: nn.Module, cfg: QuantConfig | str, seqs: list[list[int]] | None = None,
             progress: Progress | None = None) -> dict[str, QuantizedWeight]:
    """Quantize ``model`` in place: every targeted ``nn.Linear`` becomes a QuantLinear.

    Args:
        model: our LlamaForCausalLM with plain ``nn.Linear`` layers (not prepacked).
        cfg: the config, or a short name ("int8", "int4-g64", "w8a8").
        seqs: calibration token sequences (GPTQ, AWQ and W8A8 need them).
        progress: called with a short message per layer.
    Returns:
        The integer weights by module name; {} for round-to-nearest, which frees each once its
        module holds it (the loading peak).
    """
    cfg = QuantConfig.parse(cfg) if isinstance(cfg, str) else cfg
    if cfg is None:
        return {}
    targets, _ = plan_targets(model, cfg)
    if cfg.method == "rtn" and cfg.activations != "int8":  # each weight alone: one at a time
        return _rtn_in_place(model, targets, cfg)
    weights, in_scales = compute_weights(model, cfg, targets, seqs, progress, swap=True)
    remaining = {n: w for n, w in weights.items() if isinstance(model.get_submodule(n), nn.Linear)}
    swap_in(model, remaining, cfg, in_scales)
    return weights


@torch.no_grad()
def _rtn_in_place(model: nn.Module, targets: dict[str, nn.Linear], cfg: QuantConfig) -> dict[str, QuantizedWeight]:
    """Round-to-nearest, each linear quantized and swapped before the next: the float weight
    goes as its integer one arrives, so the loading peak holds one layer's temporaries, not a
    second model (measured on SmolLM2 int8: 1.90 GB before, see docs/bench/memory_*). Returns
    nothing: each integer weight (INT4 codes a byte each) is its module's alone once swapped."""
    for n in list(targets):
        lin = targets.pop(n)  # (this dict would keep the float module alive)
        qw = quantize_weight(lin.weight.detach(), cfg.bits, cfg.group_for(lin.in_features, n), cfg.symmetric)
        del lin
        swap_in(model, {n: qw}, cfg)
        del qw
        release_freed_memory()
    return {}
