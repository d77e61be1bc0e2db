"""Sequential layer-by-layer calibration shared by GPTQ, AWQ and SmoothQuant.

For decoder layer i: run it on the calibration hidden states with hooks that record the inputs
of its target linears, let the method quantize (or rescale) that layer, then run the layer
again so layer i+1 calibrates on what the *quantized* layer i really produces. The LM head
comes last, on the final norm of the last hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant.calib import SequenceForward
from engine.quant.swap import make_module, set_module

# handle(layer prefix, {linear name: inputs [tokens, in_features] fp32}) -> None
Handler = Callable[[str, dict[str, torch.Tensor]], None]


class QuantizedSwap:
    """Puts each quantized module in place of its linear as soon as it exists (so later layers
    calibrate on what the quantized ones produce) and, for ``swap=False``, puts the originals
    back at the end. Shared by GPTQ and AWQ."""

    def __init__(self, model: nn.Module, cfg) -> None:
        self.model, self.cfg = model, cfg
        self.weights: dict = {}  # name -> QuantizedWeight
        self._originals: dict[str, nn.Module] = {}

    def put(self, name: str, lin: nn.Linear, qw) -> None:
        self.weights[name] = qw
        self._originals[name] = lin
        set_module(self.model, name, make_module(qw, lin.bias, self.cfg))

    def finish(self, swap: bool) -> dict:
        """The quantized weights by name; with ``swap=False`` the model gets its linears back."""
        if not swap:
            for name, lin in self._originals.items():
                set_module(self.model, name, lin)
        return self.weights


@torch.no_grad()
def run_layerwise(model: nn.Module, seqs: list[list[int]], targets: dict[str, nn.Linear],
                  handle: Handler, progress: Callable[[str], None] | None = None,
                  max_rows: int = 8192) -> None:
    """Drive ``handle`` over every decoder layer (and the LM head) with recorded inputs.

    Args:
        model: our LlamaForCausalLM (plain linears).
        seqs: calibration token sequences.
        targets: the linears being quantized, by module name (others get no inputs recorded).
        handle: called once per layer with the inputs of that layer's targets; it may replace
            the layer's modules or rescale its weights in place.
        progress: a message per layer.
        max_rows: cap on recorded rows per linear (a random subset beyond it).
    """
    fwd = SequenceForward(model)
    starts = [fwd.start(s) for s in seqs]
    xs = [x for x, _ in starts]
    ctxs = [c for _, c in starts]
    n_layers = len(model.layers)
    for i in range(n_layers):
        prefix = f"layers.{i}."
        names = [n for n in targets if n.startswith(prefix)]
        rec: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        hooks = []
        for n in names:
            mod = model.get_submodule(n)
            hooks.append(mod.register_forward_hook(
                lambda _m, inp, _out, n=n: rec[n].append(inp[0].detach().float().reshape(-1, inp[0].shape[-1]))))
        try:
            for x, c in zip(xs, ctxs):
                fwd.layer(i, x, c)
        finally:
            for h in hooks:
                h.remove()
        if names:
            handle(prefix, {n: _cap(torch.cat(v), max_rows) for n, v in rec.items()})
        xs = [fwd.layer(i, x, c) for x, c in zip(xs, ctxs)]
        if progress:
            progress(f"layer {i + 1}/{n_layers}")
    if "lm_head" in targets:
        h = torch.cat([model.norm(x) for x in xs]).float()
        handle("lm_head", {"lm_head": _cap(h, max_rows)})
        if progress:
            progress("lm_head")


def _cap(x: torch.Tensor, max_rows: int) -> torch.Tensor:
    if x.shape[0] <= max_rows:
        return x
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:max_rows]
    return x[idx]
