"""The served-weights cache (engine/weight_cache.py): a converted model is written once, mapped by
every later load, identical in what it computes, shared between processes, never served stale
or half-written.

Tiny random models (Qwen2 with biases and an untied head, Llama with a tied one) keep it fast;
the real models take the same path in every other engine test.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import weight_cache
from engine.request import SamplingParams
from tests.engine.test_architectures import _save_tiny

IDS = list(range(300, 340))


@pytest.fixture
def cache(tmp_path, monkeypatch, model_path):
    """A private cache root (the bundled model's folder stays where it is)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE", str(root))
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "1")
    return root / "served"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    out = {}
    for kind, extra in (("qwen2", {}), ("llama", {"tie_word_embeddings": True})):
        path = tmp_path_factory.mktemp(kind)
        _save_tiny(kind, path, model_path, **extra)
        out[kind] = path
    return out


def _engine(make_engine, path, **kw):
    return make_engine(model=path, memory_gb=0.02, **kw)


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_cached_model_computes_exactly_what_a_converted_one_does(kind, quantization, tiny, cache, make_engine,
                                                                     monkeypatch):
    first = _engine(make_engine, tiny[kind], quantization=quantization)
    second = _engine(make_engine, tiny[kind], quantization=quantization)
    assert (first.model.weights_from, second.model.weights_from) == ("built", "cache")
    entries = list(cache.glob("*.bin"))
    assert len(entries) == 1 and _mapped(entries[0])
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "0")
    plain = _engine(make_engine, tiny[kind], quantization=quantization)
    assert plain.model.weights_from == "uncached"
    # the same bytes through the same kernels: equal, not close
    want = plain.prompt_logits(IDS)
    assert torch.equal(first.prompt_logits(IDS), want) and torch.equal(second.prompt_logits(IDS), want)
    sp = SamplingParams(max_tokens=8, temperature=0)
    tokens = [e.generate([IDS], sp)[0].token_ids for e in (plain, first, second)]
    assert tokens[0] == tokens[1] == tokens[2]


def test_one_tensor_stays_one_and_views_stay_views(tmp_path):
    """A tied embedding/head is one Parameter reached twice; views of one buffer (the one-token
    path's huge-page copies) share it again after loading, and nothing else does."""
    from torch import nn
    emb, head = nn.Embedding(10, 4).requires_grad_(False), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    buf = torch.arange(12.0)
    obj = {"emb": emb, "head": head, "a": buf[:6].view(2, 3), "b": buf[6:].view(3, 2).t(), "c": torch.ones(2)}
    weight_cache.save(obj, tmp_path / "e")
    got = weight_cache.load(tmp_path / "e")
    assert got["head"].weight is got["emb"].weight and isinstance(got["emb"].weight, nn.Parameter)
    assert torch.equal(got["emb"].weight, emb.weight)
    assert got["a"].tolist() == obj["a"].tolist() and got["b"].tolist() == obj["b"].tolist()
    assert got["b"].stride() == (1, 2)
    got["a"][0, 0] = 100.0  # copy-on-write: the process's own page now, the file unchanged
    assert got["b"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()
    assert got["c"].untyped_storage().data_ptr() != got["a"].untyped_storage().data_ptr()
    assert weight_cache.load(tmp_path / "e")["a"][0, 0].item() == 0.0


def test_options_and_weights_key_separate_entries(tiny, cache, make_engine):
    _engine(make_engine, tiny["qwen2"])
    _engine(make_engine, tiny["qwen2"], quantization="int8")
    _engine(make_engine, tiny["llama"])
    assert len(list(cache.glob("*.pkl"))) == 3


def test_a_damaged_entry_is_rebuilt_not_served(tiny, cache, make_engine, caplog):
    want = _engine(make_engine, tiny["qwen2"]).prompt_logits(IDS)
    (binf,) = cache.glob("*.bin")
    # a copy cut in half put in its place (the engine above still maps the whole old file)
    cut = binf.with_suffix(".cut")
    cut.write_bytes(binf.read_bytes()[:binf.stat().st_size // 2])
    cut.replace(binf)
    eng = _engine(make_engine, tiny["qwen2"])
    assert eng.model.weights_from == "built" and "unreadable" in caplog.text
    assert torch.equal(eng.prompt_logits(IDS), want)
    assert _engine(make_engine, tiny["qwen2"]).model.weights_from == "cache"


def test_a_cache_others_can_write_is_refused(tiny, cache, make_engine):
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by no one else"):
        _engine(make_engine, tiny["qwen2"])


def test_the_cache_off_converts_each_time(tiny, cache, make_engine, monkeypatch):
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE", "0")
    assert _engine(make_engine, tiny["qwen2"]).model.weights_from == "uncached"
    assert not cache.exists()


def test_oldest_entries_go_past_the_budget(tiny, cache, make_engine, monkeypatch):
    monkeypatch.setenv("PDSERVE_WEIGHT_CACHE_GB", "0.001")  # 1 MB: below any one entry, so one stays
    _engine(make_engine, tiny["qwen2"])
    first = {p.stem for p in cache.glob("*.pkl")}
    _engine(make_engine, tiny["llama"])
    left = {p.stem for p in cache.glob("*.pkl")}
    assert len(left) == 1 and not left & first  # the newest stays even alone over the budget


def test_an_entry_another_process_evicted_meanwhile_is_skipped(tmp_path):
    """Two processes loading at once (``make test``'s two, two servers) each evict past the
    budget: an entry listed by one may be gone, evicted by the other, when it is stat'ed."""
    class Racing(type(tmp_path)):  # lists one entry that is no longer there
        def glob(self, pattern):
            return [*super().glob(pattern), self / "gone.pkl"]

    for i, stem in enumerate(("old", "new")):
        for suffix, size in ((".pkl", 10), (".bin", 1000)):
            (tmp_path / (stem + suffix)).write_bytes(b"x" * size)
        os.utime(tmp_path / f"{stem}.pkl", (1000 + i, 1000 + i))
    weight_cache._evict(Racing(tmp_path), "new", 1500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.bin", "new.pkl"]


def test_what_cannot_be_mapped_is_served_uncached(cache):
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8), 1)  # opaque oneDNN layout
    obj, origin = weight_cache.cached("k" * 24, lambda: {"w": packed}, "an opaque tensor")
    assert origin == "uncached" and obj["w"] is packed
    assert not list(cache.glob("*.pkl"))


def test_a_second_process_waits_for_the_first_conversion_then_maps_it(cache):
    """Two loads of one model at once convert it once: the second waits on the entry's lock."""
    cache.mkdir(parents=True, mode=0o700)
    key, calls = "a" * 24, []
    lock = open(cache / f"{key}.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # "the first process": converting
    got = {}

    def second():
        got["r"] = weight_cache.cached(key, lambda: calls.append(1) or {"w": torch.ones(3)}, "m")

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.3)  # (only gives the thread time to block; the assertions hold whatever it is)
    assert "r" not in got
    weight_cache.save({"w": torch.arange(3.0)}, cache / key)  # the first one's result
    fcntl.flock(lock, fcntl.LOCK_UN)
    t.join(30)
    obj, origin = got["r"]
    assert origin == "cache" and not calls and obj["w"].tolist() == [0.0, 1.0, 2.0]


_HOLD = """
import os, sys, torch
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
e = LLMEngine(EngineConfig(model=sys.argv[1], cache=CacheConfig(memory_gb=0.02)), progress=False)
print(e.model.weights_from, flush=True)
sys.stdin.read()
"""


def _hold(path):
    return subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ))


def test_processes_mapping_one_entry_share_its_pages(tiny, cache):
    """The node holds the weights once: the pages of the entry one worker process maps are also
    the other's (shared in its smaps), so each process's PSS counts half of them. (Two fresh
    processes: what this one has loaded before may differ from a worker's start.)"""
    first = _hold(tiny["qwen2"])
    second = None
    try:
        assert first.stdout.readline().strip() == "built"
        second = _hold(tiny["qwen2"])
        assert second.stdout.readline().strip() == "cache"
        (binf,) = cache.glob("*.bin")
        kb = dict.fromkeys(("Rss", "Shared_Clean", "Shared_Dirty", "Anonymous"), 0)
        mapping = False
        for line in Path(f"/proc/{second.pid}/smaps").read_text().splitlines():
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
                mapping = line.endswith(str(binf.resolve()))
            elif mapping and line.split(":")[0] in kb:
                kb[line.split(":")[0]] += int(line.split()[1])
        # shared page-cache pages (dirty until written back to disk), no private copies of them
        assert kb["Rss"] > 0 and kb["Shared_Clean"] + kb["Shared_Dirty"] >= 0.9 * kb["Rss"], kb
        assert kb["Anonymous"] == 0, kb
    finally:
        for p in (first, second):
            if p is not None:
                p.stdin.close()
                p.wait(30)
