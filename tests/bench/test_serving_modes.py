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
                                          "adaptive", "adaptive-tuned"]
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


def _results(tpots_ms: list[float], kind: str = "chat") -> list:
    """Finished requests whose TPOTs are these (two tokens each, the second ``tpot`` after the first)."""
    from types import SimpleNamespace
    return [SimpleNamespace(spec=SimpleNamespace(kind=kind), error=None, tpot=t / 1e3) for t in tpots_ms]


def test_adaptive_ratios_compare_with_the_best_fixed_mode_and_colocated_chats(capsys):
    """--compare with adaptive: goodput over the best fixed mode's (one run: its requests/s
    within the SLOs), the chats' tail TPOT over colocated's (the p90: a p99 needs 100 samples),
    and the switches counted."""
    from bench.serving import _report
    args = build_parser().parse_args(["--compare", "--modes", "disaggregated,colocated,adaptive"])
    assert _compare_modes(args)["adaptive"]["mode"] == "adaptive"

    def run(goodput, tpot_chat, switches=None):
        # 21 chats, the slowest 4 at tpot_chat: their p90 (the 19th of 21) is tpot_chat
        out = {"runs": [{"rate": None, "summary": {"all": {"goodput_rps": goodput}, "chat": {}, "long": {}},
                         "results": _results([10.0] * 17 + [tpot_chat] * 4) + _results([5000.0], "long")}],
               "max_goodput_rate": None}
        if switches is not None:
            out["role_switches"] = switches
        return out
    flat = _report({"disaggregated": run(0.05, 100.0), "colocated": run(0.08, 400.0),
                    "adaptive": run(0.12, 100.0, [(0.0, "decode-0", "decode", "prefill")])}, args)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == pytest.approx(1.5)  # over colocated's 0.08
    assert flat["p90_tpot_ratio_adaptive_vs_colocated_mix"] == pytest.approx(0.25)  # (the documents' not in it)
    assert "p99_tpot_ratio_adaptive_vs_colocated_mix" not in flat  # (21 chats behind it)
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


def _sweep(attainment: dict, tpot_chat: float = 100.0, seeds=(0,), n: int = 20) -> dict:
    """A mode's runs: ``attainment`` {rate: share within both SLOs} at every seed, ``n`` chats a run."""
    runs = [{"rate": r, "seed": seed, "summary": {"all": {"goodput_rps": 0.3, "slo_attainment": a}},
             "results": _results([tpot_chat] * n)} for seed in seeds for r, a in attainment.items()]
    return {"runs": runs, "max_goodput_rate": None, "role_switches": []}


def test_on_a_sweep_goodput_is_the_highest_rate_within_the_slos_and_none_is_zero(capsys):
    from bench.serving import _report
    args = build_parser().parse_args(["--compare", "--modes", "colocated,adaptive", "--rates", "0.5,1"])
    good, half, none = {0.5: 0.95, 1.0: 0.9}, {0.5: 0.95, 1.0: 0.5}, {0.5: 0.8, 1.0: 0.95}
    flat = _report({"colocated": _sweep(good), "adaptive": _sweep(none)}, args)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == 0.0  # (not one run's requests/s)
    # no fixed mode within the SLOs at the lowest rate: no ratio, a lower bound (adaptive's / 0.5)
    flat = _report({"colocated": _sweep(none), "adaptive": _sweep(good)}, args)
    assert "goodput_ratio_adaptive_vs_best_fixed_mix" not in flat
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix_lower_bound"] == 2.0
    assert "adaptive / best fixed > 2.00" in capsys.readouterr().out
    flat = _report({"colocated": _sweep(half, 200.0), "adaptive": _sweep(good, 90.0)}, args)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == 2.0
    assert flat["p90_tpot_ratio_adaptive_vs_colocated_mix"] == pytest.approx(0.45)
    # chats' tail TPOT over colocated's at each rate (the same requests); the key: the worst
    col, ada = _sweep(half, 200.0), _sweep(good, 90.0)
    col["runs"][1]["results"] = _results([900.0] * 20)
    ada["runs"][0]["results"] = _results([150.0] * 20)
    flat = _report({"colocated": col, "adaptive": ada}, args)
    assert flat["p90_tpot_ratio_adaptive_vs_colocated_mix_by_rate"] == {"0.5": 0.75, "1": 0.1}
    assert flat["p90_tpot_ratio_adaptive_vs_colocated_mix"] == pytest.approx(0.75)


def test_seeds_give_medians_with_the_least_and_most_and_a_p99_only_over_100_samples(capsys):
    """--seeds 3: each mode's goodput is the median of its seeds' (each seed's its own sweep),
    the ratio divides the medians, and the same per seed (same arrivals in every mode) gives
    its least and most; the chats' TPOTs of a rate pool over the seeds, so 3 x 40 chats back a
    p99, 3 x 20 do not."""
    from bench.serving import _report
    args = build_parser().parse_args(["--compare", "--modes", "disaggregated,colocated,adaptive", "--rates",
                                      "0.5,1,2", "--seeds", "3"])
    seeds = (0, 100, 200)

    def mode(by_seed: dict, tpot: float, n: int) -> dict:
        out = _sweep({}, seeds=())
        for seed, best in by_seed.items():
            out["runs"] += _sweep({r: 0.95 if r <= best else 0.5 for r in (0.5, 1.0, 2.0)}, tpot, (seed,), n)["runs"]
        return out
    res = {"disaggregated": mode({0: 0.5, 100: 0.5, 200: 1.0}, 100.0, 40),
           "colocated": mode({0: 1.0, 100: 0.5, 200: 0.5}, 400.0, 40),
           "adaptive": mode({0: 2.0, 100: 1.0, 200: 2.0}, 100.0, 40)}
    flat = _report(res, args)
    assert (flat["adaptive_goodput_median"], flat["adaptive_goodput_min"], flat["adaptive_goodput_max"]) == (2.0, 1.0, 2.0)
    assert flat["colocated_goodput_by_seed"] == {"0": 1.0, "100": 0.5, "200": 0.5}
    # medians: adaptive 2.0, disaggregated 0.5 (the first of the best), colocated 0.5; per seed
    # against that same mode: 2/0.5, 1/0.5, 2/1, so the ratio of medians lies within them
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == 4.0
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix_by_seed"] == {"0": 4.0, "100": 2.0, "200": 2.0}
    assert (flat["goodput_ratio_adaptive_vs_best_fixed_mix_min"], flat["goodput_ratio_adaptive_vs_best_fixed_mix_max"]) \
        == (2.0, 4.0)
    assert flat["p90_tpot_ratio_adaptive_vs_colocated_mix"] == flat["p99_tpot_ratio_adaptive_vs_colocated_mix"] == 0.25
    out = capsys.readouterr().out
    assert "95% [95%..95%]" in out and "2 [1..2]" in out  # (the table: a rate's share, the goodput)
    res = {k: mode(g, t, 20) for k, g, t in (("colocated", {0: 1.0, 100: 0.5, 200: 0.5}, 400.0),
                                              ("adaptive", {0: 2.0, 100: 1.0, 200: 2.0}, 100.0))}
    flat = _report(res, args)
    assert "p99_tpot_ratio_adaptive_vs_colocated_mix" not in flat and flat["p90_tpot_ratio_adaptive_vs_colocated_mix"]
    # a closed loop (no rate) with seeds: the table still gives each mode's goodput over them
    closed = build_parser().parse_args(["--compare", "--modes", "colocated,adaptive", "--seeds", "2"])
    res = {k: {"runs": [{"rate": None, "seed": s, "summary": {"all": {"goodput_rps": g + s / 100,
                                                                      "slo_attainment": 1.0}},
                         "results": _results([100.0] * 5)} for s in (0, 100)], "max_goodput_rate": 0.0}
           for k, g in (("colocated", 0.5), ("adaptive", 1.0))}
    flat = _report(res, closed)
    assert (flat["adaptive_goodput_median"], flat["adaptive_goodput_min"], flat["adaptive_goodput_max"]) == (1.5, 1.0, 2.0)
    assert flat["goodput_ratio_adaptive_vs_best_fixed_mix"] == 1.5 / 1.0


def test_every_mode_gets_the_same_kv_memory_split_by_role(tmp_path):
    """--kv-gb (default 2 GiB): colocated's one worker all of it; disaggregated's prefill and
    decode workers 1:3 (the weights `kv_cache_gb: auto` gives their roles); adaptive's two
    workers half each (both run the decode engine). 0: each worker its config's own."""
    from bench.modes import cluster_config
    args = build_parser().parse_args(["--compare", "--modes", "all"])
    assert args.kv_gb == 2.0
    total = {}
    for name, mode in _compare_modes(args).items():
        cfg = cluster_config(name, mode, args)
        if cfg.mode == "colocated":
            total[name] = cfg.decode.kv_cache_gb * cfg.decode.replicas
        elif cfg.mode == "adaptive":
            total[name] = cfg.decode.kv_cache_gb * (cfg.decode.replicas + cfg.prefill.replicas)
        else:
            assert cfg.decode.kv_cache_gb == pytest.approx(3 * cfg.prefill.kv_cache_gb)
            total[name] = cfg.decode.kv_cache_gb * cfg.decode.replicas + cfg.prefill.kv_cache_gb * cfg.prefill.replicas
    assert set(total) == {"disaggregated", "colocated", "colocated-chunked", "disaggregated-local", "adaptive",
                          "adaptive-tuned"}
    assert all(t == pytest.approx(2.0) for t in total.values())
    # the pools' sizes are the config's: a config with two decode workers splits over both
    conf = tmp_path / "two.yaml"
    conf.write_text("decode:\n  replicas: 2\n")
    two = build_parser().parse_args(["--compare", "--config", str(conf), "--kv-gb", "3"])
    cfg = cluster_config("disaggregated", _compare_modes(two)["disaggregated"], two)
    assert (cfg.prefill.kv_cache_gb, cfg.decode.kv_cache_gb) == pytest.approx((3 / 7, 9 / 7))  # 1 x 1 + 2 x 3 shares
    assert cluster_config("colocated", _compare_modes(two)["colocated"], two).decode.kv_cache_gb == 1.5
    off = build_parser().parse_args(["--compare", "--kv-gb", "0"])
    assert cluster_config("colocated", _compare_modes(off)["colocated"], off).decode.kv_cache_gb == "auto"
    # --prefix-compare sizes its own workers' caches (--prefix-kv-gb)
    pre = build_parser().parse_args(["--prefix-compare"])
    from bench.modes import prefix_compare
    assert cluster_config("prefix-aware", prefix_compare("colocated")["prefix-aware"], pre).decode.kv_cache_gb == 0.25


def test_adaptive_runs_the_controller_defaults_and_only_the_tuned_row_gets_the_slos():
    """The issue's fairness: adaptive runs the role controller as a user gets it (but for
    min_prefill 0, without which two workers never switch); faster decisions and the
    benchmark's SLOs as targets are the separately labelled adaptive-tuned row."""
    from bench.modes import cluster_config
    from router.autoscale import DecodeTargets, PrefillTargets
    from router.roles import RolesConfig
    args = build_parser().parse_args(["--compare", "--modes", "adaptive,adaptive-tuned", "--ttft-slo-ms", "2500",
                                      "--tpot-slo-ms", "140"])
    modes = _compare_modes(args)
    plain, tuned = (cluster_config(n, modes[n], args) for n in ("adaptive", "adaptive-tuned"))
    d = RolesConfig()
    assert (plain.roles.interval_s, plain.roles.switch_delay_s, plain.roles.idle_delay_s) == \
        (d.interval_s, d.switch_delay_s, d.idle_delay_s)
    assert plain.roles.min_prefill == 0 and plain.roles.min_decode == d.min_decode
    assert plain.autoscale.prefill == PrefillTargets() and plain.autoscale.decode == DecodeTargets()
    assert (tuned.roles.interval_s, tuned.roles.switch_delay_s, tuned.roles.idle_delay_s) == (1.0, 3.0, 10.0)
    assert (tuned.autoscale.prefill.target_ttft_ms, tuned.autoscale.decode.target_tpot_ms) == (2500, 140)
    # both prefill short prompts locally, as disaggregated-local does (the same rule, not tuning)
    assert plain.router.local_prefill_tokens == tuned.router.local_prefill_tokens == 96


def test_each_seed_sends_other_prompts_and_arrivals_of_the_same_kind():
    """--seeds: seed s + 100 i draws another shape and other tokens at every rate, none a
    prefix of another's (one cluster runs them all); --seeds 0 is refused."""
    from bench.serving import workload
    args = build_parser().parse_args(["--compare", "--rates", "0.5,1", "--num-requests", "12", "--seeds", "3"])
    blocks = [{tuple(s.token_ids[:16]) for s in workload(args, 1000, k, seed=args.seed + 100 * i)}
              for i in range(3) for k in range(2)]
    assert all(not a & b for x, a in enumerate(blocks) for b in blocks[x + 1:])
    from bench.serving import bench_server
    with pytest.raises(BenchError, match="--seeds"):
        bench_server("127.0.0.1:1", build_parser().parse_args(["--seeds", "0"]), 1000)


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


def test_datasets_runs_the_comparison_on_each_and_hoists_the_keys_named_by_it():
    """--datasets: every dataset's comparison in one invocation (shared-prefix: the prefix
    comparison on the disaggregated pair, one run), the keys named by their dataset and the
    prefix keys at the top, each dataset's whole output under by_dataset."""
    import pytest

    from bench.compare import per_dataset
    from bench.loadgen import BenchError
    seen = []

    def run(a):
        seen.append((a.dataset, a.compare, a.prefix_compare, a.prefix_cluster, a.rates, a.seeds, a.plot_dir))
        if a.prefix_compare:
            return {"dataset": a.dataset, "ttft_p90_ratio_prefix_blind_vs_aware": 3.5,
                    "kv_bytes_ratio_aware_vs_blind": 0.7, "aware_ttft_ms_p90": 100.0}
        return {"dataset": a.dataset, f"goodput_ratio_adaptive_vs_best_fixed_{a.dataset}": 1.1,
                f"goodput_ratio_adaptive_vs_best_fixed_{a.dataset}_by_seed": [1.0, 1.1, 1.2],
                "adaptive_goodput_median": 0.4}
    args = build_parser().parse_args(["--compare", "--modes", "all", "--datasets", "mix,phase,shared-prefix",
                                      "--rates", "0.2,0.4", "--seeds", "3", "--plot-dir", "/tmp/p"])
    out = per_dataset(args, run)
    assert seen == [("mix", True, False, "colocated", "0.2,0.4", 3, "/tmp/p/mix"),
                    ("phase", True, False, "colocated", "0.2,0.4", 3, "/tmp/p/phase"),
                    ("shared-prefix", False, True, "disaggregated", None, 1, "/tmp/p/shared-prefix")]
    assert out["goodput_ratio_adaptive_vs_best_fixed_mix"] == out["goodput_ratio_adaptive_vs_best_fixed_phase"] == 1.1
    assert out["goodput_ratio_adaptive_vs_best_fixed_phase_by_seed"] == [1.0, 1.1, 1.2]
    assert out["ttft_p90_ratio_prefix_blind_vs_aware"] == 3.5 and out["kv_bytes_ratio_aware_vs_blind"] == 0.7
    assert "adaptive_goodput_median" not in out and out["by_dataset"]["mix"]["adaptive_goodput_median"] == 0.4
    assert args.dataset == "mix" and args.compare  # (the caller's arguments untouched)
    for bad in (["--datasets", "mix"], ["--compare", "--datasets", "mix,mix"], ["--compare", "--datasets", "mix,nope"]):
        with pytest.raises(BenchError):
            per_dataset(build_parser().parse_args(bad), run)
    assert len(seen) == 3  # (none of them ran a dataset)
