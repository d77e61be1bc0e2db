"""``python -m bench.simulate --validate`` without a cluster: the same-arrivals trace, the
simulated twin of each real mode, the relative errors and the report's shape. The real side is
a record as ``--real-out`` writes it (made here from the simulator's own answers, then
perturbed), the cost models the fixed one beside this file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.sim.validate as validate
from bench.loadgen import RequestSpec, poisson_arrivals
from bench.modes import COMPARE, TUNED, cluster_config
from bench.serving import workload
from bench.sim.cluster import Cluster
from bench.sim.costs import from_json, load
from bench.sim.fidelity import FIGURES, Cell, Figures, max_rel_error, render_table, report, sim_trace, worst
from bench.sim.report import latencies
from bench.simulate import main as sim_main
from router.prefix_index import block_hashes

FIXED = Path(__file__).with_name("sim_cost_fixed.json")


def _costs(tmp_path: Path) -> list[str]:
    """The fixed cost model at 1 thread, and a faster copy of it at 2 (colocated modes)."""
    d = json.loads(FIXED.read_text())
    two = tmp_path / "fixed_t2.json"
    two.write_text(json.dumps({**d, "threads": 2, "step": {k: v / 2 for k, v in d["step"].items()}}))
    return [str(FIXED), str(two)]


def test_arrivals_are_seeded_poisson_and_the_trace_keeps_every_request_as_sent():
    a = poisson_arrivals(2000, 4.0, seed=7)
    assert a == poisson_arrivals(2000, 4.0, seed=7) != poisson_arrivals(2000, 4.0, seed=8)
    assert all(x < y for x, y in zip(a, a[1:])) and a[0] > 0
    assert a[-1] / len(a) == pytest.approx(1 / 4.0, rel=0.1)  # mean gap 1 / rate
    args = validate.load_args("shared-prefix", 12, 0.5, 3, 0)
    specs = workload(args, 1000)
    trace = sim_trace(specs, poisson_arrivals(12, 0.5, 3))
    assert [(t.arrival, t.cls, tuple(t.prompt), t.max_tokens) for t in trace] == \
        [(at, s.kind, s.token_ids, s.max_tokens) for s, at in zip(specs, poisson_arrivals(12, 0.5, 3))]
    assert [t.rid for t in trace] == list(range(12))
    # the shared system prompts are shared blocks to the router's prefix index, as on the real side
    firsts = {block_hashes(t.prompt, 16)[0] for t in trace}
    assert len(firsts) == args.prefix_groups


def test_sim_trace_refuses_what_it_cannot_replay():
    with pytest.raises(ValueError, match="2 requests but 1 arrival"):
        sim_trace([RequestSpec("chat", 4, (1, 2)), RequestSpec("chat", 4, (3, 4))], [0.5])
    with pytest.raises(ValueError, match="text prompt"):
        sim_trace([RequestSpec("file", 4, (), "hello")], [0.5])


def test_loads_sharing_a_cluster_share_no_prompt_prefix():
    """Loads run in turn on one cluster draw their prompts from seeds 100 apart: no prompt of
    one load (nor of a warm-up, seed + 1) starts with another's first block."""
    firsts = {}
    for i, ld in enumerate(validate.LOADS):
        s = validate.load_seed(0, i)
        for seed in (s, s + 1):
            for spec in workload(validate.load_args(ld, 10, 0.4, seed, 0), 49152):
                firsts.setdefault(block_hashes(list(spec.token_ids), 16)[0], set()).add((ld, seed))
    assert all(len(v) == 1 for v in firsts.values())


def test_figures_use_the_load_generators_percentiles_and_skip_missing_samples():
    f = Figures.of([0.1, 0.2, None, 0.3, 0.4, 0.5], [None, 0.01, 0.03])
    assert f.ttft_ms_p50 == pytest.approx(300.0) and f.ttft_ms_p90 == pytest.approx(460.0)
    assert f.tpot_ms_p50 == pytest.approx(20.0) and f.tpot_ms_p90 == pytest.approx(28.0)
    assert Figures.of([0.1], []).tpot_ms_p90 is None


def test_relative_error_and_the_worst_cells():
    cs = [Cell("colocated", "mix", "ttft_ms_p50", 200.0, 180.0), Cell("colocated", "mix", "tpot_ms_p90", 50.0, 65.0),
          Cell("adaptive", "phase", "ttft_ms_p90", 100.0, 100.0), Cell("adaptive", "phase", "tpot_ms_p50", None, 40.0),
          Cell("adaptive", "phase", "tpot_ms_p90", 0.0, 3.0)]
    assert [c.rel_error for c in cs] == [pytest.approx(0.1), pytest.approx(0.3), 0.0, None, None]
    assert max_rel_error(cs) == pytest.approx(0.3)
    assert [c.figure for c in worst(cs)] == ["tpot_ms_p90", "ttft_ms_p50", "ttft_ms_p90"]
    assert max_rel_error(cs[3:]) is None


def test_table_and_json_shape():
    cs = [Cell(m, ld, f, 100.0, 100.0 + 5 * i) for i, (m, ld, f) in enumerate(
        (m, ld, f) for m in ("disaggregated", "colocated") for ld in ("mix", "phase") for f in FIGURES)]
    lines = render_table(cs).splitlines()
    assert "TTFT p50 real" in lines[0] and "TPOT p90 real" in lines[0] and len(lines) == 2 + 4
    row = lines[2].split()
    assert row[:2] == ["disaggregated", "mix"] and row[4::3] == ["+0%", "+5%", "+10%", "+15%*"]  # over 10%: marked
    assert lines[-1].split()[:2] == ["colocated", "phase"] and lines[-1].endswith("+75%*")
    out = report(cs, {"model": "m"})
    assert out["sim_vs_real_max_rel_error"] == 0.75 and out["model"] == "m"
    assert out["cells_compared"] == 16 and out["cells_over_tolerance"] == 16 - 3  # 0%, 5%, 10% are within
    assert out["worst"][0] == {"mode": "colocated", "load": "phase", "figure": "tpot_ms_p90", "real_ms": 100.0,
                               "sim_ms": 175.0, "rel_error": 0.75}
    assert len(out["cells"]) == 16 and json.loads(json.dumps(out)) == out


def test_each_real_mode_becomes_its_simulated_twin(tmp_path):
    costs = {c.threads: c for c in map(load, _costs(tmp_path))}
    a = validate.load_args("mix", 10, 0.4, 0, 0)
    got = {}
    for m in COMPARE:
        spec, cost = validate.sim_setup(cluster_config(m, COMPARE[m], a), costs, 900)
        got[m] = (spec.mode, spec.workers, spec.prefill, cost.threads, cost.max_batched_tokens, cost.kv_blocks)
        assert spec.local_prefill_tokens == (96 if m in ("disaggregated-local", "adaptive") else 0)
        assert spec.node_workers == spec.workers  # (one machine: every worker shares its bandwidth)
    assert got == {"disaggregated": ("disaggregated", 2, 1, 1, 2048, 900),
                   "colocated": ("colocated", 1, 0, 2, 8192, 900),
                   "colocated-chunked": ("colocated+chunked", 1, 0, 2, 256, 900),
                   "disaggregated-local": ("disaggregated-local", 2, 1, 1, 2048, 900),
                   "adaptive": ("adaptive", 2, 1, 1, 2048, 900)}
    # adaptive: the controller's defaults (min_prefill 0 aside); the tuned row's settings reach its twin too
    spec, _ = validate.sim_setup(cluster_config("adaptive", COMPARE["adaptive"], a), costs, None)
    assert (spec.roles.interval_s, spec.roles.min_prefill, spec.prefill_targets.target_queued_tokens) == (2.0, 0, 4096)
    spec, _ = validate.sim_setup(cluster_config("adaptive-tuned", TUNED["adaptive-tuned"], a), costs, None)
    assert (spec.roles.interval_s, spec.roles.min_prefill, spec.prefill_targets.target_queued_tokens) == (1.0, 0, 1024)
    assert validate.threads_needed(list(COMPARE)) == [1, 2]
    with pytest.raises(ValueError, match="no cost model for 2"):
        validate.sim_setup(cluster_config("colocated", COMPARE["colocated"], a), {1: costs[1]}, None)


def _record(tmp_path: Path, modes=("disaggregated", "colocated-chunked"), loads=("mix", "shared-prefix")) -> dict:
    """A --real-out record whose measurements are the simulator's own answers."""
    costs = {c.threads: c for c in map(load, _costs(tmp_path))}
    rec = {"format": validate.REAL_FORMAT, "model": "smollm2-135m", "num_requests": 8, "rate": 0.5, "seed": 0,
           "vocab": 1000, "modes": list(modes), "loads": list(loads), "runs": []}
    for mode in modes:
        for i, ld in enumerate(loads):
            s = validate.load_seed(0, i)
            a = validate.load_args(ld, 8, 0.5, s, 0)
            spec, cost = validate.sim_setup(cluster_config(mode, COMPARE[mode], a), costs, None)
            jobs = Cluster(spec, cost).run(sim_trace(workload(a, 1000), poisson_arrivals(8, 0.5, s)))
            ttft, tpot = latencies(jobs)
            rec["runs"].append({"mode": mode, "load": ld, "seed": s, "kv_blocks": None, "ttft_s": ttft,
                                "tpot_s": tpot, "failed": 0})
    return rec


def test_validate_on_a_record_prints_the_table_and_the_json_line(tmp_path, capsys):
    rec = _record(tmp_path)
    # the real side measured its TTFTs of one cell 25% longer than the simulator's: that cell is the worst
    run = rec["runs"][3]  # colocated-chunked / shared-prefix
    run["ttft_s"] = [t * 1.25 for t in run["ttft_s"]]
    path = tmp_path / "real.json"
    path.write_text(json.dumps(rec))
    argv = ["--validate", "--real-in", str(path), "--no-profile"] + [x for c in _costs(tmp_path) for x in ("--cost", c)]
    assert sim_main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    assert got["sim_vs_real_max_rel_error"] == pytest.approx(0.2, abs=1e-4)  # |1 - 1.25| / 1.25
    assert {(c["mode"], c["load"]) for c in got["worst"][:2]} == {("colocated-chunked", "shared-prefix")}
    assert got["cells_over_tolerance"] == 2 and len(got["cells"]) == 4 * 4
    assert all(c["rel_error"] == 0.0 for c in got["cells"] if c["load"] == "mix")
    assert set(got["cost_models"]) == {"1", "2"} and got["runs"][0]["mode"] == "disaggregated"
    # the report's cost models read back as the ones given (every field, the raw samples aside)
    # (and field by field: the fixed models hold defaults, which from_json would fill in for a dropped one)
    for c in _costs(tmp_path):
        model = load(c)
        reported, own = got["cost_models"][str(model.threads)], model.to_json()
        assert from_json({**reported, "samples": model.samples}) == model
        assert set(reported) == set(own) - {"samples"}
        assert all(set(reported[k]) == set(own[k]) for k in ("step", "transfer", "cluster", "node"))
    assert len(out) == 1 + 2 + 4 and "-20%*" in out[2 + 3]


def test_validate_refuses_bad_input_with_a_message(tmp_path, capsys, monkeypatch):
    assert sim_main(["--validate", "--modes", "colocated,round-robin"]) == 2
    assert "round-robin" in capsys.readouterr().err
    monkeypatch.setattr("bench.sim.costs.CACHE", tmp_path / "none")
    assert sim_main(["--validate", "--modes", "colocated", "--no-profile"]) == 2
    assert "python -m bench.simulate profile --model smollm2-135m --threads 2" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert sim_main(["--validate", "--real-in", str(tmp_path / "bad.json")]) == 2
    assert "pdserve-sim-validate-real/1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_main([])  # neither a command nor --validate
    with pytest.raises(SystemExit):
        sim_main(["run", "--validate"])


def test_real_vs_real_compares_two_records_of_the_same_arrivals(tmp_path, capsys):
    """--real-in A --real-vs B: the same table and JSON line with B in the second column and no
    simulator; records of other requests or arrivals are refused with what differs."""
    a = _record(tmp_path)
    b = json.loads(json.dumps(a))
    b["runs"][1]["tpot_s"] = [t * 1.5 for t in b["runs"][1]["tpot_s"]]  # disaggregated / shared-prefix
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert sim_main(["--validate", "--real-in", str(pa), "--real-vs", str(pb)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    got = json.loads(out[-1])
    assert "sim_vs_real_max_rel_error" not in got and "cost_models" not in got
    assert got["real_vs_real_max_rel_error"] == pytest.approx(0.5, abs=1e-4)
    assert {(c["mode"], c["load"], c["figure"]) for c in got["worst"][:2]} == \
        {("disaggregated", "shared-prefix", "tpot_ms_p50"), ("disaggregated", "shared-prefix", "tpot_ms_p90")}
    assert got["cells_over_tolerance"] == 2 and "real 2" in out[0]
    b["rate"] = 0.6
    pb.write_text(json.dumps(b))
    assert sim_main(["--validate", "--real-in", str(pa), "--real-vs", str(pb)]) == 2
    assert "rate 0.5 vs 0.6" in capsys.readouterr().err
    assert sim_main(["--validate", "--real-vs", str(pb)]) == 2
    assert "--real-in" in capsys.readouterr().err
