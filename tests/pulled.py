"""The catalogue models `make install` pulls (`pdserve pull NAME`), for the tests that read their
files: asserted present, never skipped, like the bundled model."""

from __future__ import annotations

from pathlib import Path

from engine.models import catalog


def gguf_file(name: str) -> Path:
    """Catalogue model ``name``'s pulled GGUF file."""
    path = catalog.pulled_file(name)
    assert path is not None, f"{name} is not pulled: `make install` runs `pdserve pull {name}`"
    return path
