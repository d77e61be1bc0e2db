"""The native GEMV alone (engine/models/native_decode.c ``pd_linear``): GB/s of weights read per
shape, kind and number of x rows, beside the machine's read bandwidth in the same run.

A decode step is a chain of GEMVs over weights that do not fit any cache, so this is where a
decode's tok/s comes from (the 1.5B's INT8 step: 97% of its time inside the native calls). Each
shape is held in enough random copies (``--mib``, default 600 MiB) that every call reads from
memory, the copies called in turn; the median over ``--reps`` passes is reported, with the best.
Weights are random codes in each kind's layout (INT8: interleave4 words; INT4: the packed codes,
group 32, with compact group scales where a row has whole superblocks of them, else fp32 scales
and zero points, as a converted model holds them; fp32), so the bytes read are those of a real
model of that shape. Each call is ``pd_linear`` whole: the x row's preparation (INT8's column
order and sum, serial, a few microseconds) included. The shapes (``--shapes``, default
``qwen1.5b``): Qwen2.5-1.5B's gate/up (17920 x 1536), down (1536 x 8960), qkv (2048 x 1536) and
LM head (151936 x 1536); ``smollm2``: SmolLM2-135M's.

Prints progress on stderr, a table, and one JSON line: ``{kind}_{shape}_r{rows}_gb_s`` (median),
``read_bandwidth_gb_s`` (``x.sum()`` over 512 MiB with the same threads).

    python -m bench.gemv --kinds int8,int4 --rows 1,2,4,8
"""

from __future__ import annotations

import bench  # noqa: F401  (takes bench/ off sys.path: see bench/__init__.py)

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from bench.engine import read_bandwidth_gb_s
from engine.models import int4_blocks, native
from engine.quant.formats import interleave4

SHAPES = {
    "qwen1.5b": {"gu": (17920, 1536), "down": (1536, 8960), "qkv": (2048, 1536), "head": (151936, 1536)},
    "smollm2": {"gu": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "head": (49152, 576)},
}
KINDS = ("fp32", "int8", "int4")
GROUP = 32  # INT4 (the GGUF K-quants' block)


def weight_bytes(kind: str, n: int, k: int) -> int:
    if kind == "int4":  # the codes and the scales as the kernel reads them
        groups = n * (k // GROUP)
        scales = groups // int4_blocks.SUPER * int4_blocks.BLOCK_BYTES if native.int4_meta_fits(k, GROUP) else groups * 8
        return n * k // 2 + scales
    return n * k * (4 if kind == "fp32" else 1)


def make_linear(lib: ctypes.CDLL, kind: str, n: int, k: int, gen: torch.Generator) -> tuple:
    """A Lin over random weights of ``kind`` and the tensors it points into (kept alive with it)."""
    s, zs, b = torch.rand(n, generator=gen) * 0.01, torch.zeros(n), torch.zeros(n)
    if kind == "int4":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scale, zero = torch.rand(n, k // GROUP, generator=gen) * 0.01, torch.full((n, k // GROUP), 8.0)
        w, scale, zero = native.int4_weights(q, scale, zero, GROUP, lib.pd_vector_width(),
                                             torch.empty(n, k // 2, dtype=torch.uint8))
        meta = None
        if native.int4_meta_fits(k, GROUP):  # (else fp32 scales and zero points, 8 bytes a group)
            meta = torch.zeros(n, k // GROUP // int4_blocks.SUPER, int4_blocks.BLOCK_BYTES, dtype=torch.uint8)
            meta[:, :, :8] = (torch.rand(n, meta.shape[1], 2, generator=gen) * 0.01).view(torch.uint8)
            meta[:, :, 8:] = torch.randint(0, 64, (n, meta.shape[1], 16), dtype=torch.uint8, generator=gen)
            meta = meta.view(n, -1).contiguous()
            native.check_int4_meta(meta, n, k, GROUP)
        lin = native.Lin(w.data_ptr(), scale.data_ptr(), zero.data_ptr(), b.data_ptr(), n, k, native.W_I4, GROUP,
                         0, None if meta is None else meta.data_ptr())
        return lin, (w, scale, zero, b, meta)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w = interleave4(w8).contiguous() if kind == "int8" else w8.float()
    code = native.W_I8 if kind == "int8" else native.W_F32
    lin = native.Lin(w.data_ptr(), s.data_ptr(), zs.data_ptr(), b.data_ptr(), n, k, code, 0, 0, None)
    return lin, (w, s, zs, b)


def measure(lib, kind: str, n: int, k: int, rows: Sequence[int], mib: int, reps: int, threads: int) -> dict:
    gen = torch.Generator().manual_seed(n + k)
    copies = [make_linear(lib, kind, n, k, gen) for _ in range(max(1, mib * 2**20 // weight_bytes(kind, n, k)))]
    out = {}
    for r in rows:
        x, y = torch.randn(r, k, generator=gen), torch.empty(r, n)

        def call_all() -> None:
            for lin, _ in copies:
                lib.pd_linear(ctypes.addressof(lin), r, x.data_ptr(), y.data_ptr(), threads)

        call_all()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call_all()
            times.append((time.perf_counter() - t0) / len(copies))
        gb = weight_bytes(kind, n, k) / 1e9
        out[r] = (gb / statistics.median(times), gb / min(times))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen1.5b", help="whose linears (default qwen1.5b)")
    p.add_argument("--kinds", default="int8,int4", help=f"of {','.join(KINDS)} (default int8,int4)")
    p.add_argument("--rows", default="1,2,4,8", help="x rows per call, comma-separated (default 1,2,4,8)")
    p.add_argument("--mib", type=int, default=600, help="MiB of copies per shape (default 600: beyond caches)")
    p.add_argument("--reps", type=int, default=10, help="passes over the copies (default 10)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds, rows = args.kinds.split(","), [int(r) for r in args.rows.split(",")]
    if bad := [k for k in kinds if k not in KINDS]:
        raise SystemExit(f"unknown kinds {bad}: choose from {','.join(KINDS)}")
    lib = native.library()
    if lib is None:
        raise SystemExit("no native kernels on this machine (see the log): nothing to measure")
    torch.set_num_threads(args.threads)
    res: dict[str, float] = {}
    lines = [f"{'kind':5} {'shape':5} {'n x k':>13} " + " ".join(f"{f'{r} rows GB/s':>16}" for r in rows)]
    for kind in kinds:
        for name, (n, k) in SHAPES[args.shapes].items():
            print(f"{kind} {name} {n}x{k} ...", file=sys.stderr, flush=True)
            m = measure(lib, kind, n, k, rows, args.mib, args.reps, args.threads)
            lines.append(f"{kind:5} {name:5} {f'{n}x{k}':>13} " +
                         " ".join(f"{f'{m[r][0]:.1f} [{m[r][1]:.1f}]':>16}" for r in rows))
            res.update({f"{kind}_{name}_r{r}_gb_s": round(m[r][0], 2) for r in rows})
    res["read_bandwidth_gb_s"] = round(read_bandwidth_gb_s(), 1)
    print(f"native GEMV, {args.threads} threads, {torch.backends.cpu.get_cpu_capability()}: weights GB/s, "
          f"median [best] of {args.reps}; memory read {res['read_bandwidth_gb_s']} GB/s")
    print("\n".join(lines))
    print(json.dumps({"shapes": args.shapes, "threads": args.threads, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
