"""pdserve against llama.cpp, batch-1 decode at each precision, same weights, same machine.

The peer is llama.cpp as the prebuilt ``node-llama-cpp`` npm package ships it (its bundled
libraries, driven by a small Node script written below; nothing is compiled), installed on first
use into ``--peer-dir``. It is never a pdserve dependency. Its weights are pdserve's: the bundled
Q4_1 GGUF as is (Q4_1), every tensor dequantized to F32 (what pdserve's fp32 model holds), and
re-quantized to Q8_0, written once with the ``gguf`` package.

Pairs, each pdserve format against the llama.cpp type of the same bytes per weight:

    fp32   pdserve fp32 (compiled one-token path)          llama.cpp F32
    int8   pdserve int8 (per channel, compiled path)       llama.cpp Q8_0   (8.5 bits/weight)
    int4   pdserve int4-g32-asym (RTN of the same weights) llama.cpp Q4_1   (4 bits + a scale and
                                                           a min per 32: 5 bits/weight in both)

Both sides: a 128-token random prompt, 128 new tokens, greedy, decode tok/s = (new tokens - 1)
/ (time of the last - time of the first), ``--threads`` threads. Runs are interleaved (pdserve
fp32, llama.cpp F32, pdserve int8, ... then again) so a noisy neighbour hits both; the table
gives each side's median over ``--rounds``, the ratio of medians, and the machine's memory read
and copy bandwidth measured in the same run. Last stdout line: one flat JSON object
(``fp32_ratio_vs_llamacpp``, ``int8_ratio_vs_llamacpp_q8_0``, ``int4_ratio_vs_llamacpp_q4_1``,
``int8_vs_fp32``, ``int4_vs_fp32``, per-round numbers, the CPU's capability).

``--isa avx2`` runs both sides as an AVX2-only CPU would, on any x86-64: pdserve with
``make test-avx2``'s dispatch switches (torch, inductor, oneDNN, fbgemm, MKL held to AVX2), the
peer from a copy of its install (hard links) without the ggml CPU variants that need more than
AVX2 + FMA (ggml loads the best variant the CPU supports). Memory bandwidth stays this machine's.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

PAIRS = {"fp32": (None, "F32"), "int8": ("int8", "Q8_0"), "int4": ("int4-g32-asym", "Q4_1")}
RATIO_KEYS = {"fp32": "fp32_ratio_vs_llamacpp", "int8": "int8_ratio_vs_llamacpp_q8_0",
              "int4": "int4_ratio_vs_llamacpp_q4_1"}
NODE_LLAMA_CPP = "node-llama-cpp@3.22.1"
PROMPT_LEN = 128
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# ggml CPU variants an AVX2 + FMA CPU can load (the others need AVX-512, AVX-VNNI or AMX)
GGML_AVX2_VARIANTS = ("x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell")

# The peer's driver: batch-1 greedy decode of a 128-token prompt on a GGUF, one JSON line.
_PEER_SCRIPT = r"""
import {getLlama} from "node-llama-cpp";
const [path, threads, newTokens, reps, seed] = process.argv.slice(2).map((v, i) => i ? Number(v) : v);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: path});
const ctx = await model.createContext({contextSize: 128 + newTokens + 16, batchSize: 512, threads, sequences: 1});
const seq = ctx.getSequence();
const rates = [];
for (let r = 0; r <= reps; r++) {                       // run 0 warms up
  const prompt = Array.from({length: 128}, (_, i) => 1000 + ((i * 7919 + (seed + r) * 104729) % 40000));
  await seq.clearHistory();
  let n = 0, t1 = 0;
  for await (const tok of seq.evaluate(prompt, {temperature: 0})) {
    n++; if (n === 1) t1 = performance.now();
    if (n >= newTokens) break;
  }
  if (r > 0) rates.push((n - 1) / ((performance.now() - t1) / 1000));
}
console.log(JSON.stringify({decode_tok_s_b1: Math.max(...rates)}));
process.exit(0);
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.vs_llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per run (default 128)")
    p.add_argument("--precisions", default="fp32,int8,int4", help="which pairs (default fp32,int8,int4)")
    p.add_argument("--isa", default="native", choices=["native", "avx2"],
                   help="native, or both sides held to AVX2 + FMA (see the module docstring)")
    p.add_argument("--peer-dir", default=str(Path.home() / ".cache" / "pdserve" / "llamacpp-peer"),
                   help="where node-llama-cpp and the peer's GGUF files live (created on first use)")
    return p


# ---- the peer ----------------------------------------------------------------------------------
def ensure_peer(peer_dir: Path) -> Path:
    """node-llama-cpp installed in ``peer_dir`` and the driver script written; returns the script."""
    if not shutil.which("node") or not shutil.which("npm"):
        raise SystemExit("bench.vs_llamacpp: needs node and npm on PATH (the peer is an npm package)")
    peer_dir.mkdir(parents=True, exist_ok=True)
    if not (peer_dir / "node_modules" / "node-llama-cpp").is_dir():
        log(f"installing {NODE_LLAMA_CPP} into {peer_dir} (prebuilt llama.cpp, ~1 min) ...")
        subprocess.run(["npm", "install", NODE_LLAMA_CPP, "--no-audit", "--no-fund"], cwd=peer_dir, check=True,
                       stdout=subprocess.DEVNULL)
    script = peer_dir / "decode.mjs"
    script.write_text(_PEER_SCRIPT)
    return script


def avx2_peer(peer_dir: Path) -> Path:
    """A copy of the peer install (hard links) whose ggml has only AVX2-class CPU variants."""
    out = peer_dir.parent / f"{peer_dir.name}-avx2"
    if not (out / "node_modules").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(peer_dir / "node_modules"), str(out / "node_modules")], check=True)
        libs = list((out / "node_modules").rglob("libggml-cpu-*.so"))
        if not any(lib.name == "libggml-cpu-haswell.so" for lib in libs):
            shutil.rmtree(out)
            raise SystemExit("bench.vs_llamacpp: this node-llama-cpp ships no per-CPU ggml variants "
                             "(no libggml-cpu-haswell.so): --isa avx2 cannot hold it to AVX2")
        for lib in libs:
            if lib.name.removeprefix("libggml-cpu-").removesuffix(".so") not in GGML_AVX2_VARIANTS:
                lib.unlink()
    script = out / "decode.mjs"
    script.write_text(_PEER_SCRIPT)
    return script


def peer_gguf(src: Path, peer_dir: Path, kind: str) -> Path:
    """The bundled GGUF (``Q4_1``, as shipped) or its tensors rewritten as ``F32`` / ``Q8_0``."""
    if kind == "Q4_1":
        return src
    dst = peer_dir / f"{src.stem}.{kind}.gguf"
    if dst.is_file():
        return dst
    import gguf
    import numpy as np
    log(f"writing {dst.name} (every tensor of {src.name} as {kind}) ...")
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst) + ".part", reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, "general.file_type") or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        writer.add_key_value(field.name, field.contents(), vt,
                             sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if kind == "Q8_0" and w.ndim == 2 and w.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(dst) + ".part").rename(dst)
    return dst


def peer_decode(script: Path, gguf_path: Path, threads: int, new_tokens: int, seed: int) -> float:
    r = subprocess.run(["node", str(script), str(gguf_path), str(threads), str(new_tokens), "1", str(seed)],
                       cwd=script.parent, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp peer failed on {gguf_path.name}: {r.stderr[-1500:]}")
    return float(json.loads(r.stdout.strip().splitlines()[-1])["decode_tok_s_b1"])


# ---- pdserve -----------------------------------------------------------------------------------
def load_engine(quantization: str | None, threads: int):
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(quantization=quantization, num_threads=threads,
                                  cache=CacheConfig(num_blocks=64, block_size=16)), progress=False)


def pdserve_decode(eng, prompts, new_tokens: int) -> float:
    from bench.engine import engine_decode
    return engine_decode(eng, prompts, 1, new_tokens, reps=1)["decode_tok_s"]


# ---- the run -----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.isa == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        # torch reads these at import: start again with them set
        env = {**os.environ, **AVX2_ENV, "TORCHINDUCTOR_CACHE_DIR": os.path.join(
            os.environ.get("TMPDIR", "/tmp"), "pdserve-inductor-avx2")}
        os.execve(sys.executable, [sys.executable, "-m", "bench.vs_llamacpp", *(argv or sys.argv[1:])], env)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PAIRS]
    if bad or args.rounds < 1:
        raise SystemExit(f"bench.vs_llamacpp: unknown precision {bad} (valid: {', '.join(PAIRS)}) or rounds < 1")
    torch.set_num_threads(args.threads)
    from bench.engine import Prompts, copy_bandwidth_gb_s, read_bandwidth_gb_s
    from engine.models.gguf_convert import bundled_gguf_path
    from engine.quant.cpu_kernels import cpu_class

    peer_dir = Path(args.peer_dir).expanduser()
    script = ensure_peer(peer_dir)
    if args.isa == "avx2":
        script = avx2_peer(peer_dir)
    src = bundled_gguf_path()
    ggufs = {p: peer_gguf(src, peer_dir, PAIRS[p][1]) for p in precisions}
    engines = {}
    for p in precisions:
        log(f"loading pdserve {p} ({PAIRS[p][0] or 'fp32'}) ...")
        engines[p] = load_engine(PAIRS[p][0], args.threads)
    prompts = Prompts(engines[precisions[0]].model_config.vocab_size)
    ours: dict[str, list[float]] = {p: [] for p in precisions}
    peer: dict[str, list[float]] = {p: [] for p in precisions}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for p in precisions:
            ours[p].append(pdserve_decode(engines[p], prompts, args.new_tokens))
            peer[p].append(peer_decode(script, ggufs[p], args.threads, args.new_tokens, seed=r))
            log(f"round {r + 1}/{args.rounds} {p}: pdserve {ours[p][-1]:.1f} tok/s, llama.cpp {PAIRS[p][1]} "
                f"{peer[p][-1]:.1f} tok/s ({time.perf_counter() - t0:.0f}s)")
    kernels = {p: engines[p].kernels for p in precisions}
    del engines
    read_bw, copy_bw = read_bandwidth_gb_s(), copy_bandwidth_gb_s()
    out: dict = {"isa": args.isa, "threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens,
                 "prompt_tokens": PROMPT_LEN, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "cpu_class": cpu_class(), "read_bandwidth_gb_s": round(read_bw, 2),
                 "copy_bandwidth_gb_s": round(copy_bw, 2), "torch_version": torch.__version__}
    print(f"batch-1 decode, {PROMPT_LEN}-token prompt, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds; CPU {out['cpu_class']} (torch dispatch "
          f"{out['cpu_capability']}{', ggml held to AVX2' if args.isa == 'avx2' else ''}), memory read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s")
    print(f"{'pdserve':<16}{'tok/s':>8}   {'llama.cpp':<10}{'tok/s':>8}{'ratio':>8}{'vs own fp32':>13}")
    fp32 = statistics.median(ours["fp32"]) if "fp32" in ours else None
    for p in precisions:
        a, b = statistics.median(ours[p]), statistics.median(peer[p])
        own = f"{a / fp32:.2f}x" if fp32 and p != "fp32" else ""
        print(f"{(PAIRS[p][0] or 'fp32'):<16}{a:>8.1f}   {PAIRS[p][1]:<10}{b:>8.1f}{a / b:>7.2f}x{own:>13}")
        out.update({f"pdserve_{p}_tok_s": round(a, 2), f"llamacpp_{PAIRS[p][1].lower()}_tok_s": round(b, 2),
                    RATIO_KEYS[p]: round(a / b, 3), f"pdserve_{p}_rounds": [round(v, 2) for v in ours[p]],
                    f"llamacpp_{PAIRS[p][1].lower()}_rounds": [round(v, 2) for v in peer[p]],
                    f"pdserve_{p}_kernels": kernels[p]})
        if fp32 and p != "fp32":
            out[f"{p}_vs_fp32"] = round(a / fp32, 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
