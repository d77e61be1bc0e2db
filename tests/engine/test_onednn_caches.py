"""engine bounds oneDNN's per-shape primitive caches on import (engine/__init__.py: unbounded
by default they grew a prefill worker's RSS with every new prompt length, bench/soak.py), and a
worker may resize them before its first primitive unless the user's environment sized them."""

from __future__ import annotations

import os
import subprocess
import sys

VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
MARK = "PDSERVE_ONEDNN_CACHE_DEFAULTED"
SHOW = "import os, engine; %s; print(','.join(os.environ.get(v, '-') for v in %r))"


def _run(env: dict[str, str], then: str = "pass") -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in VARS + (MARK,)}
    out = subprocess.run([sys.executable, "-c", SHOW % (then, VARS)], env={**clean, **env}, capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return out.stdout.strip().split(",")


def test_importing_the_engine_bounds_both_caches():
    from engine import ONEDNN_CACHE_ENTRIES
    assert _run({}) == [str(ONEDNN_CACHE_ENTRIES)] * 2


def test_a_value_in_the_environment_wins():
    assert _run({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7", "LRU_CACHE_CAPACITY": "9"}) == ["7", "9"]


def test_a_worker_resizes_pdserves_defaults_even_when_inherited_but_never_the_users():
    resize = "engine.bound_onednn_caches(16)"
    assert _run({}, resize) == ["16", "16"]
    # A Ray worker process inherits the driver's environment, defaults and all: still ours.
    inherited = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "128",
                 MARK: "LRU_CACHE_CAPACITY=128,ONEDNN_PRIMITIVE_CACHE_CAPACITY=128"}
    assert _run(inherited, resize) == ["16", "16"]
    # The user sized one of them (to our default's value, even): that one stays.
    assert _run({"LRU_CACHE_CAPACITY": "128"}, resize) == ["16", "128"]
    # ... also when they changed it after a pdserve process had set it (the mark inherited).
    assert _run({**inherited, "LRU_CACHE_CAPACITY": "512"}, resize) == ["16", "512"]
    assert _run({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": ""}, resize)[0] == "16"  # empty: not a size
