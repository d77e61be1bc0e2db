"""bench/gemv.py runs every kind at every row count it is asked for and reports each (a smoke
run: tiny copies, one pass; its numbers mean nothing)."""

from __future__ import annotations

import json
import platform

import pytest

from bench import gemv


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="native kernels: x86-64 only")
def test_every_kind_and_row_count_is_measured(capsys):
    assert gemv.main(["--shapes", "smollm2", "--kinds", "fp32,int8,int4", "--rows", "1,3", "--mib", "4",
                      "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = {f"{kind}_{name}_r{r}_gb_s" for kind in gemv.KINDS for name in gemv.SHAPES["smollm2"] for r in (1, 3)}
    assert want <= set(out) and all(out[key] > 0 for key in want)
    assert out["read_bandwidth_gb_s"] > 0


def test_an_unknown_kind_is_refused():
    with pytest.raises(SystemExit, match="unknown kinds"):
        gemv.main(["--kinds", "int3"])
