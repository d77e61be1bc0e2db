"""The committed gRPC stubs match proto/pdserve/v1/pdserve.proto and import as pdserve.v1."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_generate():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_stubs_match_proto(tmp_path):
    _load_generate().generate(tmp_path)
    for name in ("pdserve_pb2.py", "pdserve_pb2_grpc.py", "pdserve_pb2.pyi"):
        fresh = (tmp_path / "pdserve" / "v1" / name).read_text()
        committed = (ROOT / "proto" / "pdserve" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run python proto/generate.py"


def test_stubs_import_and_round_trip():
    from pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
    req = pdserve_pb2.GenerateRequest(
        prompt="hi", sampling=pdserve_pb2.SamplingParams(max_tokens=4, temperature=0.0, stop=["\n"]))
    back = pdserve_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("input") == "prompt" and back.sampling.max_tokens == 4
    assert back.sampling.HasField("temperature") and not back.sampling.HasField("top_p")
    assert hasattr(pdserve_pb2_grpc, "GenerationServicer")
