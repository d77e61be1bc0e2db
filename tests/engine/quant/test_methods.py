"""Calibrated methods beat round-to-nearest on the layer-wise error they minimize, measured on
the same calibration inputs (a small layer, inputs with correlated and outlier channels)."""

from __future__ import annotations

import pytest
import torch

from engine.quant.awq import awq_quantize
from engine.quant.formats import quantize_weight
from engine.quant.gptq import gptq_quantize, hessian, reconstruction_error


def _layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 256, generator=g) * 0.05
    # correlated inputs (a random mixing) with a few outlier channels, as LLM activations have
    x = torch.randn(1024, 256, generator=g) @ (torch.eye(256) + 0.3 * torch.randn(256, 256, generator=g) / 16)
    x[:, :6] *= 12.0
    return w, x


def _awq_error(w, x, bits, group):
    qw, s = awq_quantize(w, x, bits, group, True)
    ref = x @ w.T
    out = (x / s) @ qw.dequantize().T
    return float(((out - ref) ** 2).sum() / (ref ** 2).sum())


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, None)])
def test_gptq_beats_rtn(bits, group):
    w, x = _layer()
    rtn = reconstruction_error(w, quantize_weight(w, bits, group, True), x)
    gptq = reconstruction_error(w, gptq_quantize(w, hessian(x), bits, group, True), x)
    gptq_ao = reconstruction_error(w, gptq_quantize(w, hessian(x), bits, group, True, act_order=True), x)
    assert gptq < 0.8 * rtn, (gptq, rtn)
    assert gptq_ao < 0.8 * rtn, (gptq_ao, rtn)


def test_gptq_result_is_a_valid_grouped_weight():
    w, x = _layer(1)
    qw = gptq_quantize(w, hessian(x), 4, 64, False, act_order=True)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15
    assert qw.scale.shape == (96, 4) and qw.zero.shape == (96, 4)
    # act-order keeps contiguous groups: the kernel layout is the usual one
    assert (qw.dequantize() - w).abs().max() < 0.1


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 128)])
def test_awq_beats_rtn(bits, group):
    w, x = _layer(2)
    rtn = reconstruction_error(w, quantize_weight(w, bits, group, True), x)
    awq = _awq_error(w, x, bits, group)
    assert awq < 0.9 * rtn, (awq, rtn)
