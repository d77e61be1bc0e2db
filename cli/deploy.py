"""Checks for `ray up` cluster files (deploy/cluster-*.yaml) before they reach a cloud.

``check_cluster_file`` runs Ray's own validation (the JSON schema and checks ``ray up`` runs,
offline), then what pdserve needs on top: per node type ``min_workers <= max_workers`` (Ray
checks only the global sum), a node type advertising each of the ``prefill`` and ``decode``
resources, a head node without them, a head start command that runs
``pdserve serve --address auto``, Ray's token authentication on in every start command, no
dashboard on every interface, and node setup that pulls the model the pdserve config names.

``python -m cli.deploy model CONFIG`` prints the catalogue model a pdserve config serves
(nothing when there is none to pull): a ``ray up`` file's setup commands pull it on every node
with ``pdserve pull "$(...)"``, so the node setup follows the config's ``model:``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
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
    # every node resolves the model from its own cache (router.nodes), the head too (its tokenizer)
    if not any("pdserve pull" in c for c in cfg.get("setup_commands", [])):
        raise ValueError(f"{path}: setup_commands must run `pdserve pull` for the model the pdserve config names "
                         "(`pdserve pull \"$(python -m cli.deploy model CONFIG)\"`): every node needs it")
    return cfg


def catalogue_model(config: str | Path) -> str | None:
    """The catalogue model the pdserve config at ``config`` serves, which every node must pull;
    None when its ``model:`` is null or the bundled one (installed with pdserve), a file or a folder.

    Raises:
        router.config.ConfigError: the config does not load.
    """
    from engine.models import catalog
    from router.config import load_config
    model = load_config(config).model
    entry = catalog.lookup(model) if model is not None else None
    return entry.name if entry is not None and not entry.bundled else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cli.deploy", description="Helpers for `ray up` node setup.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="print the catalogue model a pdserve config serves (nothing if none to pull)")
    m.add_argument("config", help="the pdserve cluster config, e.g. deploy/cluster.yaml")
    args = p.parse_args(argv)
    try:
        name = catalogue_model(args.config)
    except ValueError as e:
        print(f"cli.deploy: error: {e}", file=sys.stderr)
        return 2
    if name:
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
