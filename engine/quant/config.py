"""QuantConfig: what to quantize and how, validated when built and saved beside a checkpoint.

A config names a *format* (what the decode worker runs) and a *method* (how the integer
weights were chosen offline). The short names used in ``EngineConfig.quantization`` and the
cluster YAML parse into a config with :meth:`QuantConfig.parse`:

    "none"          full precision
    "int8"          weight-only INT8, one scale per output channel
    "int4"          weight-only INT4, groups of 128 (64/32 where 128 does not divide the input)
    "int4-g64"      weight-only INT4, groups of exactly 64 (an error if 64 does not divide)
    "int4-g32-asym" asymmetric (scale + zero point)
    "w8a8"          SmoothQuant: INT8 weights and dynamically quantized INT8 activations
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
METHODS = ("rtn", "gptq", "awq")
ACTIVATIONS = ("none", "int8")


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model's linear layers.

    Attributes:
        bits: 8 (per output channel) or 4 (per group along the input dimension).
        group_size: INT4 group length (32, 64 or 128). ``None`` = 128, falling back to 64 or 32
            for a layer whose input size 128 does not divide. INT8 is per channel: must be None.
        symmetric: scale only (True) or scale + zero point (False).
        method: "rtn" (round to nearest), "gptq" or "awq"; gptq/awq need calibration text.
        lm_head: quantize the LM head too (its fp weight stays for the embedding lookup when
            tied). The embedding table itself always stays full precision.
        protect: module-name patterns kept in full precision (see :func:`match_protect`).
        activations: "none" (weight-only) or "int8" (W8A8, SmoothQuant; needs bits=8).
        smooth_alpha: SmoothQuant migration strength α in [0, 1].
        act_order: GPTQ: quantize columns in order of decreasing Hessian diagonal (default: on;
            with static groups it keeps the kernel layout, and on SmolLM2 it is what makes GPTQ
            beat RTN on held-out text rather than only on the calibration set).
        damp: GPTQ: fraction of the mean Hessian diagonal added to it (numerical damping).
    """

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    method: str = "rtn"
    lm_head: bool = True
    protect: tuple[str, ...] = ()
    activations: str = "none"
    smooth_alpha: float = 0.5
    act_order: bool = True
    damp: float = 0.01

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be 8 or 4, got {self.bits!r} (3-bit and others are not supported)")
        if self.bits == 8 and self.group_size is not None:
            raise ValueError(f"INT8 is quantized per output channel: group_size must be None, got {self.group_size}")
        if self.bits == 4 and self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")
        if self.activations == "int8" and (self.bits != 8 or not self.symmetric):
            raise ValueError("W8A8 (activations='int8') needs bits=8 and symmetric weights")
        if self.activations == "int8" and self.method == "gptq":
            raise ValueError("W8A8 uses SmoothQuant scaling: use method 'rtn' (or 'awq' for weight-only)")
        if not 0.0 <= self.smooth_alpha <= 1.0:
            raise ValueError(f"smooth_alpha must be in [0, 1], got {self.smooth_alpha}")
        if not 0.0 < self.damp < 1.0:
            raise ValueError(f"damp must be in (0, 1), got {self.damp}")
        if isinstance(self.protect, (str, list)):
            object.__setattr__(self, "protect", (self.protect,) if isinstance(self.protect, str)
                               else tuple(self.protect))
        for p in self.protect:
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"protect patterns must be non-empty strings, got {p!r}")

    # ---- names ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Short name: "int8", "int4-g128", "int4-g64-asym", "w8a8" (what model_info reports)."""
        if self.activations == "int8":
            return "w8a8"
        s = "int8" if self.bits == 8 else f"int4-g{self.group_size or 128}"
        return s + ("" if self.symmetric else "-asym")

    @classmethod
    def parse(cls, spec: str | QuantConfig | None) -> QuantConfig | None:
        """"none"/None -> None; "int8", "int4", "int4-g64", "int4-g32-asym", "w8a8" -> a config.

        Raises:
            ValueError: an unknown name, listing the valid forms.
        """
        if spec is None or isinstance(spec, QuantConfig):
            return spec
        s = spec.strip().lower()
        if s in ("", "none", "fp", "full"):
            return None
        if s == "w8a8":
            return cls(bits=8, activations="int8")
        m = re.fullmatch(r"int(8|4)(?:-g(\d+))?(-asym|-sym)?", s)
        if not m:
            raise ValueError(f"unknown quantization {spec!r}; valid: none, int8, int8-asym, int4, "
                             "int4-g32|g64|g128, int4-g128-asym, w8a8 (or a quantized checkpoint folder)")
        bits = int(m.group(1))
        group = int(m.group(2)) if m.group(2) else None
        return cls(bits=bits, group_size=group, symmetric=m.group(3) != "-asym")

    def group_for(self, in_features: int, layer: str = "") -> int | None:
        """Group length for a layer with ``in_features`` inputs (None = per channel).

        Raises:
            ValueError: an explicit group size that does not divide ``in_features``.
        """
        if self.bits == 8:
            return None
        if self.group_size is not None:
            if in_features % self.group_size:
                ok = [g for g in GROUP_SIZES if in_features % g == 0]
                raise ValueError(
                    f"group_size {self.group_size} does not divide in_features={in_features} of "
                    f"{layer or 'a layer'}; use {' or '.join(map(str, ok)) or 'no group size (none divides it)'}"
                    ", leave group_size unset to pick per layer, or protect that layer")
            return self.group_size
        for g in sorted(GROUP_SIZES, reverse=True):
            if in_features % g == 0:
                return g
        raise ValueError(f"in_features={in_features} of {layer or 'a layer'} is not a multiple of 32: "
                         "INT4 groups cannot tile it; protect that layer")

    # ---- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["protect"] = list(self.protect)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown QuantConfig keys {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if "protect" in d:
            d["protect"] = tuple(d["protect"])
        return cls(**d)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> QuantConfig:
        return cls.from_dict(json.loads(path.read_text()))
