"""Decode-side weight quantization: formats, quantized linears, calibration, checkpoints.

``quantize(model, QuantConfig)`` swaps linears for quantized ones; ``save_quantized`` /
``load_quantized`` write and read a checkpoint folder a decode worker loads directly.
"""

from pathlib import Path

from engine.models import gguf
from engine.quant.checkpoint import checkpoint_name, is_quantized_checkpoint
from engine.quant.config import QuantConfig
from engine.quant.quantize import quantize

__all__ = ["QuantConfig", "quantize", "quantization_name", "split_quantization"]


def split_quantization(spec: str | None, model_path: str) -> tuple[str, str | None]:
    """A decode pool's ``quantization`` setting -> (model folder to load, quantization at load).

    ``spec`` is "none", a short name ("int8", "int4-g64", "w8a8": applied with RTN at load) or
    a quantized checkpoint folder (``pdserve quantize --out``, or a Hugging Face GPTQ/AWQ
    folder), which is loaded instead.
    """
    if spec and Path(spec).expanduser().is_dir():
        if not is_quantized_checkpoint(Path(spec).expanduser()):
            raise ValueError(f"{spec!r} is a folder but not a quantized checkpoint (no pdserve_quant.json, "
                             "and no GPTQ/AWQ quantization_config in its config.json)")
        return str(Path(spec).expanduser()), None
    cfg = QuantConfig.parse(spec)
    return model_path, None if cfg is None else spec


def quantization_name(quantization: str | None, model_path, dequantize: bool = False) -> str:
    """What model_info reports: "none", "int8", "int4-g128", ... (a checkpoint's saved name)."""
    if is_quantized_checkpoint(model_path):
        return checkpoint_name(model_path)
    cfg = QuantConfig.parse(quantization)
    if gguf.source(model_path) is not None:  # how engine/models/gguf.py loads the file's weights
        if dequantize:
            return "none"
        return {None: "gguf-as-shipped", "int8": "int8", "int4": "int4-g32-asym"}.get(
            None if cfg is None else quantization, cfg.name if cfg is not None else "none")
    return "none" if cfg is None else cfg.name
