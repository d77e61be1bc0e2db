"""Decode-side weight quantization: formats, quantized linears, calibration, checkpoints.

``quantize(model, QuantConfig)`` swaps linears for quantized ones; ``save_quantized`` /
``load_quantized`` write and read a checkpoint folder a decode worker loads directly.
"""

from engine.quant.config import QuantConfig
from engine.quant.quantize import quantize

__all__ = ["QuantConfig", "quantize"]
