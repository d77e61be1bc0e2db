"""`pdserve bench --plot-dir` writes its three PNGs (latency CDFs, per-token latency over time,
goodput vs rate for a sweep)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.plots import plot_all

pytest.importorskip("matplotlib")


def _result(i: int, kind: str = "chat", error: str | None = None):
    t0 = 100.0 + i
    return SimpleNamespace(error=error, ttft=0.05 + 0.01 * i, tpot=0.02, itls=[0.02, 0.021, 0.03],
                           sent=t0, batch_times=[t0 + 0.05, t0 + 0.07, t0 + 0.09], spec=SimpleNamespace(kind=kind))


def _run(rate: float, goodput: float):
    return {"rate": rate, "results": [_result(i) for i in range(5)] + [_result(9, "long"), _result(7, error="x")],
            "summary": {"all": {"goodput_rps": goodput}}}


def test_plots_are_written(tmp_path):
    results = {"disaggregated": {"runs": [_run(0.5, 0.4), _run(1.0, 0.7)]},
               "colocated": {"runs": [_run(0.5, 0.3)]}}
    paths = plot_all(results, str(tmp_path / "plots"))
    assert [p.name for p in paths] == ["latency_cdf.png", "tpot_over_time.png", "goodput_vs_rate.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_no_sweep_no_goodput_plot(tmp_path):
    paths = plot_all({"colocated": {"runs": [_run(0.5, 0.3)]}}, str(tmp_path))
    assert [p.name for p in paths] == ["latency_cdf.png", "tpot_over_time.png"]


def test_seeds_of_one_rate_or_a_closed_loop_are_no_sweep(tmp_path):
    """--seeds repeats a rate: runs of one rate (or of no rate, a closed loop) plot no goodput
    line; a sweep with seeds plots each rate once (its median, least and most as bars)."""
    one = {"colocated": {"runs": [_run(0.5, 0.3), _run(0.5, 0.4)]},
           "adaptive": {"runs": [{**_run(0.5, 0.3), "rate": None}, {**_run(0.5, 0.3), "rate": None}]}}
    assert [p.name for p in plot_all(one, str(tmp_path / "a"))] == ["latency_cdf.png", "tpot_over_time.png"]
    sweep = {"colocated": {"runs": [_run(0.5, 0.3), _run(1.0, 0.5), _run(0.5, 0.4), _run(1.0, 0.6)]}}
    assert [p.name for p in plot_all(sweep, str(tmp_path / "b"))][-1] == "goodput_vs_rate.png"


def test_an_adaptive_run_plots_its_roles_over_time(tmp_path):
    run = _run(0.5, 0.3)
    for r in run["results"]:
        r.end = r.sent + 1.0
    run["started"] = 100.0
    switches = [(99.0, "prefill-0", "prefill", "decode", "why"), (101.5, "decode-0", "decode", "prefill", "why"),
                (104.0, "decode-0", "prefill", "decode", "why")]
    paths = plot_all({"adaptive": {"runs": [run], "role_switches": switches}}, str(tmp_path))
    assert [p.name for p in paths] == ["latency_cdf.png", "tpot_over_time.png", "roles_over_time.png"]
    assert paths[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_roles_over_time_start_at_the_first_request_and_stop_at_the_last_response():
    from bench.plots import roles_over_time
    run = _run(0.5, 0.3)
    for r in run["results"]:
        r.end = r.sent + 1.0  # the last response at 110.0
    run["started"] = 100.0
    switches = [(99.0, "p", "prefill", "decode"), (101.5, "p", "decode", "prefill"), (104.0, "p", "prefill", "decode"),
                (150.0, "p", "decode", "prefill")]  # (the last one after every response: not drawn)
    assert roles_over_time({"runs": [run], "role_switches": switches}) == (
        100.0, [(0.0, 0), (1.5, 1), (4.0, 0), (10.0, 0)])


def test_roles_over_time_take_the_runs_span_from_their_own_clock():
    """Switch times are wall-clock (the router's), a result's times perf_counter's: the span
    comes from each run's results, placed at the run's wall-clock start."""
    from bench.plots import roles_over_time
    run = _run(0.5, 0.3)
    for r in run["results"]:
        r.end = r.sent + 1.0  # perf_counter: the run spans 100.0 .. 110.0
    run["started"] = 1_700_000_000.0
    switches = [(1_700_000_002.0, "p", "prefill", "decode"), (1_700_000_050.0, "p", "decode", "prefill")]
    assert roles_over_time({"runs": [run], "role_switches": switches})[1] == [(0.0, 1), (2.0, 0), (10.0, 0)]
