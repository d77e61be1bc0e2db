"""kv_cache_gb auto (engine/kv_budget.py): the arithmetic on made-up nodes, the node's memory
from /proc and the cgroup, the weights estimated from a checkpoint's headers."""

from __future__ import annotations

import json
import struct

import pytest

from engine.kv_budget import (GIB, RESERVE_FRACTION, KVBudgetError, estimate_weights_bytes, kv_budget,
                              node_available_bytes)

GB = 10**9


def test_a_node_splits_what_is_left_three_to_one_for_decode():
    # 24 GB available, 6 GB of weights: reserve 1.5 + 2.4 (10%) + 2 x 0.5 = 4.9 GB, 13.1 GB left
    p = kv_budget(24 * GB, 6 * GB, "prefill", {"prefill": 1, "decode": 1})
    d = kv_budget(24 * GB, 6 * GB, "decode", {"prefill": 1, "decode": 1})
    left = 24 * GB - 6 * GB - int(4.9 * GB)
    assert p.reserve == int(4.9 * GB) and d.share == 0.75 and p.share == 0.25
    assert d.kv_cache_gib == pytest.approx(left * 0.75 / GIB) and p.kv_cache_gib == pytest.approx(left * 0.25 / GIB)
    # both together never take more than the node has left
    assert (d.kv_cache_gib + p.kv_cache_gib) * GIB == pytest.approx(left)
    assert "KV cache" in d.describe() and "24.00 GB available" in d.describe()


def test_more_workers_smaller_shares_and_one_engine_takes_all():
    two = kv_budget(64 * GB, 2 * GB, "decode", {"prefill": 2, "decode": 2})
    assert two.share == pytest.approx(3 / 8)
    alone = kv_budget(64 * GB, 2 * GB, "colocated", {"colocated": 1})
    assert alone.share == 1.0 and alone.kv_cache_gib > two.kv_cache_gib
    assert alone.kv_cache_gib * GIB == pytest.approx(64 * GB - 2 * GB - (1.5 + 0.5) * GB - RESERVE_FRACTION * 64 * GB,
                                                      rel=1e-6)
    adaptive = kv_budget(64 * GB, 2 * GB, "adaptive", {"adaptive": 4})
    assert adaptive.share == 0.25


def test_nothing_left_is_a_clear_error():
    with pytest.raises(KVBudgetError) as e:
        kv_budget(8 * GB, 7 * GB, "decode", {"prefill": 1, "decode": 1})
    msg = str(e.value)
    assert "8.00 GB available" in msg and "7.00 GB of weights" in msg and "kv_cache_gb as a number" in msg
    with pytest.raises(KVBudgetError):  # something left, but below the floor
        kv_budget(3 * GB, 0, "prefill", {"prefill": 1, "decode": 1}, floor_gib=0.5)


def test_bad_roles_are_bugs_not_budgets():
    with pytest.raises(ValueError, match="unknown worker role 'router'"):
        kv_budget(8 * GB, 0, "router", {"router": 1})
    with pytest.raises(ValueError, match="must count this decode worker"):
        kv_budget(8 * GB, 0, "decode", {"prefill": 1})


def test_node_memory_is_mem_available_or_the_cgroup_if_lower(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert node_available_bytes(meminfo, cg) == 20000000 * 1024  # no cgroup files
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("1000\n")
    assert node_available_bytes(meminfo, cg) == 20000000 * 1024  # unlimited
    (cg / "memory.max").write_text(f"{8 * GB}\n")
    (cg / "memory.current").write_text(f"{3 * GB}\n")
    assert node_available_bytes(meminfo, cg) == 5 * GB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * GB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1 * GB}\n")
    assert node_available_bytes(meminfo, v1) == 3 * GB
    with pytest.raises(KVBudgetError, match="give a number"):
        node_available_bytes(tmp_path / "absent", cg)


def _safetensors(path, shapes: dict[str, list[int]]) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"},
                         **{k: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for k, s in shapes.items()}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())


def test_weights_are_estimated_from_the_headers_at_the_served_dtype(tmp_path):
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [1000, 64], "b": [64]})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [10, 10, 10]})
    _safetensors(tmp_path / "consolidated.safetensors", {"a": [10**9]})  # (Mistral's duplicate: skipped)
    params = 1000 * 64 + 64 + 1000
    assert estimate_weights_bytes(tmp_path, "float32") == 4 * params
    assert estimate_weights_bytes(tmp_path, "bfloat16") == 2 * params
    with pytest.raises(KVBudgetError, match="no weights"):
        estimate_weights_bytes(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else None, "float32")


def test_the_bundled_models_estimate_is_its_fp32_size(model_path):
    est = estimate_weights_bytes(model_path, "float32")
    assert 0.4 * GB < est < 0.7 * GB  # SmolLM2-135M: 135M parameters (tied embeddings once) x 4 bytes


def test_ray_nodes_of_one_machine_count_together():
    """Two Ray nodes on one host (a prefill and a decode node, deploy/onprem-loopback.yaml) share
    its memory: each worker's share is of every worker there, not of its own node's alone."""
    from engine.kv_budget import host_workers
    nodes = [{"NodeID": "p", "Alive": True, "NodeManagerHostname": "box", "Resources": {"prefill": 4.0, "CPU": 2}},
             {"NodeID": "d", "Alive": True, "NodeManagerHostname": "box", "Resources": {"decode": 4.0}},
             {"NodeID": "x", "Alive": True, "NodeManagerHostname": "other", "Resources": {"decode": 8.0}},
             {"NodeID": "gone", "Alive": False, "NodeManagerHostname": "box", "Resources": {"decode": 2.0}}]
    assert host_workers(nodes, "p") == host_workers(nodes, "d") == {"prefill": 4, "decode": 4}
    assert host_workers(nodes, "x") == {"prefill": 0, "decode": 8}
    unnamed = [{"NodeID": "a", "Resources": {"decode": 1.0}}, {"NodeID": "b", "Resources": {"decode": 1.0}}]
    assert host_workers(unnamed, "a") == {"prefill": 0, "decode": 1}
