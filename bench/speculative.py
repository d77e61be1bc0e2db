"""Speculative decoding benchmark: tokens/s with and without speculation, per draft source.

For no speculation and each draft source (fixed K and adaptive K), at batch 1 and 8, on two
workloads of the bundled SmolLM2-135M-Instruct (chat template, greedy):

- ``repetitive``: edit a given text or code (the answer copies much of the prompt);
- ``chat``: open questions (little to copy).

Each run: the prompts are prefilled first (not timed); then the decode rate is the tokens made
after every request has its first token, divided by the time since then (``max_tokens`` new
tokens, ``ignore_eos`` so every configuration makes the same number). All configurations are built
first (sharing the target's weights) and run round-robin, ``--reps`` rounds after a warm-up,
so a busy machine slows them alike; the best round is kept per configuration. ``alpha`` is the
share of draft tokens accepted, ``acc_len`` the mean tokens per verify step (accepted + 1), and
``speedup`` the ratio to no speculation in the same workload and batch.

Draft sources: ``ngram`` (prompt lookup), ``layer_skip`` (the target's first layers),
``draft`` (a separate checkpoint: ``--draft-model``, default a tiny random-weight model with
the target's tokenizer built on the fly: the deliberately bad draft, alpha ~0; the only other
checkpoint here is the target itself), ``quant_self`` when the quantization package exists.

Prints a table, then as the last line one flat JSON object with ``best_speedup_b1_repetitive``
(the best source at batch 1 on the repetitive workload) and ``min_adaptive_speedup`` (the
adaptive policy's worst ratio over every source, workload and batch). Run under
``flock /tmp/pdserve-bench.lock``.
"""

from __future__ import annotations

# First: takes bench/ off sys.path, where bench/engine.py would shadow `engine` (bench/__init__.py).
import bench  # noqa: F401

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import engine.llm_engine as le
import engine.models.loader as loader
from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.models.gguf_convert import default_model_path
from engine.request import SamplingParams


CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result


def emails(users):
    return [user["email"] for user in users]
'''
TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, the members agreed to fund the children's section, the study rooms and the "
        "new lighting, but postponed the decision on the cafe until the spring meeting. The "
        "chair thanked the volunteers who had organised the book sale, which raised enough money "
        "to repair the roof.")
REPETITIVE = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Add a docstring to every function in this code and print the whole code:\n\n{CODE}",
    f"Rename the function load_users to read_users everywhere in this code and print the whole code:\n\n{CODE}",
    f"Rewrite this code with 2-space indentation and print the whole code:\n\n{CODE}",
    f"Copy this paragraph, replacing 'committee' by 'board':\n\n{TEXT}",
    f"Print this code again, unchanged:\n\n{CODE}",
    f"Correct any spelling mistakes in this text and print it in full:\n\n{TEXT}",
    f"Convert the function names in this code to camelCase and print the whole code:\n\n{CODE}",
]
CHAT = [
    "Tell me a short story about a dragon who learns to cook.",
    "What are three good ways to learn a new language?",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "What should I pack for a weekend hiking trip?",
    "Give me some tips for a job interview.",
    "Describe the city of Paris in a few sentences.",
    "Why do cats purr?",
]
WORKLOADS = {"repetitive": REPETITIVE, "chat": CHAT}


def tiny_random_draft(target: Path) -> Path:
    """A 2-layer random Llama with the target's tokenizer: the deliberately bad draft."""
    import transformers as tf  # (heavy: transformers, which the engine does not load)
    path = Path(tempfile.mkdtemp(prefix="pdserve-bad-draft-"))
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / f, path / f)
    return path


def run_once(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(decode tok/s after every request has its first token, tokens made in that window)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    reqs = [eng.scheduler.requests[i] for i in ids]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    start_tokens = sum(r.num_output_tokens for r in reqs)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    made = sum(r.num_output_tokens for r in reqs) - start_tokens
    return made / dt, made


def share_weights() -> None:
    """Engines built here share one copy of each (path, dtype, quantization) model: a bench-only
    shortcut so every configuration can live at once (weights are read-only)."""
    cache: dict = {}
    real = loader.load_model

    def cached(path, backend, dtype, device="cpu", quantization=None, prepack=True, single_token=False, **fast):
        # fast: the fast path's rows (compile_rows, min_rows), which differ with K: part of the key
        key = (str(path), dtype, device, str(quantization), prepack, single_token, tuple(sorted(fast.items())))
        if key not in cache:
            cache[key] = real(path, backend, dtype, device, quantization=quantization, prepack=prepack,
                              single_token=single_token, **fast)
        return cache[key]
    loader.load_model = cached
    le.load_model = cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="K for the fixed-K runs (adaptive runs use up to 8)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: stable on a shared 2-core box; 2 spin-waits when it is busy)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--sources", default="ngram,layer_skip,draft,quant_self")
    ap.add_argument("--layer-skip-layers", type=int, default=8)
    ap.add_argument("--draft-model", default=None)
    args = ap.parse_args()

    target = default_model_path(progress=False)
    draft_path = Path(args.draft_model) if args.draft_model else tiny_random_draft(target)
    sources = args.sources.split(",")
    if "quant_self" in sources:
        try:
            import engine.quant  # noqa: F401  (optional: the check below is for a tree without it)
        except ImportError:
            print("quant_self: skipped (engine/quant, the INT4 format of issue 5, is not there yet)",
                  file=sys.stderr)
            sources.remove("quant_self")
    configs: dict[str, SpeculativeConfig | None] = {"none": None}
    for s in sources:
        extra = {"draft_model": str(draft_path)} if s == "draft" else {}
        if s == "layer_skip":
            extra["draft_layers"] = args.layer_skip_layers
        configs[f"{s}-k{args.k}"] = SpeculativeConfig(method=s, num_speculative_tokens=args.k, adaptive=False, **extra)
        configs[f"{s}-adaptive"] = SpeculativeConfig(method=s, num_speculative_tokens=8, adaptive=True, **extra)

    batches = [int(b) for b in args.batches.split(",")]
    share_weights()
    engines = {}
    for name, spec in configs.items():
        engines[name] = eng = LLMEngine(EngineConfig(model=str(target), num_threads=args.threads,
                                                     cache=CacheConfig(memory_gb=0.25, enable_prefix_caching=False),
                                                     speculative=spec), progress=False)
        run_once(eng, [eng.tokenizer("warm up")["input_ids"]], 8)  # first-call costs out of the timings
    prompts = {wl: [engines["none"].tokenize(messages=[{"role": "user", "content": t}]) for t in texts]
               for wl, texts in WORKLOADS.items()}
    keys = ("draft_tokens", "accepted_tokens", "verify_steps", "draft_seconds", "verify_seconds")
    results: dict[tuple[str, str, int], dict] = {}
    for rnd in range(args.reps):
        for wl in WORKLOADS:
            for b in batches:
                batch = (prompts[wl] * b)[:b]
                names = list(engines)
                run_once(engines[names[0]], batch, 4)  # untimed: the first run of a shape pays extra
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:  # rotate the order
                    eng = engines[name]
                    before = eng.spec.stats() if eng.spec else None
                    rate, _ = run_once(eng, batch, args.max_tokens)
                    row = results.setdefault((name, wl, b), {"tok_s": 0.0})
                    print(f"round {rnd} {name:>20} {wl:>10} b{b}: {rate:7.1f} tok/s", file=sys.stderr)
                    if rate <= row["tok_s"]:
                        continue
                    row["tok_s"] = rate
                    if eng.spec:
                        after = eng.spec.stats()
                        d = {k: after[k] - before[k] for k in keys}
                        row["alpha"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0
                        row["acc_len"] = ((d["accepted_tokens"] + d["verify_steps"]) / d["verify_steps"]
                                          if d["verify_steps"] else 1.0)
                        row["draft_s"], row["verify_s"] = d["draft_seconds"], d["verify_seconds"]
    for eng in engines.values():
        assert eng.block_manager.num_used_blocks == 0

    out: dict[str, float] = {}
    print(f"| source | workload | batch | tok/s | alpha | tokens/verify | draft s | verify s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, wl, b), row in results.items():
        base = results[("none", wl, b)]["tok_s"]
        sp = row["tok_s"] / base
        row["speedup"] = sp
        a = f"{row['alpha']:.2f}" if "alpha" in row else "-"
        acc = f"{row['acc_len']:.2f}" if "acc_len" in row else "-"
        ds = f"{row['draft_s']:.2f}" if "draft_s" in row else "-"
        vs = f"{row['verify_s']:.2f}" if "verify_s" in row else "-"
        print(f"| {name} | {wl} | {b} | {row['tok_s']:.1f} | {a} | {acc} | {ds} | {vs} | {sp:.2f}x |")
        key = f"{name}_{wl}_b{b}".replace("-", "_")
        out[f"{key}_tok_s"] = round(row["tok_s"], 2)
        out[f"{key}_speedup"] = round(sp, 3)
        if "alpha" in row:
            out[f"{key}_alpha"] = round(row["alpha"], 3)
            out[f"{key}_acc_len"] = round(row["acc_len"], 3)
    b1 = min(batches)
    out["best_speedup_b1_repetitive"] = round(max(r["speedup"] for (n, w, b), r in results.items()
                                                  if n != "none" and w == "repetitive" and b == b1), 3)
    out["min_adaptive_speedup"] = round(min(r["speedup"] for (n, w, b), r in results.items()
                                            if n.endswith("-adaptive")), 3)
    out["threads"] = args.threads
    out["max_tokens"] = args.max_tokens
    print(json.dumps(out))


if __name__ == "__main__":
    main()
