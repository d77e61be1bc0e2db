"""Dependencies point inward (README, Layout): engine ← kvtransfer ← worker ← prefill_worker,
decode_worker ← adaptive_worker ← router ← cli, bench. The engine knows no network; the transfer layer knows no
requests' runtime; the front door is no benchmark. Checked on the source (every import,
lazy ones inside functions included), so a shortcut fails here and not in a review."""

from __future__ import annotations

import ast
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
