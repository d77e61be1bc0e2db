"""Checks for `ray up` cluster files (deploy/cluster-*.yaml) before they reach a cloud.

``check_cluster_file`` runs Ray's own validation (the JSON schema and checks ``ray up`` runs,
offline), then what pdserve needs on top: per node type ``min_workers <= max_workers`` (Ray
checks only the global sum), a node type advertising each of the ``prefill`` and ``decode``
resources, a head node without them, a head start command that runs
``pdserve serve --address auto``, Ray's token authentication on in every start command, and
no dashboard on every interface.
"""

from __future__ import annotations

import copy
from pathlib import Path


def check_cluster_file(path: str | Path) -> dict:
    """Validate a `ray up` config; returns it as Ray prepares it.

    Raises:
        ValueError: (or Ray's jsonschema ValidationError, a ValueError subclass is not
            guaranteed) with a message naming the problem.
    """
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a mapping")
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    types = cfg["available_node_types"]
    for name, t in types.items():
        lo, hi = t.get("min_workers", 0), t.get("max_workers", cfg["max_workers"])
        if lo > hi:
            raise ValueError(f"{path}: node type {name}: min_workers {lo} > max_workers {hi}")
    for res in ("prefill", "decode"):
        if not any(t.get("resources", {}).get(res, 0) > 0 for t in types.values()):
            raise ValueError(f"{path}: no node type advertises the {res!r} resource: the {res} pool cannot be placed")
    head = types[cfg["head_node_type"]]
    if set(head.get("resources", {})) & {"prefill", "decode"}:
        raise ValueError(f"{path}: the head node type advertises prefill/decode: workers would land on the router")
    if not any("pdserve serve" in c and "--address auto" in c for c in cfg.get("head_start_ray_commands", [])):
        raise ValueError(f"{path}: head_start_ray_commands must start `pdserve serve --address auto`")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for c in cfg.get(key, []):
            if ("ray start" in c or "pdserve serve" in c) and "RAY_AUTH_MODE=token" not in c:
                raise ValueError(f"{path}: {key}: `{c.strip()[:60]}...` runs Ray without RAY_AUTH_MODE=token: "
                                 "anyone who reaches its ports could run code on the cluster")
            if "--dashboard-host=0.0.0.0" in c:
                raise ValueError(f"{path}: {key}: the dashboard on 0.0.0.0 serves Ray's job API to anyone")
    return cfg
