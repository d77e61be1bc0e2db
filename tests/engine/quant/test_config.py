"""Bad quantization config fails early with a message that says what to change."""

from __future__ import annotations

import pytest
from torch import nn

from engine.config import EngineConfig
from engine.quant.calib import load_calib_texts
from engine.quant.config import QuantConfig
from engine.quant.quantize import plan_targets


def test_bad_bits_and_group_sizes():
    with pytest.raises(ValueError, match="bits must be 8 or 4.*3-bit"):
        QuantConfig(bits=3)
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128"):
        QuantConfig(bits=4, group_size=100)
    with pytest.raises(ValueError, match="per output channel"):
        QuantConfig(bits=8, group_size=128)
    with pytest.raises(ValueError, match="method must be one of rtn, gptq, awq"):
        QuantConfig(method="magic")
    with pytest.raises(ValueError, match="W8A8.*bits=8"):
        QuantConfig(bits=4, group_size=64, activations="int8")


def test_short_names_parse_and_round_trip():
    assert QuantConfig.parse("none") is None and QuantConfig.parse(None) is None
    assert QuantConfig.parse("int8") == QuantConfig(bits=8)
    assert QuantConfig.parse("int4-g64-asym") == QuantConfig(bits=4, group_size=64, symmetric=False)
    for name in ("int8", "int8-asym", "int4-g32", "int4-g128-asym", "w8a8"):
        assert QuantConfig.parse(name).name == name
    assert QuantConfig.parse("int4").name == "int4-g128"
    with pytest.raises(ValueError, match="unknown quantization 'int3'.*int4-g32"):
        QuantConfig.parse("int3")
    with pytest.raises(ValueError, match="unknown quantization"):
        EngineConfig(quantization="int3")
    cfg = QuantConfig(bits=4, group_size=32, method="gptq", protect=("o_proj", "last:2"), act_order=True)
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"o_proj": nn.Linear(96, 8), "down_proj": nn.Linear(128, 8)})
                                     for _ in range(2)])
        self.lm_head = nn.Linear(128, 16)


def test_group_size_must_divide_the_layer():
    with pytest.raises(ValueError, match=r"group_size 64 does not divide in_features=96 of layers\.0\.o_proj; use 32"):
        plan_targets(_Toy(), QuantConfig(bits=4, group_size=64))
    # unset group size picks per layer: 128 where it divides, else 64, else 32
    targets, _ = plan_targets(_Toy(), QuantConfig(bits=4))
    cfg = QuantConfig(bits=4)
    assert cfg.group_for(96) == 32 and cfg.group_for(128) == 128 and cfg.group_for(576) == 64
    # protecting the odd layers makes an explicit group size valid
    targets, protected = plan_targets(_Toy(), QuantConfig(bits=4, group_size=64, protect=("o_proj",)))
    assert protected == {"layers.0.o_proj", "layers.1.o_proj"}
    assert set(targets) == {"layers.0.down_proj", "layers.1.down_proj", "lm_head"}


def test_protect_patterns():
    toy = _Toy()
    _, p = plan_targets(toy, QuantConfig(protect=("last:1", "lm_head")))
    assert p == {"layers.1.o_proj", "layers.1.down_proj", "lm_head"}
    _, p = plan_targets(toy, QuantConfig(protect=("layers.?.down_*",)))
    assert p == {"layers.0.down_proj", "layers.1.down_proj"}
    targets, _ = plan_targets(toy, QuantConfig(lm_head=False))
    assert "lm_head" not in targets
    with pytest.raises(ValueError, match="protect pattern 'q_projj' matches no quantizable layer"):
        plan_targets(toy, QuantConfig(protect=("q_projj",)))


def test_calibration_file_missing_or_empty(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_calib_texts(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="is empty"):
        load_calib_texts(tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_calib_texts(tmp_path / "bad.jsonl")
    (tmp_path / "ok.jsonl").write_text('{"text": "first"}\n"second"\n\n')
    assert load_calib_texts(tmp_path / "ok.jsonl") == ["first", "second"]
    assert len(load_calib_texts(None)[0]) > 1000  # the bundled default sample
