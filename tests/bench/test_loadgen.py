"""Load generator statistics and refusals, on synthetic results (no server)."""

from __future__ import annotations

import pytest

from bench.loadgen import (BenchError, RequestSpec, Result, make_workload, max_goodput_rate, percentile,
                           summarize)
from bench.serving import main as bench_main


def result(sent, first, n, gap, kind="chat", error=None):
    times = [first + i * gap for i in range(n)]
    return Result(RequestSpec(kind, n), sent, times, list(times), times[-1] if times else sent, error)


def test_percentiles_interpolate_and_order():
    xs = list(range(1, 101))
    assert percentile(xs, 50) == pytest.approx(50.5) and percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([], 50) is None


def test_summary_counts_latencies_and_goodput():
    rs = [result(0.0, 0.5, 11, 0.1), result(0.0, 4.0, 11, 0.1), result(1.0, 1.2, 11, 0.3),
          result(1.0, 1.0, 0, 0.1, error="UNAVAILABLE")]
    s = summarize(rs, wall_s=10.0, ttft_slo_s=1.0, tpot_slo_s=0.2)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1) and s["errors"] == "UNAVAILABLE 1"
    assert s["ttft_ms_p50"] == pytest.approx(500) and s["tpot_ms_p99"] == pytest.approx(296)
    assert s["ttft_ms_p50"] <= s["ttft_ms_p90"] <= s["ttft_ms_p99"]
    assert s["output_tokens"] == 33 and s["output_tokens_per_s"] == pytest.approx(3.3)
    # Only the first meets both targets (the second's TTFT and the third's TPOT miss; the fourth failed).
    assert s["slo_attainment"] == pytest.approx(0.25) and s["goodput_rps"] == pytest.approx(0.1)
    assert s["goodput_rps"] <= s["request_throughput"]
    # Each status with its count, the most frequent first; none failed: None.
    more = rs + [result(2.0, 2.0, 0, 0.1, error="RESOURCE_EXHAUSTED") for _ in range(2)]
    assert summarize(more, 10.0, 1.0, 0.2)["errors"] == "RESOURCE_EXHAUSTED 2, UNAVAILABLE 1"
    assert summarize(rs[:3], 10.0, 1.0, 0.2)["errors"] is None


def test_a_kind_can_have_a_ttft_target_of_its_own():
    # A long document whose first token came after 4 s: missed against the chats' 1 s target,
    # met against its own 5 s; a chat at 4 s misses either way (it is held to the 1 s).
    rs = [result(0.0, 4.0, 11, 0.1, kind="long"), result(0.0, 4.0, 11, 0.1), result(0.0, 0.5, 11, 0.1)]
    assert summarize(rs, 10.0, 1.0, 0.2)["slo_attainment"] == pytest.approx(1 / 3)
    s = summarize(rs, 10.0, 1.0, 0.2, ttft_slo_by_kind={"long": 5.0})
    assert s["slo_attainment"] == pytest.approx(2 / 3) and s["goodput_rps"] == pytest.approx(0.2)
    assert summarize(rs, 10.0, 1.0, 0.2, kind="chat", ttft_slo_by_kind={"long": 5.0})["slo_attainment"] == 0.5


def test_max_goodput_rate_is_the_highest_rate_up_to_which_every_rate_meets_90_percent():
    sweep = [(1.0, {"slo_attainment": 1.0}), (2.0, {"slo_attainment": 0.95}), (4.0, {"slo_attainment": 0.5})]
    assert max_goodput_rate(sweep) == 2.0 and max_goodput_rate([(1.0, {"slo_attainment": 0.2})]) == 0.0
    # a rate that met them above one that missed does not count (given in any order)
    dip = [(0.4, {"slo_attainment": 0.91}), (0.3, {"slo_attainment": 0.81}), (0.2, {"slo_attainment": 0.95})]
    assert max_goodput_rate(dip) == 0.2 and max_goodput_rate(dip[:2]) == 0.0


def test_workloads_are_distinct_and_mixed(tmp_path):
    w = make_workload(50, "mix", 49152, seed=1, long_share=0.3, long_tokens=300)
    assert {s.kind for s in w} == {"chat", "long"} and len({s.token_ids for s in w}) == 50
    assert all(len(s.token_ids) == 300 for s in w if s.kind == "long")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 3}\n\n{"token_ids": [5, 6]}\n')
    w = make_workload(3, str(f), 100, max_tokens="7")
    assert [(s.prompt, s.token_ids, s.max_tokens) for s in w] == [("hi", (), 3), (None, (5, 6), 7), ("hi", (), 3)]


def test_the_phase_workload_is_prompt_heavy_then_decode_heavy():
    specs = make_workload(40, "phase", 1000, seed=3, long_tokens=600)
    first, second = specs[:20], specs[20:]
    assert {s.kind for s in first} == {"long", "chat"} and {s.kind for s in second} == {"chat"}
    assert all(300 <= len(s.token_ids) <= 600 and s.max_tokens <= 16 for s in first if s.kind == "long")
    assert all(len(s.token_ids) <= 96 and s.max_tokens <= 96 for s in first if s.kind == "chat")
    assert all(len(s.token_ids) <= 96 and s.max_tokens >= 128 for s in second)
    assert make_workload(40, "phase", 1000, seed=3, long_tokens=600) == specs  # seeded
    # Longer answers: the same first half; the second half still short chats, wanting them.
    longer = make_workload(40, "phase", 1000, seed=3, long_tokens=600, phase_answer_tokens="600:700")
    assert longer[:20] == first
    assert all(s.kind == "chat" and len(s.token_ids) <= 96 and 600 <= s.max_tokens <= 700 for s in longer[20:])
    with pytest.raises(BenchError, match="phase answer tokens"):
        make_workload(4, "phase", 1000, phase_answer_tokens="9:3")


@pytest.mark.parametrize("args,needle", [
    (["--rate", "0"], "rate must be > 0"),
    (["--rates", "1,-2"], "rate must be > 0"),
    (["--rate", "1", "--concurrency", "2"], "at most one of"),
    (["--num-requests", "0"], "number of requests"),
    (["--dataset", "EMPTY"], "is empty"),
    (["--dataset", "/no/such/file.jsonl"], "neither"),
    (["--prompt-tokens", "9:3", "--dataset", "random"], "LO <= HI"),
])
def test_bench_refuses_nonsense_before_starting_anything(args, needle, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    argv = [str(empty) if a == "EMPTY" else a for a in args]
    assert bench_main(["--server", "127.0.0.1:9", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_bench_says_when_the_server_is_unreachable(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert bench_main(["--server", f"127.0.0.1:{port}", "--num-requests", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
