"""Regenerate the Python stubs next to the .proto files: python proto/generate.py [OUT_DIR].

The stubs are committed (so installing needs no protoc); tests/test_proto.py regenerates them
into a temp dir and fails if the committed ones differ from the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTOS = ["pdserve/v1/pdserve.proto"]


def generate(out_dir: Path = PROTO_ROOT) -> None:
    from grpc_tools import protoc
    for proto in PROTOS:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}",
                          f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", str(PROTO_ROOT / proto)])
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
