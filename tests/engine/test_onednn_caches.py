"""engine bounds oneDNN's per-shape primitive caches on import (engine/__init__.py: unbounded
by default they grew a prefill worker's RSS with every new prompt length, bench/soak.py)."""

from __future__ import annotations

import os
import subprocess
import sys

VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
SHOW = "import os, engine; print(','.join(os.environ.get(v, '-') for v in %r))" % (VARS,)


def _run(env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in VARS}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**clean, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return out.stdout.strip().split(",")


def test_importing_the_engine_bounds_both_caches():
    from engine import ONEDNN_CACHE_ENTRIES
    assert _run({}) == [str(ONEDNN_CACHE_ENTRIES)] * 2


def test_a_value_in_the_environment_wins():
    assert _run({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7", "LRU_CACHE_CAPACITY": "9"}) == ["7", "9"]
