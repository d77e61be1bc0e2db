"""transformers' greedy tokens on a GGUF file (and ``generate``'s on an HF folder): computed by
transformers once per input and machine, then kept on disk.

Loading a GGUF into transformers dequantizes every tensor in numpy and builds the fp32 model
before the first forward: on a 2-core machine that is most of a real-model test's time (the
1.5B's). The reference is a function of its inputs alone: the file's bytes, the transformers
and torch versions, torch's CPU dispatch level (AVX2 and AVX-512 round differently), the
prompt's ids and the number of tokens. So each test asks :func:`greedy` first: an entry
recorded by an earlier run with the same inputs is returned, and only the prompts without one
load the model and run (then are recorded). Nothing here is written by hand; the entries live
in ``PDSERVE_HF_REFERENCE_DIR`` (default ``~/.cache/pdserve/hf-reference``), and
``PDSERVE_HF_REFERENCE_DIR=off`` computes every reference afresh.

What transformers' tokenizer makes of a GGUF file's inputs (ids, a rendered chat, decoded text)
is kept the same way (:func:`recorded`): reading a file's vocabulary into transformers takes
10-17 s per load on a 2-core machine, for a few lists of ints.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path

import torch

VERSION = 1  # of the recipe below (hf_greedy): a change to it makes every old entry a miss


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``ids``, one forward per token over its own KV cache, never
    stopping at EOS (``generate`` with ``min_new_tokens`` would forbid EOS instead: other
    tokens than the engine's with ``ignore_eos``)."""
    out, past = [], None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


def load_hf(gguf: Path):
    """transformers' fp32 model of the GGUF file (its tensors dequantized, as ours with
    ``dequantize=True``)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                dtype=torch.float32).eval()


def _folder() -> Path | None:
    where = os.environ.get("PDSERVE_HF_REFERENCE_DIR", "")
    if where == "off":
        return None
    return Path(where) if where else Path("~/.cache/pdserve/hf-reference").expanduser()


def _key(file_digest: str, ids: list[int], n: int) -> str:
    import transformers
    parts = [VERSION, file_digest, transformers.__version__, torch.__version__,
             torch.backends.cpu.get_cpu_capability(), n, ids]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def greedy(gguf: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF's ``n`` greedy tokens after each prompt (see the module docstring); the model is
    loaded only when some prompt has no recorded entry, and freed before returning."""
    from engine.models import gguf as gguf_files
    digest = gguf_files.file_digest(gguf)  # (the whole file read: once, not per prompt)
    return _recorded(digest, gguf.name, "greedy", prompts, n, lambda: load_hf(gguf), hf_greedy)


def generate(folder: Path, prompts: list[list[int]], n: int, load) -> list[list[int]]:
    """HF ``generate``'s greedy new tokens (at most ``n``: it stops at EOS) after each prompt, on
    the HF folder ``folder`` (its config and weights files' bytes are the key), one prompt at a
    time; ``load()`` gives the model, called only when some prompt has no recorded entry."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)

    def run(model, ids: list[int], k: int) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, do_sample=False)
        return g[0, x.shape[1]:].tolist()
    return _recorded(h.hexdigest(), folder.name, "generate", prompts, n, load, run, free=False)


def _recorded(digest: str, source: str, recipe: str, prompts: list[list[int]], n: int, load, run,
              free: bool = True) -> list[list[int]]:
    """Each prompt's tokens from its recorded entry, else ``run(load(), ids, n)`` (the model
    loaded once, for the prompts without one, freed after when ``free``), then recorded."""
    folder = _folder()
    keys = [_key(digest if recipe == "greedy" else f"{recipe}:{digest}", ids, n) for ids in prompts]
    got: list[list[int] | None] = [None] * len(prompts)
    if folder is not None:
        for i, key in enumerate(keys):
            entry = folder / f"{key}.json"
            if entry.is_file():
                got[i] = json.loads(entry.read_text())["tokens"]
    missing = [i for i, g in enumerate(got) if g is None]
    if missing:
        model = load()
        try:
            for i in missing:
                got[i] = run(model, prompts[i], n)
        finally:
            if free:
                del model
                gc.collect()
        if folder is not None:
            for i in missing:
                _write(folder, keys[i], {"file": source, "n": n, "prompt": prompts[i], "tokens": got[i]})
    return [list(g) for g in got]  # type: ignore[arg-type]


def recorded(gguf: Path, recipe: str, inputs, compute):
    """``compute()``'s result (JSON: lists, numbers, strings) for ``inputs`` on the GGUF file,
    e.g. what transformers' tokenizer of the file makes of them; ``compute`` runs only when no
    entry was recorded for the file's bytes, the versions, ``recipe`` and ``inputs``."""
    from engine.models import gguf as gguf_files
    folder = _folder()
    key = _key(f"{recipe}:{gguf_files.file_digest(gguf)}", inputs, 0)
    if folder is not None and (folder / f"{key}.json").is_file():
        return json.loads((folder / f"{key}.json").read_text())["value"]
    value = compute()
    if folder is not None:
        _write(folder, key, {"file": gguf.name, "recipe": recipe, "inputs": inputs, "value": value})
    return value


def _write(folder: Path, key: str, entry: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{key}.{os.getpid()}.tmp"  # whole files only, under any race
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, folder / f"{key}.json")
