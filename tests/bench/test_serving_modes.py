"""``bench/serving.py --compare --modes``: which clusters a comparison starts, in order."""

from __future__ import annotations

import pytest

from bench.loadgen import BenchError
from bench.serving import _compare_modes, build_parser


def test_default_modes_are_the_three_fixed_ones_and_a_subset_keeps_its_order():
    args = build_parser().parse_args(["--compare"])
    assert list(_compare_modes(args)) == ["disaggregated", "colocated", "colocated-chunked"]
    args = build_parser().parse_args(["--compare", "--modes", "disaggregated-local,disaggregated"])
    modes = _compare_modes(args)
    assert list(modes) == ["disaggregated-local", "disaggregated"]
    assert modes["disaggregated-local"]["mode"] == "disaggregated"


@pytest.mark.parametrize("modes", ["colocated,nope", ","])
def test_an_unknown_or_empty_mode_list_is_refused(modes):
    with pytest.raises(BenchError, match="--modes"):
        _compare_modes(build_parser().parse_args(["--compare", "--modes", modes]))
