"""Metric names and the Grafana dashboard: every series the dashboard queries is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtransfer.base import TransferStats
from router.metrics import RouterMetrics
from worker.protocol import ModelInfo, Report, WorkerStatus, decode_report, encode_report

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"

# What a worker reports, through the protocol's codec: a renamed field fails here, not in production.
STATUS = decode_report(encode_report(Report("decode-0", "i", [], WorkerStatus(
    role="decode", incarnation="i", pid=1, running=2, waiting=1, queued_prompt_tokens=0, kv_blocks_used=10,
    kv_blocks_total=100, block_size=16, generated_tokens=50, tokens_per_s=3.0, prefix_query_tokens=64,
    prefix_hit_tokens=16, kv_transfer=TransferStats(done=3, failed=1, bytes=3000, seconds=0.5, forged=2),
    speculative={"acceptance_rate": 0.5})))).status
INFO = ModelInfo(model="m", fingerprint="f", incarnation="i", context_length=2048, vocab_size=100, dtype="float32",
                 block_size=16, speculative="ngram-k4", quantization="int8")


def exported(workers) -> dict[str, list]:
    from router.admission import Admission
    from router.cluster_view import ClusterView, WorkerView
    view = ClusterView(tuple(WorkerView(w.worker_id, w.role, w.state, w.status, w.info) for w in workers.values()),
                       queued=1, bad_reports=3)
    m = RouterMetrics(lambda: view, Admission().stats)
    m.requests.labels("stop").inc()
    for h in (m.ttft, m.tpot, m.itl, m.e2e):
        h.observe(0.1)
    text = generate_latest(m.registry).decode()
    return {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_worker_series_carry_labels_and_values():
    w = SimpleNamespace(worker_id="decode-0", role="decode", state="ready", status=STATUS, info=INFO)
    samples = exported({"decode-0": w})
    assert samples["pdserve_worker_kv_blocks_free"].value == 90
    assert samples["pdserve_worker_kv_blocks_free"].labels == {"worker": "decode-0", "role": "decode"}
    assert samples["pdserve_worker_prefix_cache_hit_ratio"].value == 0.25
    assert samples["pdserve_kv_transfer_bytes_per_second"].value == 6000
    assert samples["pdserve_kv_transfer_failed_total"].value == 1
    assert samples["pdserve_kv_transfer_forged_total"].value == 2
    assert samples["pdserve_router_bad_reports_total"].value == 3
    assert samples["pdserve_pool_workers"].labels == {"role": "decode", "state": "ready"}
    assert samples["pdserve_admission_queue_requests"].value == 1
    assert samples["pdserve_worker_info"].labels == {"worker": "decode-0", "role": "decode", "quantization": "int8",
                                                     "speculative": "ngram-k4"}
    # A worker that has not reported yet exports nothing rather than zeros.
    assert "pdserve_worker_running_requests" not in exported(
        {"x": SimpleNamespace(worker_id="x", role="prefill", state="starting", status=None, info=None)})


def test_dashboard_queries_only_exported_series():
    w = SimpleNamespace(worker_id="decode-0", role="decode", state="ready", status=STATUS, info=INFO)
    names = set(exported({"decode-0": w}))
    dash = json.loads(DASHBOARD.read_text())
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"pdserve_[a-z0-9_]+", t["expr"])}
    assert used and used <= names, sorted(used - names)


def test_memory_gauges_are_the_account_at_load_with_the_latest_rss():
    """pdserve_memory_bytes{kind} (worker/metrics.py, on each worker's /metrics and the router's):
    the worker's account at load (ModelInfo.memory), RSS and PSS from its latest status (through
    the codec), in bytes."""
    from worker.metrics import worker_families
    from worker.protocol import Memory
    info = msgspec.structs.replace(INFO, memory=Memory(weights_gb=0.54, packed_copies_gb=0.1, kv_cache_gb=0.2,
                                                       other_gb=0.01, rss_gb=1.0, pss_gb=0.9, peak_rss_gb=1.5))
    status = msgspec.structs.replace(STATUS, rss_gb=1.25, pss_gb=1.125)
    status = decode_report(encode_report(Report("decode-0", "i", [], status))).status
    labels = {"worker": "decode-0", "role": "decode"}

    def memory(status) -> dict[str, float]:
        fam = next(f for f in worker_families([(labels, status, info)]) if f.name == "pdserve_memory_bytes")
        assert all(s.labels["worker"] == "decode-0" for s in fam.samples)
        return {s.labels["kind"]: s.value for s in fam.samples}

    assert memory(status) == pytest.approx({"weights": 0.54e9, "packed_copies": 0.1e9, "kv_cache": 0.2e9,
                                            "other": 0.01e9, "rss": 1.25e9, "pss": 1.125e9, "peak_rss": 1.5e9})
    assert memory(None)["rss"] == pytest.approx(1.0e9)  # before its first status: the figures taken at load
    fam = next(f for f in worker_families([(labels, status, INFO)]) if f.name == "pdserve_memory_bytes")
    assert not fam.samples  # no account (an older worker, or the account failed): no series rather than zeros
