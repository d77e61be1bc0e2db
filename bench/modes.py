"""The clusters the serving benchmark starts, by name: each mode's config overrides, in one place.

``bench/serving.py`` (``--compare``, ``--prefix-compare``) starts them; the simulator's
validation (``bench/sim/validate.py``) starts the same ones and builds its simulated clusters
from their configs, so a mode's settings are made here and nowhere else.
"""

from __future__ import annotations

COMPARE = {
    "disaggregated": {"mode": "disaggregated", "prefill.threads": 1, "decode.threads": 1},
    "colocated": {"mode": "colocated", "decode.threads": 2, "decode.chunked_prefill": False,
                  "decode.max_batched_tokens": 8192},
    "colocated-chunked": {"mode": "colocated", "decode.threads": 2, "decode.chunked_prefill": True},
    "disaggregated-local": {"mode": "disaggregated", "prefill.threads": 1, "decode.threads": 1},
    # Two workers that switch roles by load (router/roles.py): one prefill + one decode, or (no
    # prompt backlog, decode memory short) two decode workers that prefill their own prompts.
    # The controller's defaults, as a user gets them, but roles.min_prefill 0: with its default
    # of 1 (and min_decode 1) two workers could never switch at all.
    "adaptive": {"mode": "adaptive", "prefill.replicas": 1, "decode.replicas": 1, "prefill.threads": 1,
                 "decode.threads": 1, "roles.min_prefill": 0},
}
# Separately labelled rows (in --modes all; never what a key compares): settings tuned for one
# mode. adaptive-tuned: faster decisions (1 s), switches (3 s) and idle hand-backs (10 s), the
# benchmark's SLOs as the controller's targets and a backlog of about one long prompt (1,024
# tokens) asking for a prefill worker (cluster_config).
TUNED = {"adaptive-tuned": {**COMPARE["adaptive"], "roles.interval_s": 1.0, "roles.switch_delay_s": 3.0,
                            "roles.idle_delay_s": 10.0}}
# --compare --kv-gb: every mode's workers share one total of KV memory, split by the weights
# `kv_cache_gb: auto` gives their roles (engine/kv_budget.py ROLE_WEIGHT: decode, colocated and
# adaptive 3, prefill 1). An adaptive worker runs the decode pool's engine in both roles.
DEFAULT_KV_GB = 2.0
# --prefix-compare: two colocated workers (each prefills what it decodes) whose caches hold about
# half of the groups each: placement decides whether a prompt finds its system prompt cached.
# --prefix-cluster disaggregated: one prefill and two decode workers; the decode workers' caches
# decide how much of each prompt's KV crosses (decode-side prefix reuse): kv_bytes_mb.
PREFIX_CLUSTERS = {"colocated": {"mode": "colocated", "decode.replicas": 2, "decode.threads": 1},
                   "disaggregated": {"mode": "disaggregated", "prefill.replicas": 1, "prefill.threads": 1,
                                     "decode.replicas": 2, "decode.threads": 1}}


def prefix_compare(cluster: str) -> dict[str, dict]:
    base = PREFIX_CLUSTERS[cluster]
    return {"prefix-blind": {**base, "router.prefix_aware": False},
            "prefix-aware": {**base, "router.prefix_aware": True}}


def kv_split(cfg, total_gb: float) -> dict[str, float]:
    """``{pool}.kv_cache_gb`` overrides that give the workers of ``cfg`` (a ClusterConfig: its
    mode and pool sizes) ``total_gb`` GiB of KV in all (the module's note above DEFAULT_KV_GB)."""
    # (heavy: the engine's memory budget, loaded only by what uses it)
    from engine.kv_budget import ROLE_WEIGHT
    n_p, n_d = cfg.prefill.replicas, cfg.decode.replicas
    if cfg.mode == "colocated":
        return {"decode.kv_cache_gb": total_gb / n_d}
    if cfg.mode == "adaptive":  # (each runs the decode pool's engine, in either role)
        return {"decode.kv_cache_gb": total_gb / (n_p + n_d)}
    unit = total_gb / (ROLE_WEIGHT["prefill"] * n_p + ROLE_WEIGHT["decode"] * n_d)
    return {"prefill.kv_cache_gb": unit * ROLE_WEIGHT["prefill"], "decode.kv_cache_gb": unit * ROLE_WEIGHT["decode"]}


def cluster_config(name: str | None, mode: dict, args):
    """The config of the cluster a run starts for ``name`` (a key of COMPARE or of
    prefix_compare; None: the config file's own mode), ``mode`` its overrides: the one place a
    mode's settings are made, for this benchmark and the simulator's validation."""
    # (heavy: the router's config, loaded only by what uses it)
    from router.config import load_config
    model = getattr(args, "model", None)
    over = {**mode, "metrics.port": 0, **({"model": model} if model else {}),
            **({"decode.max_batched_tokens": args.chunk} if name == "colocated-chunked" else {}),
            **({"router.local_prefill_tokens": args.local_prefill_tokens}
               if name in ("disaggregated-local", "adaptive", "adaptive-tuned") else {}),
            # (adaptive-tuned: its roles follow the benchmark's SLOs, and a backlog of about one
            # long prompt asks for a prefill worker)
            **({"autoscale.prefill.target_ttft_ms": args.ttft_slo_ms, "autoscale.decode.target_tpot_ms": args.tpot_slo_ms,
                **({"autoscale.prefill.target_ttft_long_ms": args.ttft_slo_long_ms}
                   if args.ttft_slo_long_ms is not None else {}),
                "autoscale.prefill.target_queued_tokens": 1024} if name in TUNED else {}),
            **({"decode.kv_cache_gb": args.prefix_kv_gb} if args.prefix_compare else {})}
    cfg = load_config(args.config, over)
    if (name in COMPARE or name in TUNED) and getattr(args, "kv_gb", 0):
        # (every mode of a comparison: the same KV memory in all, over the pools the config has)
        cfg = load_config(args.config, {**over, **kv_split(cfg, args.kv_gb)})
    return cfg
