"""deploy/local.yaml loads; every bad key or value is refused with a message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import ClusterConfig, ConfigError, load_config

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"


def test_local_yaml_documents_every_key_with_its_default():
    cfg = load_config(LOCAL)
    assert cfg == ClusterConfig()  # the file lists exactly the defaults
    text = LOCAL.read_text()
    for section in ("prefill", "decode", "kv_transfer", "router", "limits"):
        for key in getattr(cfg, section).__dataclass_fields__:
            assert f"  {key}:" in text, f"{section}.{key} is not documented in local.yaml"


@pytest.mark.parametrize("override,needle", [
    ({"decode.replicaz": 2}, "unknown key decode.replicaz"),
    ({"mdoe": "colocated"}, "unknown key mdoe"),
    ({"decode.replicas": 0}, "decode.replicas: must be > 0"),
    ({"prefill.threads": "two"}, "prefill.threads: expected an integer"),
    ({"decode.block_size": 12}, "decode.block_size: must be a power of two"),
    ({"mode": "mixed"}, "mode: must be disaggregated, colocated or adaptive"),
    ({"kv_transfer.transport": "rdma"}, "kv_transfer.transport: must be ucx, zmq or inproc"),
    ({"router.port": 70000}, "router.port: must be a port number"),
    ({"decode.reserve_fraction": 1.5}, "decode.reserve_fraction: must be in (0, 1]"),
    ({"kv_transfer.transport": "inproc"}, "inproc works only with mode: colocated"),
    ({"mode": "adaptive", "autoscale.enabled": True}, "autoscale.enabled: not with mode: adaptive"),
    ({"decode": 3}, "decode: expected a mapping"),
    ({"prefill.kv_cache_gb": float("nan")}, "prefill.kv_cache_gb: expected a finite number"),
    ({"kv_transfer.lease_s": float("inf")}, "kv_transfer.lease_s: expected a finite number"),
    ({"prefill.transfer_cpus": 1}, "prefill.transfer_cpus: must be a list"),
    ({"prefill.transfer_cpus": [1, 1]}, "prefill.transfer_cpus: must be a list of distinct core numbers"),
    ({"prefill.transfer_cpus": [-1]}, "prefill.transfer_cpus: must be a list of distinct core numbers"),
    ({"prefill.transfer_cpus": [True]}, "prefill.transfer_cpus: must be a list of distinct core numbers"),
])
def test_bad_keys_and_values_are_named(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(LOCAL, override)
    assert needle in str(e.value)


def test_overrides_and_numbers_coerce():
    cfg = load_config(LOCAL, {"decode.kv_cache_gb": 2, "mode": "colocated", "kv_transfer.transport": "inproc"})
    assert cfg.decode.kv_cache_gb == 2.0 and isinstance(cfg.decode.kv_cache_gb, float)
    assert cfg.mode == "colocated"
    assert load_config(LOCAL, {"prefill.transfer_cpus": [1]}).prefill.transfer_cpus == (1,)  # a tuple: frozen


def test_override_into_an_empty_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("decode:\n")
    assert load_config(f, {"decode.replicas": 3}).decode.replicas == 3


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_metrics_ports_may_be_null_but_not_out_of_range():
    cfg = load_config(None, {"metrics.port": None, "metrics.worker_port": 0})
    assert cfg.metrics.port is None and cfg.metrics.worker_port == 0
    with pytest.raises(ConfigError, match="metrics.port"):
        load_config(None, {"metrics.port": 70000})
    with pytest.raises(ConfigError, match="metrics.worker_port"):
        load_config(None, {"metrics.worker_port": "x"})


def test_engine_configs_compile_decode_only_where_it_decodes():
    from router.pools import engine_configs
    prefill, decode = engine_configs(load_config(LOCAL), "/some/model")
    assert prefill.compile_decode is False and decode.compile_decode is True
    _, decode = engine_configs(load_config(LOCAL, {"decode.compile_decode": False}), "/some/model")
    assert decode.compile_decode is False
    with pytest.raises(ConfigError, match="decode.compile_decode"):
        load_config(LOCAL, {"decode.compile_decode": "sometimes"})


def test_jump_forward_reaches_the_decode_engine_and_is_bounded():
    from router.pools import engine_configs
    assert engine_configs(load_config(LOCAL), "/some/model")[1].jump_forward == 0
    _, decode = engine_configs(load_config(LOCAL, {"decode.jump_forward": 16}), "/some/model")
    assert decode.jump_forward == 16
    for bad in (65, -1, True, "8"):
        with pytest.raises(ConfigError, match="decode.jump_forward"):
            load_config(LOCAL, {"decode.jump_forward": bad})


def test_dequantize_reaches_both_pools_engines():
    from router.pools import engine_configs
    assert all(not c.dequantize for c in engine_configs(load_config(LOCAL), "/some/model"))
    cfg = load_config(LOCAL, {"dequantize": True, "dtype": "bfloat16"})
    assert all(c.dequantize and c.dtype == "bfloat16" for c in engine_configs(cfg, "/some/model"))
    with pytest.raises(ConfigError, match="dequantize: must be true or false"):
        load_config(LOCAL, {"dequantize": "yes"})


def test_prefill_quantization_is_its_own_and_off_by_default():
    """Prefill serves the model as loaded unless told; given the decode pool's value both pools
    serve one format (one served-weights cache entry a node's workers share)."""
    from router.pools import engine_configs
    prefill, decode = engine_configs(load_config(LOCAL, {"decode.quantization": "int4"}), "/m")
    assert prefill.quantization is None and decode.quantization == "int4"
    prefill, decode = engine_configs(load_config(LOCAL, {"prefill.quantization": "int4",
                                                         "decode.quantization": "int4"}), "/m")
    assert prefill.quantization == decode.quantization == "int4"
    assert prefill.compile_decode is False  # still a prefill worker's engine
    with pytest.raises(ConfigError, match="prefill.quantization: must be none, int8"):
        load_config(LOCAL, {"prefill.quantization": "int3"})


@pytest.mark.parametrize("model,served", [
    (None, "SmolLM2-135M-Instruct"),  # the bundled folder's name, as before
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b"),  # a catalogue model: its name, not the cache folder's
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
])
def test_served_model_name(model, served):
    from router.nodes import served_name
    assert served_name(model, "/cache/SmolLM2-135M-Instruct") == served


def test_served_model_name_of_a_gguf_file_is_its_stem_and_of_a_folder_its_name(tmp_path):
    from router.nodes import served_name
    f = tmp_path / "My-Model.Q4_K_M.gguf"
    f.write_bytes(b"GGUF")
    assert served_name(str(f), "/cache/gguf/My-Model.Q4_K_M-0123456789abcdef") == "My-Model.Q4_K_M"
    assert served_name(str(tmp_path), str(tmp_path)) == tmp_path.name


def test_node_errors_say_how_each_kind_of_model_gets_onto_a_node():
    from router.nodes import _remedy, _what
    assert "`pdserve pull gemma3-270m` on every worker node" in _remedy("gemma3-270m")
    assert _what("gemma3-270m") == "catalogue model 'gemma3-270m'"
    assert _what("/m/x.gguf") == "GGUF file '/m/x.gguf'" and "same path" in _remedy("/m/x.gguf")


def test_kv_cache_gb_auto_per_pool():
    """``kv_cache_gb: auto`` (engine/kv_budget.py) per pool; the engine config keeps a number
    until the worker sizes its cache on its node (WorkerOptions.kv_cache_auto)."""
    from router.pools import engine_configs
    cfg = load_config(LOCAL, {"prefill.kv_cache_gb": 0.5})
    assert cfg.decode.kv_cache_gb == "auto" and cfg.prefill.kv_cache_gb == 0.5  # auto is the default
    prefill, decode = engine_configs(cfg, "/m")
    assert prefill.cache.memory_gb == 0.5 and decode.cache.memory_gb > 0
    assert ClusterConfig().prefill.kv_cache_gb == ClusterConfig().decode.kv_cache_gb == "auto"
    with pytest.raises(ConfigError, match="decode.kv_cache_gb: auto sizes a CPU worker's cache"):
        load_config(LOCAL, {"device": "cuda", "prefill.kv_cache_gb": 1.0})
    load_config(LOCAL, {"device": "cuda", "prefill.kv_cache_gb": 1.0, "decode.kv_cache_gb": 2.0})
    with pytest.raises(ConfigError, match="decode.kv_cache_gb: must be a number of GiB or auto, got 'lots'"):
        load_config(LOCAL, {"decode.kv_cache_gb": "lots"})
    with pytest.raises(ConfigError, match="prefill.kv_cache_gb: must be > 0"):
        load_config(LOCAL, {"prefill.kv_cache_gb": 0})
