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


def test_all_is_every_mode_and_model_reaches_every_clusters_config():
    args = build_parser().parse_args(["--compare", "--modes", "all", "--model", "qwen2.5-coder-1.5b"])
    assert list(_compare_modes(args)) == ["disaggregated", "colocated", "colocated-chunked", "disaggregated-local",
                                          "adaptive"]
    from bench.modes import cluster_config
    for name, mode in _compare_modes(args).items():
        assert cluster_config(name, mode, args).model == "qwen2.5-coder-1.5b"
    assert cluster_config("colocated", {}, build_parser().parse_args(["--compare"])).model != "qwen2.5-coder-1.5b"


@pytest.mark.parametrize("modes", ["colocated,nope", ","])
def test_an_unknown_or_empty_mode_list_is_refused(modes):
    with pytest.raises(BenchError, match="--modes"):
        _compare_modes(build_parser().parse_args(["--compare", "--modes", modes]))


def test_prefix_compare_on_a_disaggregated_cluster_reports_the_kv_bytes_ratio(capsys):
    """--prefix-cluster disaggregated: blind and aware on 1 prefill + 2 decode workers; the
    report divides the KV MB the decode workers received (aware / blind)."""
    from bench.serving import _report, prefix_compare
    args = build_parser().parse_args(["--prefix-compare", "--prefix-cluster", "disaggregated"])
    modes = prefix_compare(args.prefix_cluster)
    assert [m["router.prefix_aware"] for m in modes.values()] == [False, True]
    assert {m["mode"] for m in modes.values()} == {"disaggregated"} and modes["prefix-aware"]["decode.replicas"] == 2
    assert prefix_compare("colocated")["prefix-aware"]["mode"] == "colocated"

    def run(ttft_p90, mb, hit):
        return {"runs": [{"rate": None, "summary": {"all": {"ttft_ms_p90": ttft_p90, "kv_bytes_mb": mb,
                                                            "decode_prefix_hit_rate": hit}}}],
                "max_goodput_rate": None}
    args.dataset = "shared-prefix"
    flat = _report({"prefix-blind": run(900.0, 80.0, 0.2), "prefix-aware": run(300.0, 20.0, 0.8)}, args)
    assert flat["kv_bytes_ratio_aware_vs_blind"] == 0.25 and flat["ttft_p90_ratio_prefix_blind_vs_aware"] == 3.0
    # what the decode-side hits predict: (1 - 0.8) / (1 - 0.2)
    assert flat["kv_bytes_ratio_expected_from_hits"] == pytest.approx(0.25)
    out = capsys.readouterr().out
    assert "prefix-aware / prefix-blind = 0.25" in out and "20% blind, 80% aware: expected ratio 0.25" in out


def test_adaptive_ratios_compare_with_the_best_fixed_mode_and_colocated_chats(capsys):
    """--compare with adaptive: goodput over the best fixed mode's (a sweep's highest rate
    within the SLOs where there is one, else one run's rate within them), chats' p99 TPOT over
    colocated's, and the switches counted."""
    from bench.serving import _report
    args = build_parser().parse_args(["--compare", "--modes", "disaggregated,colocated,adaptive"])
    assert _compare_modes(args)["adaptive"]["mode"] == "adaptive"

    def run(goodput, tpot_chat, switches=None):
        out = {"runs": [{"rate": None, "summary": {"all": {"goodput_rps": goodput},
                                                  "chat": {"tpot_ms_p99": tpot_chat}, "long": {}}}],
               "max_goodput_rate": None}
        if switches is not None:
            out["role_switches"] = switches
        return out
    flat = _report({"disaggregated": run(0.05, 100.0), "colocated": run(0.08, 400.0),
                    "adaptive": run(0.12, 160.0, [(0.0, "decode-0", "decode", "prefill")])}, args)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == pytest.approx(1.5)  # over colocated's 0.08
    assert flat["p99_tpot_ratio_adaptive_vs_colocated_mix"] == pytest.approx(0.4)
    assert flat["role_switches"] == 1
    assert "adaptive / best fixed mode (colocated) = 1.50" in capsys.readouterr().out


def test_the_report_logs_each_role_switch_with_its_reason_from_the_first_request():
    from types import SimpleNamespace

    from bench.serving import _report
    from router.autoscale import Signals
    args = build_parser().parse_args(["--compare", "--modes", "adaptive"])
    # one request, sent at 10 s and answered at 30 s (perf_counter); the run started at 1000 (wall clock)
    run = {"rate": None, "started": 1000.0, "results": [SimpleNamespace(sent=10.0, end=30.0)],
           "summary": {"all": {"goodput_rps": 0.1}}}
    why = "prefill: no prompt backlog and TTFT well under target (wanted for 30 s)"
    switches = [(1012.5, "prefill-0", "prefill", "decode", why)]
    # decisions before the first request and after the last response are left out
    trace = [(999.0, Signals(1), Signals(1), None),
             (1002.5, Signals(1, ttft_p90_s=0.4), Signals(1, kv_utilization=0.41, tpot_p90_s=0.1204), ("prefill", "decode")),
             (1025.0, Signals(0), Signals(2), None)]
    flat = _report({"adaptive": {"runs": [run], "max_goodput_rate": None, "role_switches": switches,
                                 "roles_trace": trace}}, args)
    assert flat["adaptive_role_switch_log"] == [[12.5, "prefill", "decode", why]]
    assert flat["adaptive_roles_trace"] == [[2.5, 0, 400, 0.41, 120, "prefill->decode"]]
    assert flat["adaptive_prefill_workers_over_time"] == [[0.0, 1], [12.5, 0], [20.0, 0]]


def test_on_a_sweep_goodput_is_the_highest_rate_within_the_slos_and_none_is_zero(capsys):
    from bench.serving import _report
    args = build_parser().parse_args(["--compare", "--modes", "colocated,adaptive", "--rates", "0.5,1"])

    def sweep(best, tpot_chat):
        runs = [{"rate": r, "summary": {"all": {"goodput_rps": 0.3}, "chat": {"tpot_ms_p99": tpot_chat}}}
                for r in (0.5, 1.0)]
        return {"runs": runs, "max_goodput_rate": best, "role_switches": []}
    flat = _report({"colocated": sweep(1.0, 200.0), "adaptive": sweep(None, 90.0)}, args)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == 0.0  # (not one run's requests/s)
    # no fixed mode within the SLOs at the lowest rate: no ratio, a lower bound (adaptive's / 0.5)
    flat = _report({"colocated": sweep(None, 200.0), "adaptive": sweep(1.0, 90.0)}, args)
    assert "goodput_ratio_adaptive_vs_best_fixed_mix" not in flat
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix_lower_bound"] == 2.0
    assert "adaptive / best fixed > 2.00" in capsys.readouterr().out
    flat = _report({"colocated": sweep(0.5, 200.0), "adaptive": sweep(1.0, 90.0)}, args)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == 2.0
    # chats' p99 TPOT over colocated's at each rate (the same requests); the key: the worst
    flat = _report({"colocated": sweep(0.5, 200.0), "adaptive": sweep(1.0, 90.0)}, args)
    assert flat["p99_tpot_ratio_adaptive_vs_colocated_mix"] == pytest.approx(0.45)
    col, ada = sweep(0.5, 200.0), sweep(1.0, 90.0)
    col["runs"][1]["summary"]["chat"]["tpot_ms_p99"] = 900.0
    ada["runs"][0]["summary"]["chat"]["tpot_ms_p99"] = 150.0
    flat = _report({"colocated": col, "adaptive": ada}, args)
    assert flat["p99_tpot_ratio_adaptive_vs_colocated_mix_by_rate"] == {"0.5": 0.75, "1": 0.1}
    assert flat["p99_tpot_ratio_adaptive_vs_colocated_mix"] == pytest.approx(0.75)


@pytest.mark.parametrize("dataset", ["mix", "shared-prefix", "phase", "random"])
def test_each_rate_of_a_sweep_sends_other_prompts_of_the_same_shape(dataset):
    """The same prompts at every rate made every rate after the first a prefix-cache hit (0.97
    on the mix): the sweep compared a warm cache with a cold one. Each rate draws its own
    tokens, in the same shape (kinds, lengths, answers: only the rate changes); a mode's run at
    a rate is the same as any other mode's there; the warm-up's prompts are none of them."""
    from bench.serving import workload
    args = build_parser().parse_args(["--compare", "--dataset", dataset, "--rates", "0.5,1,2", "--num-requests", "12",
                                      "--prompt-tokens", "20:300"])
    runs = [workload(args, 1000, k) for k in range(3)]
    assert [workload(args, 1000, k) for k in range(3)] == runs  # every mode: the same at a rate
    shape = [[(s.kind, len(s.token_ids), s.max_tokens) for s in r] for r in runs]
    assert shape[0] == shape[1] == shape[2] and len({n for _, n, _ in shape[0]}) > 1
    blocks = [{tuple(s.token_ids[:16]) for s in r} for r in runs]  # (a 16-token block: a prefix hit)
    assert not blocks[0] & blocks[1] and not blocks[1] & blocks[2] and not blocks[0] & blocks[2]
    warm = workload(args, 1000, n=12, seed=args.seed + 1)  # (as bench_server's warm-up)
    assert not {tuple(s.token_ids[:16]) for s in warm} & set().union(*blocks)
