"""A worker's memory account (worker.step_loop.load_memory, ModelInfo.memory): taken once at
load from engine/memory.py, consistent with the engine it describes and the process it runs in."""

from __future__ import annotations

import msgspec
import pytest

from worker.protocol import Memory, ModelInfo, WorkerStatus, memory_now
from worker.step_loop import load_memory


def test_account_of_a_tiny_engine_is_consistent(make_engine):
    eng = make_engine(memory_gb=0.05)
    for k, v in eng.runner.kv_caches:  # written once: resident, as a busy worker's cache is
        k.fill_(0)
        v.fill_(0)
    m = load_memory(eng)
    assert m is not None
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in eng.runner.kv_caches)
    assert m.kv_cache_gb == pytest.approx(kv_bytes / 1e9, abs=1e-3)
    assert 0.4 < m.weights_gb < 0.7  # SmolLM2-135M in fp32
    assert m.rss_gb >= m.weights_gb + m.kv_cache_gb
    assert m.peak_rss_gb >= m.rss_gb * 0.99 and m.pss_gb > 0  # (peak: VmHWM, same kB as smaps)
    assert min(m.packed_copies_gb, m.other_gb) >= 0
    # through the protocol's codec, as a worker answers model_info()
    info = ModelInfo(model="m", fingerprint="f", incarnation="i", context_length=8, vocab_size=8, dtype="float32",
                     block_size=16, memory=m)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=ModelInfo).memory == m


def test_memory_now_takes_the_latest_process_figures():
    m = Memory(weights_gb=1.0, kv_cache_gb=0.5, rss_gb=2.0, pss_gb=1.8, peak_rss_gb=2.5)
    info = ModelInfo(model="m", fingerprint="f", incarnation="i", context_length=8, vocab_size=8, dtype="float32",
                     block_size=16, memory=m)
    status = WorkerStatus(role="decode", incarnation="i", pid=1, kv_blocks_used=0, kv_blocks_total=4, block_size=16)
    assert memory_now(info, None) == m and memory_now(info, status) == m  # no reading yet: the one at load
    now = memory_now(info, msgspec.structs.replace(status, rss_gb=2.2, pss_gb=1.9))
    assert (now.rss_gb, now.pss_gb, now.weights_gb, now.peak_rss_gb) == (2.2, 1.9, 1.0, 2.5)
    assert memory_now(msgspec.structs.replace(info, memory=None), status) is None


def test_a_process_peak_is_its_own_not_its_parents():
    """A process started by one that peaked at 1.5 GB (a Ray worker by its pool, a bench child
    by its runner) reports its own loading peak: ru_maxrss would carry the parent's over exec."""
    import subprocess
    import sys
    child = "from engine.memory import process_memory; print(process_memory()['peak_rss_gb'])"
    parent = ("import subprocess, sys\n"
              "x = bytearray(1_500_000_000)\n"
              "for i in range(0, len(x), 4096): x[i] = 1\n"
              f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, check=True)"
              ".stdout.strip())")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True, timeout=120)
    assert 0 < float(out.stdout.split()[-1]) < 1.0  # torch and the engine's imports: ~0.3 GB
