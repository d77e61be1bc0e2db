"""``pdserve generate --local`` and ``pdserve serve --local``: the engine in this process, no cluster."""

from __future__ import annotations

import argparse
import json
import sys
import time

EXAMPLE_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
]


def build_engine(args: argparse.Namespace, chat: bool = False):
    """The engine of the engine options; ``chat``: refuse (before loading) a model without a chat template."""
    # (heavy: torch and the engine, loaded only for --local)
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.models.loader import resolve_model_path
    dtype = args.dtype or "float32"
    path = resolve_model_path(args.model)  # a bad name or file stops here, before the slow load
    if chat and not _has_chat_template(path):
        raise ValueError(f"model {args.model or 'bundled'!r} has no chat template (a base model, not "
                         "instruction-tuned): give a plain text prompt (no --chat)")
    # --dtype given: a GGUF model's weights in that dtype, not as shipped (no effect on others)
    kv_gb = "auto" if args.kv_cache_gb is None else args.kv_cache_gb
    if kv_gb == "auto":  # one engine, alone on this machine: all that is left (pages resident as used)
        from engine.kv_budget import estimate_weights_bytes, kv_budget, node_available_bytes  # (heavy: the engine)
        budget = kv_budget(node_available_bytes(), estimate_weights_bytes(path, dtype, args.dtype is not None),
                           "colocated", {"colocated": 1})
        print(budget.describe(), file=sys.stderr, flush=True)
        kv_gb = budget.kv_cache_gib
    cfg = EngineConfig(model=str(path), dtype=dtype, num_threads=args.threads, dequantize=args.dtype is not None,
                       activations=args.activations or "float32",
                       cache=CacheConfig(memory_gb=kv_gb),
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens or 2048))
    print(f"loading {args.model or 'bundled SmolLM2-135M-Instruct'} ({_precision(path, args.dtype)}) ...",
          file=sys.stderr, flush=True)
    eng = LLMEngine(cfg)
    print(f"loaded in {eng.load_seconds:.1f} s; {eng.block_manager.num_blocks} KV blocks of "
          f"{eng.block_manager.block_size} tokens, context limit {eng.max_model_len}",
          file=sys.stderr, flush=True)
    return eng


def _precision(path, dtype: str | None) -> str:
    """How the weights of the model folder ``path`` load, for the loading line."""
    from engine.models import gguf  # (heavy: the engine, loaded only for --local)
    if gguf.source(path) is not None and dtype is None:
        return "GGUF weights as shipped, float32 activations"
    return dtype or "float32"


def _has_chat_template(path) -> bool:
    from transformers import AutoTokenizer  # (heavy: transformers, loaded only for --local)
    return AutoTokenizer.from_pretrained(str(path)).chat_template is not None


def params(args: argparse.Namespace):
    """The sampling options as the engine's SamplingParams (checked: bad values raise ValueError)."""
    from engine.request import SamplingParams  # (heavy: the engine imports torch)
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos)


def generate(args: argparse.Namespace) -> int:
    """``pdserve generate --local``: one prompt, its text streamed (or one JSON object at the end)."""
    sampling = params(args)  # validate before the slow model load
    eng = build_engine(args, chat=args.chat)
    t0 = time.monotonic()
    if args.chat:
        eng.add_request(messages=[{"role": "user", "content": args.prompt}], params=sampling)
    else:
        eng.add_request(args.prompt, sampling)
    final = None
    for out in eng.stream():
        if not args.json:
            print(out.new_text, end="", flush=True)
        final = out
    total = time.monotonic() - t0
    assert final is not None
    if args.json:
        print(json.dumps({
            "text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason,
            "prompt_tokens": final.num_prompt_tokens, "completion_tokens": len(final.token_ids),
            "timing": {"ttft_s": final.ttft, "mean_tpot_s": final.mean_tpot, "total_s": total,
                       "tokens_per_s": len(final.token_ids) / total if total > 0 else None},
        }))
    else:
        tpot = f"{final.mean_tpot * 1e3:.1f} ms" if final.mean_tpot else "n/a"
        print(f"\n[{final.finish_reason}; {len(final.token_ids)} tokens; TTFT {final.ttft * 1e3:.0f} ms; "
              f"TPOT {tpot}]", file=sys.stderr)
    return 0


def serve(args: argparse.Namespace) -> int:
    """``pdserve serve --local``: the example (or given) prompts in one continuous batch."""
    sampling = params(args)
    eng = build_engine(args)
    prompts = args.prompt or EXAMPLE_PROMPTS
    chat = getattr(eng.tokenizer, "chat_template", None) is not None
    if not chat:
        print("this model has no chat template (a base model): each prompt is continued as plain text",
              file=sys.stderr, flush=True)
    t0 = time.monotonic()
    ids = [eng.add_request(messages=[{"role": "user", "content": p}], params=sampling) if chat
           else eng.add_request(p, sampling) for p in prompts]
    n_tokens = _show_in_turn(eng, ids, prompts)
    total = time.monotonic() - t0
    print(f"\n\n{len(ids)} requests, {n_tokens} tokens in {total:.1f} s "
          f"({n_tokens / total:.1f} tok/s in one continuous batch)", file=sys.stderr)
    return 0


def _show_in_turn(eng, ids: list[str], prompts: list[str]) -> int:
    """Run the engine until every request ends; returns the tokens generated. All prompts decode
    together in one continuous batch; the terminal shows one answer live at a time and prints
    the others' text (already generated) when their turn comes."""
    shown = 0
    texts = {i: "" for i in ids}
    done: dict[str, object] = {}
    n_tokens = 0

    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")

    def header(k: int) -> None:
        print(f"\n{bold}[{k + 1}/{len(ids)}] {prompts[k]}{plain}\n", end="", flush=True)

    header(0)
    for out in eng.stream():
        n_tokens += len(out.new_token_ids)
        texts[out.request_id] += out.new_text
        if out.finished:
            done[out.request_id] = out
        if out.request_id == ids[shown]:
            print(out.new_text, end="", flush=True)
        while shown < len(ids) and ids[shown] in done:
            shown += 1
            if shown < len(ids):
                print()
                header(shown)
                print(texts[ids[shown]], end="", flush=True)
    return n_tokens
