"""``kv_cache_gb: auto``: the KV cache a worker gets is what its node has left.

    left   = available - weights - reserve
    kv     = left * weight(role) / sum(weight(r) for every worker the node hosts)
    reserve = RESERVE_GB + RESERVE_FRACTION * available + PER_WORKER_GB * workers on the node

- ``available``: the node's MemAvailable (/proc/meminfo) when the worker starts, or what its
  cgroup still allows (limit - usage) if that is lower (a container sees the host's meminfo).
- ``weights``: the weights as served, counted once per node: the workers of one model on a node
  share them (issue 47). Estimated before the load from the checkpoint (every parameter at the
  served dtype: an upper bound when the decode pool quantizes; a GGUF served as shipped: its
  file's size).
- ``reserve``: the OS, page cache and Ray's own processes (1.5 GB + 10% of what is available)
  and each worker's runtime beyond its weights and KV cache (Python, torch, tokenizer: the
  issue's 0.5 GB per worker).
- The split by role: a decode worker holds every running request's KV (prompt and generated
  tokens) for the request's whole life, and its batch size, so its throughput, is what fits; a
  prefill worker holds a prompt's KV only until the decode worker acknowledges the transfer, a
  few prompts at a time. So decode weighs 3, prefill 1 (the fixed figures before auto was the
  default were 1.0 vs 0.5 GB);
  colocated and adaptive workers (one engine in both roles) weigh like decode.
- A worker whose share is below ``FLOOR_GIB`` does not start: :class:`KVBudgetError` says how
  the node's memory was spent.

Units: ``CacheConfig.memory_gb`` is GiB (2**30 bytes, engine.llm_engine); the arithmetic here is
in bytes and its result in GiB. Everything is a pure function of injected numbers but
:func:`node_available_bytes` (reads /proc and the cgroup) and :func:`estimate_weights_bytes`
(reads checkpoint headers).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
RESERVE_GB = 1.5
RESERVE_FRACTION = 0.10
PER_WORKER_GB = 0.5
FLOOR_GIB = 0.05  # a few hundred blocks of a small model: below that a worker serves nobody
ROLE_WEIGHT = {"prefill": 1, "decode": 3, "colocated": 3, "adaptive": 3}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVBudgetError(ValueError):
    """Nothing (or less than the floor) is left for a worker's KV cache; the message says why."""


@dataclass(frozen=True)
class KVBudget:
    """How one worker's KV cache was sized (bytes, but ``kv_cache_gib``)."""

    available: int
    weights: int
    reserve: int
    share: float  # this worker's part of what is left
    kv_cache_gib: float  # CacheConfig.memory_gb

    def describe(self) -> str:
        return (f"KV cache {self.kv_cache_gib:.2f} GiB = ({self.available / 1e9:.2f} GB available - "
                f"{self.weights / 1e9:.2f} GB weights - {self.reserve / 1e9:.2f} GB reserve) x {self.share:.3f}")


def kv_budget(available: int, weights: int, role: str, workers: dict[str, int], *,
              reserve_gb: float = RESERVE_GB, reserve_fraction: float = RESERVE_FRACTION,
              per_worker_gb: float = PER_WORKER_GB, floor_gib: float = FLOOR_GIB) -> KVBudget:
    """The KV cache of one worker of ``role`` on a node (module docstring).

    Args:
        available: bytes the node has available now (:func:`node_available_bytes`).
        weights: bytes of the weights as served, once (:func:`estimate_weights_bytes`).
        role: this worker's: prefill, decode, colocated or adaptive.
        workers: how many workers of each role the node hosts, this one included.
    Returns:
        The budget; ``kv_cache_gib`` for ``CacheConfig.memory_gb``.
    Raises:
        KVBudgetError: the share is below ``floor_gib`` (with the arithmetic in the message).
        ValueError: an unknown role, or ``workers`` without this worker.
    """
    unknown = sorted(set(workers) - set(ROLE_WEIGHT)) + ([] if role in ROLE_WEIGHT else [role])
    if unknown:
        raise ValueError(f"unknown worker role {unknown[0]!r}; valid: {', '.join(ROLE_WEIGHT)}")
    if workers.get(role, 0) < 1:
        raise ValueError(f"workers {workers} must count this {role} worker")
    count = sum(workers.values())
    reserve = int((reserve_gb + per_worker_gb * count) * 1e9 + reserve_fraction * available)
    share = ROLE_WEIGHT[role] / sum(ROLE_WEIGHT[r] * n for r, n in workers.items())
    left = available - weights - reserve
    budget = KVBudget(available, weights, reserve, share, max(0, left) * share / GIB)
    if budget.kv_cache_gib < floor_gib:
        raise KVBudgetError(
            f"kv_cache_gb auto: no room for a {role} worker's KV cache on this node: {available / 1e9:.2f} GB "
            f"available - {weights / 1e9:.2f} GB of weights - {reserve / 1e9:.2f} GB reserve ({reserve_gb} GB + "
            f"{reserve_fraction:.0%} + {per_worker_gb} GB for each of {count} workers) leaves "
            f"{left / 1e9:.2f} GB, its share {share:.3f} of it is below the floor of {floor_gib} GiB; "
            f"free memory, run fewer workers per node, or give kv_cache_gb as a number")
    return budget


def host_workers(nodes: list[dict], node_id: str) -> dict[str, int]:
    """How many prefill and decode workers the machine of Ray node ``node_id`` hosts: the
    ``prefill``/``decode`` resources of every live Ray node with its hostname (several Ray nodes
    on one machine, as deploy/onprem-loopback.yaml starts them, share its memory), or of that
    node alone where Ray names no hostname. ``nodes``: ``ray.nodes()``."""
    live = [n for n in nodes if n.get("Alive", True)]
    host = next((n.get("NodeManagerHostname") for n in live if n.get("NodeID") == node_id), None)
    here = [n.get("Resources", {}) for n in live
            if n.get("NodeID") == node_id or (host and n.get("NodeManagerHostname") == host)]
    return {r: sum(int(res.get(r, 0)) for res in here) for r in ("prefill", "decode")}


def node_available_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int:
    """The node's MemAvailable, or its cgroup's limit minus usage if lower (v2, else v1).

    Raises:
        KVBudgetError: no /proc/meminfo (not Linux): give kv_cache_gb as a number.
    """
    try:
        text = Path(meminfo).read_text()
    except OSError as e:
        raise KVBudgetError(f"kv_cache_gb auto needs {meminfo} (Linux): give a number instead ({e})") from None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "MemAvailable" not in fields:
        raise KVBudgetError(f"kv_cache_gb auto: no MemAvailable in {meminfo}: give a number instead")
    available = int(fields["MemAvailable"].split()[0]) * 1024
    root = Path(cgroup)
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit, usage = (root / limit_file).read_text().strip(), (root / usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:  # "max", or v1's "no limit"
            available = min(available, max(0, int(limit) - int(usage)))
        break
    return available


def estimate_weights_bytes(path: str | Path, dtype: str, dequantize: bool = False) -> int:
    """The weights as served from the model folder ``path``, before loading: every parameter at
    ``dtype`` (quantized serving holds less: this is an upper bound), or a GGUF served as shipped
    (not ``dequantize``): the file's size. Reads only headers.

    Raises:
        KVBudgetError: no weights found to estimate from.
    """
    from engine.models import gguf  # heavy: torch (this module is imported torch-free)
    path, per = Path(path), DTYPE_BYTES[dtype]
    src = gguf.source(path)
    if src is not None:
        if not dequantize:
            return src.stat().st_size
        return per * sum(int(t.n_elements) for t in gguf.open_reader(src).tensors)
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if files:
        return per * sum(_safetensors_params(f) for f in files)
    bins = list(path.glob("pytorch_model*.bin"))
    if bins:  # no header to read: assume half precision stored (fp32 stored: an over-estimate)
        return sum(f.stat().st_size for f in bins) * max(1, per // 2)
    raise KVBudgetError(f"kv_cache_gb auto: no weights in {str(path)!r} to estimate their size from")


def _safetensors_params(path: Path) -> int:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
