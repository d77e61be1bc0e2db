"""Dependencies point inward (README, Layout): engine ← kvtransfer ← worker ← prefill_worker,
decode_worker ← adaptive_worker ← router ← cli, bench. The engine knows no network; the transfer layer knows no
requests' runtime; the front door is no benchmark. Checked on the source (every import,
lazy ones inside functions included), so a shortcut fails here and not in a review."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NETWORK = {"zmq", "ray", "grpc", "grpc_health", "grpc_reflection", "prometheus_client", "msgspec", "msgpack",
           "http", "urllib", "socket", "ucxx", "pdserve"}
OURS = {"engine", "kvtransfer", "worker", "prefill_worker", "decode_worker", "adaptive_worker", "router", "cli",
        "bench"}

# package -> top-level modules it must never import
FORBIDDEN = {
    "engine": NETWORK | (OURS - {"engine"}),
    "kvtransfer": {"ray", "grpc", "prometheus_client", "msgspec"} | {"worker", "prefill_worker", "decode_worker",
                                                                    "adaptive_worker", "router", "cli", "bench"},
    "worker": {"grpc", "router", "cli", "bench", "prefill_worker", "decode_worker", "adaptive_worker"},
    "prefill_worker": {"grpc", "router", "cli", "bench", "decode_worker", "adaptive_worker"},
    "decode_worker": {"grpc", "router", "cli", "bench", "prefill_worker", "adaptive_worker"},
    "adaptive_worker": {"grpc", "router", "cli", "bench"},
    "router": {"cli", "bench"},
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_inward(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {f"{f.relative_to(ROOT)} imports {m}" for f in files for m in _imports(f) & FORBIDDEN[package]}
    assert not bad, sorted(bad)


# ---- import circles -------------------------------------------------------------------------------
# No module may need itself through others, between packages or inside one, lazy imports (inside
# functions) included: a circle hidden by a function-local import is still a circle. Where two
# modules need a shared piece, it moves down a level. Circles found before the check existed
# (issue 43), each to be removed by moving the shared piece down; a circle found must lie within
# one of them (fixing part of one passes), any other fails.
KNOWN_CYCLES: list[set[str]] = []
# Packages whose function-local imports each say why they are local: a dependency that is heavy
# (Ray, torch, the engines) or optional (a server not every command starts), in a comment on the
# import or on the block of imports it ends. Every package of ours.
LAZY_CHECKED = OURS
LAZY_REASONS = ("heavy", "optional")


def _modules() -> dict[str, Path]:
    """Every module of ours by its dotted name (a package by its own: ``engine.quant``)."""
    out = {}
    for package in sorted(OURS):
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _module_imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(module of ours imported, line, inside a function) for each import in ``path``; imports
    under ``if TYPE_CHECKING`` are left out (they never run)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" for a in child.names]
            else:
                visit(child, inner)
                continue
            for t in targets:
                found.append((resolve(t), child.lineno, lazy))
    visit(ast.parse(path.read_text(), str(path)), False)
    return found


@functools.cache
def _import_graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        edges[name] |= {m for m, _, _ in _module_imports(name, path, modules) if m is not None and m != name}
    return modules, edges


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The graph's circles: its strongly connected parts of more than one node."""
    reach: dict[str, set[str]] = {}
    for start in edges:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    parts = {frozenset({a} | {b for b in reach[a] if a in reach.get(b, ())}) for a in edges if a in reach[a]}
    return [set(p) for p in parts if len(p) > 1]


def _unknown(cycles: list[set[str]]) -> list[list[str]]:
    return sorted(sorted(c) for c in cycles if not any(c <= known for known in KNOWN_CYCLES))


def test_no_import_circles_between_packages():
    _, edges = _import_graph()
    packages: dict[str, set[str]] = {p: set() for p in OURS}
    for a, targets in edges.items():
        packages[a.split(".")[0]] |= {b.split(".")[0] for b in targets} - {a.split(".")[0]}
    assert not _unknown(_cycles(packages))


@pytest.mark.parametrize("package", sorted(OURS))
def test_no_import_circles_inside_a_package(package):
    _, edges = _import_graph()
    inside = {a: {b for b in bs if b.split(".")[0] == package} for a, bs in edges.items()
              if a.split(".")[0] == package}
    assert not _unknown(_cycles(inside))


def test_the_circle_check_finds_a_lazy_circle():
    edges = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert _cycles(edges) == [{"a.x", "a.y", "a.z"}] and _unknown(_cycles(edges)) == [["a.x", "a.y", "a.z"]]


@pytest.mark.parametrize("package", sorted(LAZY_CHECKED))
def test_function_local_imports_say_why(package):
    modules = _modules()
    bad = []
    for name, path in modules.items():
        if name.split(".")[0] != package:
            continue
        lines = path.read_text().splitlines()
        for _, lineno, lazy in _module_imports(name, path, modules):
            if not lazy:
                continue
            # the import's own line, or the import lines and comments right above it
            i, said = lineno - 1, False
            while i >= 0 and not said:
                text = lines[i].strip()
                if i < lineno - 1 and not text.startswith(("import ", "from ", "#")):
                    break
                said = "#" in text and any(r in text[text.index("#"):] for r in LAZY_REASONS)
                i -= 1
            if not said:
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {lines[lineno - 1].strip()}")
    assert not bad, sorted(set(bad))


# ---- sizes: one concept per file, functions that fit on a screen -----------------------------------
# Production code (every package of ours but bench/, the benchmarks): no file over MAX_FILE_LINES
# lines, no function over MAX_FUNCTION_LINES (docstring and comments included). What is longer
# today is listed; anything else that grows past either fails here.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60
PRODUCTION = OURS - {"bench"}
KNOWN_LONG: set[str] = set()  # issue 43 split the last ones


def _production_files() -> list[Path]:
    return sorted(f for package in PRODUCTION for f in (ROOT / package).rglob("*.py"))


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in ``tree``, nested ones too."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                out.append((name, node.end_lineno - node.lineno + 1))
            out += _functions(node, name + ".")
        else:
            out += _functions(node, prefix)
    return out


def test_no_production_file_is_too_long():
    long = {str(f.relative_to(ROOT)): n for f in _production_files()
            if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES}
    new = {f: n for f, n in long.items() if f not in KNOWN_LONG}
    assert not new, f"files over {MAX_FILE_LINES} lines (split them by concept): {new}"


def test_no_production_function_is_too_long():
    long = {}
    for f in _production_files():
        for name, n in _functions(ast.parse(f.read_text(), str(f))):
            where = f"{f.relative_to(ROOT)}:{name}"
            if n > MAX_FUNCTION_LINES and where not in KNOWN_LONG:
                long[where] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_size_checks_measure_nested_functions_and_methods():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert _functions(tree) == [("A.f", 4), ("A.f.g", 2)]


# ---- private attributes ---------------------------------------------------------------------------
# A class's ``_names`` are its own: production code reads and sets another object's only through
# its public methods. An imported module's privates (a library's: ``torch.ops.aten._...``) are
# that library's business; ``self``/``cls``/``super()`` are the object's own.
KNOWN_PRIVATE = {
    # Ray 2.60's actor handle has no public id accessor (get_runtime_context() answers only inside
    # the actor): router/liveness.py says so where it reads it
    "router/liveness.py: actor._actor_id",
}


def _private_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    imported = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in {"self", "cls"} | imported:
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        while isinstance(base, ast.Attribute):  # torch.ops.aten._x: rooted in an imported module
            base = base.value
        if isinstance(base, ast.Name) and base.id in imported and not isinstance(node.value, ast.Name):
            continue
        out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_production_code_touches_another_objects_privates():
    found = [f"{f.relative_to(ROOT)}: {text}" for f in _production_files()
             for _, text in _private_accesses(ast.parse(f.read_text(), str(f)))]
    assert not [x for x in found if x not in KNOWN_PRIVATE], sorted(set(found) - KNOWN_PRIVATE)


def test_the_private_check_finds_a_reach_into_another_object():
    tree = ast.parse("import torch\nclass A:\n    def f(self, other):\n        self._mine = torch._C\n"
                     "        return other._theirs, self.pools._workers\n")
    assert [t for _, t in _private_accesses(tree)] == ["other._theirs", "self.pools._workers"]


# ---- deadlines ------------------------------------------------------------------------------------
# Python 3.11's asyncio.wait_for swallows a cancel that meets its awaitable's result (router/aio.py):
# a client's cancel lost that way left its request running for nobody. router.aio.within keeps it.
def _wait_fors(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr == "wait_for" and isinstance(node.value, ast.Name) and node.value.id == "asyncio"]


def test_no_code_of_ours_awaits_with_asyncio_wait_for():
    found = [f"{f.relative_to(ROOT)}:{line}" for package in OURS for f in sorted((ROOT / package).rglob("*.py"))
             for line in _wait_fors(ast.parse(f.read_text(), str(f)))]
    assert not found, f"asyncio.wait_for loses cancels on 3.11; use router.aio.within: {found}"


def test_the_wait_for_check_finds_one():
    assert _wait_fors(ast.parse("import asyncio\nasync def f(x):\n    await asyncio.wait_for(x, 1)\n")) == [3]
