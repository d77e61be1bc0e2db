"""pdserve against llama.cpp on the same GGUF weights, same machine, same threads.

The peer is llama.cpp as the prebuilt ``node-llama-cpp`` npm package ships it (bench/llamacpp_peer.py:
installed once into ``--peer-dir``, one node process per GGUF file driven over stdin, nothing
compiled; never a pdserve dependency). Runs are interleaved (pdserve, llama.cpp, pdserve, ...
for ``--rounds``) so a noisy neighbour hits both sides; tables give medians [min-max] and the
ratio of medians (pdserve / llama.cpp), beside the machine's memory read bandwidth (``sum()``
over 512 MiB, bench/engine.py) measured in the same run. Last stdout line: one flat JSON object.

``--model NAME`` (a catalogue model: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b,
gemma3-270m) measures three workloads on two pairs:

    decode    batch-1 greedy decode tok/s, 128-token prompt, ``--new-tokens`` (128) new tokens
    prefill   a ``--prefill-tokens`` (512) prompt: its length / time to the first token
    batch8    ``--batch`` (8) requests at once, 128-token prompts: steady decode tok/s, summed

    shipped   pdserve on the GGUF as shipped (4-bit blocks INT4 g32 with the file's codes,
              5-8 bit INT8)                                   llama.cpp on the same file
    int8      pdserve quantization="int8" on that file (``--int8-from q8_0``: the Q8_0 file
              itself, quantization unset)                      llama.cpp on its Q8_0 requant

    shipped-a8, int8-a8   the same two with ``activations="int8"`` (EngineConfig): pdserve's
              INT4/INT8 GEMVs multiply activations quantized per group of 32, as llama.cpp does
              with its K-quants (Q8_K/Q8_0 activations); a separately labelled row, since it
              is not token-identical to HF as the default is. Opt-in: ``--formats
              shipped,shipped-a8``. The llama.cpp side is the same peer, measured again in
              the same round; keys get ``a8_`` in front (``a8_decode_ratio_vs_llamacpp_q4km_1p5b``,
              ``a8_int8_decode_...``), the peer's rounds ``..._pair_a8_<tag>``.

The Q8_0 requant (every tensor dequantized, re-quantized to Q8_0; shared/peers/gguf_requant.py)
is written once next to the model: ``<models dir>/<file stem>.q8_0.gguf``. Decode tok/s on both
sides is the steady rate (tokens after every request has its first token / time since), each
measurement after a warm-up of the same shape. JSON keys, with the model's tag (``1p5b``, ``0p5b``,
``gemma3_270m``, ``smollm2``) and the shipped file's type (``q4km``; ``q4_1`` for smollm2):
``decode_ratio_vs_llamacpp_q4km_1p5b``, ``prefill_ratio_...``, ``batch8_ratio_...``,
``int8_decode_ratio_vs_llamacpp_q8_0_1p5b`` (and ``int8_prefill_...``, ``int8_batch8_...``),
``pdserve_<shipped|int8>_<workload>_tok_s_<tag>``, ``llamacpp_<type>_<workload>_tok_s_<tag>``,
their ``..._rounds_<tag>`` lists, ``read_bandwidth_gb_s_<tag>`` (median of the rounds).

Without ``--model`` (the old default): batch-1 decode on the bundled SmolLM2-135M, three pairs
of the same bytes per weight, JSON keys ``fp32_ratio_vs_llamacpp``, ``int8_ratio_vs_llamacpp_q8_0``,
``int4_ratio_vs_llamacpp_q4_1``, ``int8_vs_fp32``, ``int4_vs_fp32``:

    fp32   pdserve fp32 (compiled one-token path)          llama.cpp F32
    int8   pdserve int8 (per channel, compiled path)       llama.cpp Q8_0   (8.5 bits/weight)
    int4   pdserve int4-g32-asym (RTN of the same weights) llama.cpp Q4_1   (4 bits + a scale and
                                                           a min per 32: 5 bits/weight in both)

``--isa avx2`` runs both sides as an AVX2-only CPU would, on any x86-64: pdserve with
``make test-avx2``'s dispatch switches (torch, inductor, oneDNN, fbgemm, MKL held to AVX2), the
peer from a copy of its install (hard links) without the ggml CPU variants that need more than
AVX2 + FMA (ggml loads the best variant the CPU supports). Memory bandwidth stays this machine's.

``--isa avx512`` holds both sides to AVX-512 with VNNI and BF16 but no AMX, the ISA of AMD's
EPYC Zen 4/5 (and Intel's Cooper Lake), on a Xeon that has AMX: pdserve without its AMX
kernels (``PDSERVE_AMX=0``) and oneDNN held to ``AVX512_CORE_BF16``; the peer without ggml's
AMX variant. The ISA only: Zen 4 runs 512-bit instructions as two 256-bit halves, its caches and
memory differ, so this bounds that class's ratio from here, it does not measure it.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.llamacpp_peer import LlamaCppPeer, ensure_peer, held_peer, log, requant

PROMPT_LEN = 128  # bench/engine.py's decode prompt
# --isa: the dispatch switches that hold pdserve to a smaller CPU class (torch reads them at import)
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           # (fbgemm's AVX512_E1: with VNNI; MKL at its base AVX-512, below VNNI + BF16: its fp32 GEMMs use neither)
           "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1",
                      "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                      "PDSERVE_AMX": "0"}}
ISA_FLAGS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512_vnni", "avx512_bf16")}  # what a hold needs
ISA_LABELS = {"native": "", "avx2": ", ggml held to AVX2", "avx512": ", both held to AVX-512 without AMX"}

# ---- without --model: the bundled model at three precisions --------------------------------------
PAIRS = {"fp32": (None, "F32"), "int8": ("int8", "Q8_0"), "int4": ("int4-g32-asym", "Q4_1")}
RATIO_KEYS = {"fp32": "fp32_ratio_vs_llamacpp", "int8": "int8_ratio_vs_llamacpp_q8_0",
              "int4": "int4_ratio_vs_llamacpp_q4_1"}

# ---- --model NAME --------------------------------------------------------------------------------
# catalogue name -> (JSON key suffix, the shipped file's llama.cpp type in keys)
MODELS = {"qwen2.5-coder-1.5b": ("1p5b", "q4km"), "qwen2.5-coder-0.5b": ("0p5b", "q4km"),
          "gemma3-270m": ("gemma3_270m", "q4km"), "smollm2-135m": ("smollm2", "q4_1")}
FORMATS = ("shipped", "int8", "shipped-a8", "int8-a8")
DEFAULT_FORMATS = ("shipped", "int8")
WORKLOADS = ("decode", "prefill", "batch8")
PEER_TYPE_NAMES = {"q4km": "Q4_K_M", "q4_1": "Q4_1", "q8_0": "Q8_0"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.vs_llamacpp", description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring (and bench/README.md) for the pairs and keys.")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="a catalogue model: decode, prefill and batch-8 decode, as shipped and INT8 / Q8_0 "
                        "(default: none, the old three-precision decode run on the bundled SmolLM2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per decode run (default 128)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, 8 new tokens, a 64-token prefill (numbers mean nothing)")
    p.add_argument("--isa", default="native", choices=["native", *ISA_ENV],
                   help="native, or both sides held to AVX2 + FMA (avx2) or to AVX-512 + VNNI + BF16 "
                        "without AMX (avx512: the EPYC Zen 4 ISA); see the module docstring")
    p.add_argument("--peer-dir", default=str(Path.home() / ".cache" / "pdserve" / "llamacpp-peer"),
                   help="where node-llama-cpp is installed (on first use) and the old run's GGUF copies live")
    g = p.add_argument_group("with --model")
    g.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill workload")
    g.add_argument("--batch", type=int, default=8, help="concurrent requests of the batch workload (default 8)")
    g.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help="of shipped,int8,shipped-a8,int8-a8 (default shipped,int8; -a8: INT8 activations)")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help="decode,prefill,batch8 (default all)")
    g.add_argument("--int8-from", choices=["shipped", "q8_0"], default="shipped",
                   help="pdserve's INT8: quantization=int8 on the shipped file (default), or the Q8_0 "
                        "requant loaded as shipped")
    g = p.add_argument_group("without --model")
    g.add_argument("--precisions", default="fp32,int8,int4", help="which pairs (default fp32,int8,int4)")
    return p


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def model_tag(name: str) -> str:
    return MODELS[name][0]


def base_format(fmt: str) -> str:
    """"shipped" or "int8": the weights of pair ``fmt`` (an ``-a8`` pair: the same, INT8 activations)."""
    return fmt.removesuffix("-a8")


def peer_type(name: str, fmt: str) -> str:
    """The llama.cpp side of pair ``fmt`` as it appears in keys: "q4km", "q4_1" or "q8_0"."""
    return "q8_0" if base_format(fmt) == "int8" else MODELS[name][1]


def peer_key(name: str, fmt: str, workload: str, what: str) -> str:
    """e.g. ``llamacpp_q4km_decode_tok_s_1p5b``; the peer measured beside an -a8 pair: ``..._pair_a8_1p5b``."""
    pair = "_pair_a8" if fmt.endswith("-a8") else ""
    return f"llamacpp_{peer_type(name, fmt)}_{workload}_{what}{pair}_{model_tag(name)}"


def workload_name(workload: str, batch: int) -> str:
    return f"batch{batch}" if workload == "batch8" else workload


def ratio_key(name: str, fmt: str, workload: str) -> str:
    """e.g. ``decode_ratio_vs_llamacpp_q4km_1p5b``, ``int8_decode_ratio_vs_llamacpp_q8_0_1p5b``,
    ``a8_decode_ratio_vs_llamacpp_q4km_1p5b``."""
    prefix = ("a8_" if fmt.endswith("-a8") else "") + ("int8_" if base_format(fmt) == "int8" else "")
    return f"{prefix}{workload}_ratio_vs_llamacpp_{peer_type(name, fmt)}_{model_tag(name)}"


def model_results(name: str, ours: dict[tuple[str, str], list[float]], peer: dict[tuple[str, str], list[float]],
                  read_bw: list[float], batch: int = 8) -> dict:
    """The measured part of the JSON line: per (format, workload) pdserve and llama.cpp rounds,
    their medians and the ratio of medians; the read bandwidth's median and rounds."""
    tag = model_tag(name)
    out: dict = {}
    for (fmt, wl), a_runs in ours.items():
        b_runs, w = peer[(fmt, wl)], workload_name(wl, batch)
        a, b = statistics.median(a_runs), statistics.median(b_runs)
        out[ratio_key(name, fmt, w)] = round(a / b, 3)
        key = fmt.replace("-", "_")
        out[f"pdserve_{key}_{w}_tok_s_{tag}"] = round(a, 2)
        out[peer_key(name, fmt, w, "tok_s")] = round(b, 2)
        out[f"pdserve_{key}_{w}_rounds_{tag}"] = [round(v, 2) for v in a_runs]
        out[peer_key(name, fmt, w, "rounds")] = [round(v, 2) for v in b_runs]
    out[f"read_bandwidth_gb_s_{tag}"] = round(statistics.median(read_bw), 2)
    out[f"read_bandwidth_rounds_{tag}"] = [round(v, 2) for v in read_bw]
    return out


def model_table(name: str, res: dict, meta: dict) -> str:
    """The stdout table of a --model run, from its JSON object (``res``) and the run's settings."""
    tag, batch = model_tag(name), meta["batch"]
    bw = res[f"read_bandwidth_rounds_{tag}"]
    rows = {"decode": f"decode b1, {meta['prompt_tokens']}+{meta['new_tokens']}",
            "prefill": f"prefill {meta['prefill_tokens']}",
            f"batch{batch}": f"decode b{batch}, {meta['prompt_tokens']}+{meta['new_tokens']}, total"}

    def cell(runs: list[float]) -> str:
        m, lo, hi = spread(runs)
        return f"{m:.1f} [{lo:.1f}-{hi:.1f}]"

    lines = [f"pdserve vs llama.cpp on {name} ({meta['model_file']}), {meta['threads']} threads, tok/s as "
             f"median [min-max] of {meta['rounds']} interleaved round(s){', QUICK' if meta['quick'] else ''}",
             f"CPU {meta['cpu_class']} (torch dispatch {meta['cpu_capability']}"
             f"{ISA_LABELS[meta['isa']]}); memory read {cell(bw)} GB/s "
             f"(512 MiB sum, each round), copy {res[f'copy_bandwidth_gb_s_{tag}']:.1f} GB/s",
             f"{'':<34}{'pdserve tok/s':>22}{'llama.cpp tok/s':>22}{'ratio':>9}"]
    for fmt in FORMATS:
        ptype = peer_type(name, fmt)
        ours_label = "as shipped" if base_format(fmt) == "shipped" else (
            "int8 (Q8_0 file)" if meta["int8_from"] == "q8_0" else "int8")
        ours_label += ", INT8 activations" if fmt.endswith("-a8") else ""
        head = f"pdserve {ours_label} / llama.cpp {PEER_TYPE_NAMES[ptype]}"
        body = []
        for w, label in rows.items():
            a = res.get(f"pdserve_{fmt.replace('-', '_')}_{w}_rounds_{tag}")
            if a is None:
                continue
            b = res[peer_key(name, fmt, w, "rounds")]
            body.append(f"  {label:<32}{cell(a):>22}{cell(b):>22}{res[ratio_key(name, fmt, w)]:>8.2f}x")
        if body:
            lines += [head, *body]
    return "\n".join(lines)


def csv(value: str, valid: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in valid]
    if bad or not items:
        raise SystemExit(f"bench.vs_llamacpp: unknown {what} {bad or value!r} (valid: {', '.join(valid)})")
    return items


# ---- pdserve -------------------------------------------------------------------------------------
def load_engine(model: str | None, quantization: str | None, threads: int, num_blocks: int = 64,
                activations: str = "float32"):
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=model, quantization=quantization, num_threads=threads, activations=activations,
                                  cache=CacheConfig(num_blocks=num_blocks, block_size=16)), progress=False)


def served_as_shipped(name: str) -> str:
    """What ``EngineConfig.model`` takes to serve catalogue model ``name``'s GGUF as shipped: the
    name, or for the bundled model (which its name serves as the fp32 folder) its GGUF file."""
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.models import catalog
    entry = catalog.lookup(name)
    if entry is None:
        raise catalog.unknown_model_error(name)
    return str(catalog.resolve(name)) if entry.bundled else name


# ---- the runs ------------------------------------------------------------------------------------
def machine_meta(args: argparse.Namespace) -> dict:
    # (heavy: torch and the engine, loaded only by what uses them)
    from engine.quant.cpu_kernels import cpu_class
    return {"isa": args.isa, "threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens,
            "prompt_tokens": PROMPT_LEN, "quick": args.quick, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_class": cpu_class(), "torch_version": torch.__version__}


def run_model(args: argparse.Namespace, script: Path) -> dict:
    """The --model run; returns the JSON object (and prints the table)."""
    # (heavy: torch and the engine, loaded only by what uses them)
    from bench.engine import Prompts, copy_bandwidth_gb_s, engine_decode, engine_prefill, read_bandwidth_gb_s
    from engine.models import catalog

    name = args.model
    formats = csv(args.formats, FORMATS, "format")
    workloads = csv(args.workloads, WORKLOADS, "workload")
    src = catalog.resolve(name)  # raises: not pulled yet (`pdserve pull NAME`)
    q8 = (requant(src, catalog.models_dir() / f"{src.stem}.q8_0.gguf", "Q8_0")
          if any(base_format(f) == "int8" for f in formats) else None)
    peer_files = {"shipped": src, "int8": q8}
    ours_cfg = {"shipped": (served_as_shipped(name), None),
                "int8": (str(q8), None) if args.int8_from == "q8_0" else (served_as_shipped(name), "int8")}
    # KV for the batch workload (and the prefill), 16-token blocks, plus slack
    blocks = max(args.batch * -(-(PROMPT_LEN + args.new_tokens) // 16), -(-(args.prefill_tokens + 1) // 16)) + 16
    engines, peers = {}, {}
    try:
        for fmt in formats:
            base, act = base_format(fmt), "int8" if fmt.endswith("-a8") else "float32"
            model, quant = ours_cfg[base]
            log(f"loading pdserve {fmt} ({Path(model).name}, quantization={quant}, activations={act}) ...")
            engines[fmt] = load_engine(model, quant, args.threads, blocks, act)
            if base not in peers:  # one peer per file: an -a8 pair measures the same one again
                log(f"starting llama.cpp on {peer_files[base].name} ...")
                peers[base] = LlamaCppPeer(script, peer_files[base], args.threads)
        prompts = Prompts(engines[formats[0]].model_config.vocab_size)
        ours: dict[tuple[str, str], list[float]] = {(f, w): [] for w in workloads for f in formats}
        peer: dict[tuple[str, str], list[float]] = {(f, w): [] for w in workloads for f in formats}
        read_bw: list[float] = []
        t0 = time.perf_counter()
        for r in range(args.rounds):
            read_bw.append(read_bandwidth_gb_s())
            log(f"round {r + 1}/{args.rounds}: memory read {read_bw[-1]:.1f} GB/s")
            for wl in workloads:
                for fmt in formats:
                    eng, pr, seed = engines[fmt], peers[base_format(fmt)], r
                    if wl == "decode":
                        a = engine_decode(eng, prompts, 1, args.new_tokens, reps=1)["decode_tok_s"]
                        b = pr.decode(PROMPT_LEN, args.new_tokens, seed)
                    elif wl == "prefill":
                        a = engine_prefill(eng, prompts, args.prefill_tokens, reps=1)["tok_s"]
                        b = pr.prefill(args.prefill_tokens, seed)
                    else:
                        a = engine_decode(eng, prompts, args.batch, args.new_tokens, reps=1)["decode_tok_s"]
                        b = pr.batch(args.batch, PROMPT_LEN, args.new_tokens, seed)
                    ours[(fmt, wl)].append(a)
                    peer[(fmt, wl)].append(b)
                    log(f"round {r + 1}/{args.rounds} {workload_name(wl, args.batch)} {fmt}: pdserve {a:.1f} tok/s, "
                        f"llama.cpp {PEER_TYPE_NAMES[peer_type(name, fmt)]} {b:.1f} tok/s "
                        f"({time.perf_counter() - t0:.0f}s)")
        kernels = {fmt: engines[fmt].kernels for fmt in formats}
    finally:
        for pr in peers.values():
            pr.close()
        engines.clear()
    tag = model_tag(name)
    meta = {"model": name, "model_file": src.name, "model_tag": tag, **machine_meta(args),
            "prefill_tokens": args.prefill_tokens, "batch": args.batch, "int8_from": args.int8_from}
    res = model_results(name, ours, peer, read_bw, args.batch)
    res[f"copy_bandwidth_gb_s_{tag}"] = round(copy_bandwidth_gb_s(), 2)
    for fmt in formats:
        res[f"pdserve_{fmt}_kernels_{tag}"] = kernels[fmt]
    print(model_table(name, res, meta))
    return {**meta, **res}


def run_precisions(args: argparse.Namespace, script: Path) -> dict:
    """The run without --model (the old default); returns the JSON object (and prints the table)."""
    # (heavy: torch and the engine, loaded only by what uses them)
    from bench.engine import Prompts, copy_bandwidth_gb_s, engine_decode, read_bandwidth_gb_s
    from engine.models.gguf_convert import bundled_gguf_path

    precisions = csv(args.precisions, tuple(PAIRS), "precision")
    peer_dir = Path(args.peer_dir).expanduser()
    src = bundled_gguf_path()
    ggufs = {p: src if PAIRS[p][1] == "Q4_1" else requant(src, peer_dir / f"{src.stem}.{PAIRS[p][1]}.gguf",
                                                          PAIRS[p][1]) for p in precisions}
    engines, peers = {}, {}
    try:
        for p in precisions:
            log(f"loading pdserve {p} ({PAIRS[p][0] or 'fp32'}) and llama.cpp {PAIRS[p][1]} ...")
            engines[p] = load_engine(None, PAIRS[p][0], args.threads)
            peers[p] = LlamaCppPeer(script, ggufs[p], args.threads)
        prompts = Prompts(engines[precisions[0]].model_config.vocab_size)
        ours: dict[str, list[float]] = {p: [] for p in precisions}
        peer: dict[str, list[float]] = {p: [] for p in precisions}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            for p in precisions:
                ours[p].append(engine_decode(engines[p], prompts, 1, args.new_tokens, reps=1)["decode_tok_s"])
                # a warm-up as long as the run, as when each run was its own process
                peer[p].append(peers[p].decode(PROMPT_LEN, args.new_tokens, seed=r, warmup=args.new_tokens))
                log(f"round {r + 1}/{args.rounds} {p}: pdserve {ours[p][-1]:.1f} tok/s, llama.cpp {PAIRS[p][1]} "
                    f"{peer[p][-1]:.1f} tok/s ({time.perf_counter() - t0:.0f}s)")
        kernels = {p: engines[p].kernels for p in precisions}
    finally:
        for pr in peers.values():
            pr.close()
        engines.clear()
    read_bw, copy_bw = read_bandwidth_gb_s(), copy_bandwidth_gb_s()
    out: dict = {**machine_meta(args), "read_bandwidth_gb_s": round(read_bw, 2),
                 "copy_bandwidth_gb_s": round(copy_bw, 2)}
    print(f"batch-1 decode, {PROMPT_LEN}-token prompt, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds; CPU {out['cpu_class']} (torch dispatch "
          f"{out['cpu_capability']}{ISA_LABELS[args.isa]}), "
          f"memory read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s")
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
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    held = ISA_ENV.get(args.isa, {})
    if held:
        # (heavy: the engine, loaded only by what uses it)
        from engine.models.native import cpu_flags
        missing = [f for f in ISA_FLAGS[args.isa] if f not in cpu_flags()]
        if missing:
            raise SystemExit(f"bench.vs_llamacpp: --isa {args.isa} needs a CPU with {', '.join(missing)}")
    if any(os.environ.get(k) != v for k, v in held.items()):
        # torch reads these at import: start again with them set; inductor's kernels in their own
        # cache (one cache shared by two ISAs served kernels compiled for the other)
        env = {**os.environ, **held, "TORCHINDUCTOR_CACHE_DIR": os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"pdserve-inductor-{args.isa}")}
        os.execve(sys.executable, [sys.executable, "-m", "bench.vs_llamacpp", *(argv or sys.argv[1:])], env)
    if args.quick:
        args.rounds, args.new_tokens, args.prefill_tokens = 1, 8, 64
    if args.rounds < 1 or args.new_tokens < 2 or args.batch < 1 or args.prefill_tokens < 1:
        raise SystemExit("bench.vs_llamacpp: need rounds >= 1, new tokens >= 2, batch >= 1, prefill tokens >= 1")
    torch.set_num_threads(args.threads)
    peer_dir = Path(args.peer_dir).expanduser()
    script = ensure_peer(peer_dir)
    if args.isa != "native":
        script = held_peer(peer_dir, args.isa)
    out = run_model(args, script) if args.model else run_precisions(args, script)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
