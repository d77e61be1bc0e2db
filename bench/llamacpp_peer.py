"""llama.cpp as a benchmark peer: the prebuilt ``node-llama-cpp`` npm package, nothing compiled.

``ensure_peer(dir)`` installs node-llama-cpp 3.22.1 into ``dir`` once and copies the driver
(``llamacpp_peer.mjs``, beside this file) there; ``held_peer`` makes a hard-linked copy of that
install with only the ggml CPU variants a held CPU class could load (AVX2 + FMA; or AVX-512 +
VNNI + BF16 without AMX). ``requant`` writes a GGUF with every tensor dequantized to F32 or
re-quantized to Q8_0 (the ``gguf`` package, as shared/peers/gguf_requant.py does).
``LlamaCppPeer`` is one node process with one model loaded, asked for one measurement at a time
over stdin/stdout, so a run interleaved with pdserve loads each model once:

    start --model loaded, {"ready"}--> ready --command line--> measuring --JSON line--> ready
          ... close() (or the process dies: the next ask raises with its stderr)

It is never a pdserve dependency; it needs ``node`` and ``npm`` on PATH.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NODE_LLAMA_CPP = "node-llama-cpp@3.22.1"
DRIVER = Path(__file__).with_name("llamacpp_peer.mjs")
# ggml CPU variants an AVX2 + FMA CPU can load (the others need AVX-512, AVX-VNNI or AMX)
GGML_AVX2_VARIANTS = ("x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell")
# ... and those an AVX-512 + VNNI + BF16 CPU without AMX can load (Zen 4's ISA: not alderlake,
# which needs AVX-VNNI, nor sapphirerapids, which uses AMX)
GGML_AVX512_VARIANTS = GGML_AVX2_VARIANTS + ("skylakex", "cannonlake", "cascadelake", "icelake", "cooperlake",
                                             "zen4")
HELD_VARIANTS = {"avx2": GGML_AVX2_VARIANTS, "avx512": GGML_AVX512_VARIANTS}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_peer(peer_dir: Path) -> Path:
    """node-llama-cpp installed in ``peer_dir`` (first use: ~1 min) and the driver copied there;
    returns the driver's path there (node resolves the package from the script's folder)."""
    if not shutil.which("node") or not shutil.which("npm"):
        raise SystemExit("llama.cpp peer: needs node and npm on PATH (the peer is an npm package)")
    peer_dir.mkdir(parents=True, exist_ok=True)
    if not (peer_dir / "node_modules" / "node-llama-cpp").is_dir():
        log(f"installing {NODE_LLAMA_CPP} into {peer_dir} (prebuilt llama.cpp, ~1 min) ...")
        subprocess.run(["npm", "install", NODE_LLAMA_CPP, "--no-audit", "--no-fund"], cwd=peer_dir, check=True,
                       stdout=subprocess.DEVNULL)
    script = peer_dir / DRIVER.name
    shutil.copyfile(DRIVER, script)
    return script


def held_peer(peer_dir: Path, isa: str) -> Path:
    """A copy of the peer install (hard links) whose ggml keeps only the CPU variants an ``isa``
    CPU can load (ggml loads the best variant the CPU supports): "avx2", AVX2 + FMA only;
    "avx512", AVX-512 + VNNI + BF16 without AMX. The copy is made once and filtered on every use
    (a copy an older list filtered keeps nothing the list now excludes)."""
    if isa not in HELD_VARIANTS:
        raise ValueError(f"isa must be one of {sorted(HELD_VARIANTS)}, got {isa!r}")
    out = peer_dir.parent / f"{peer_dir.name}-{isa}"
    if not (out / "node_modules").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(peer_dir / "node_modules"), str(out / "node_modules")], check=True)
    libs = list((out / "node_modules").rglob("libggml-cpu-*.so"))
    best = "haswell" if isa == "avx2" else "zen4"  # the variant the hold is for
    if not any(lib.name == f"libggml-cpu-{best}.so" for lib in libs):
        shutil.rmtree(out)
        raise SystemExit(f"llama.cpp peer: this node-llama-cpp ships no libggml-cpu-{best}.so "
                         f"(no per-CPU ggml variants, or other ones): --isa {isa} cannot hold it")
    for lib in libs:
        if lib.name.removeprefix("libggml-cpu-").removesuffix(".so") not in HELD_VARIANTS[isa]:
            lib.unlink()
    script = out / DRIVER.name
    shutil.copyfile(DRIVER, script)
    return script


def requant(src: Path, dst: Path, kind: str) -> Path:
    """``dst``: ``src`` with every tensor as ``kind`` ("F32", or "Q8_0" where a 2-D tensor's rows
    are whole blocks of 32; the rest F32). Written once (via ``dst.part``), then reused."""
    if dst.is_file():
        return dst
    if kind not in ("F32", "Q8_0"):
        raise ValueError(f"requant kind must be F32 or Q8_0, got {kind!r}")
    # (heavy: numpy, loaded only by what uses them; optional: the gguf package, only to requantize for llama.cpp)
    import gguf
    import numpy as np
    log(f"writing {dst} (every tensor of {src.name} as {kind}; once) ...")
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = Path(str(dst) + ".part")
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(part), reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, "general.file_type") or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        writer.add_key_value(field.name, field.contents(), vt,
                             sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # numpy order: rows last
        if kind == "Q8_0" and w.ndim == 2 and w.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.rename(dst)
    return dst


class LlamaCppPeer:
    """One node process running ``script`` (``ensure_peer``'s driver) on one GGUF file.

    Raises:
        RuntimeError: the process failed to load the model, died, or a command failed (with the
            tail of its stderr or the driver's error).
    """

    def __init__(self, script: Path, gguf_path: Path, threads: int) -> None:
        self.name = gguf_path.name
        self._err = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(["node", str(script), str(gguf_path), str(threads)], cwd=script.parent,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                      text=True, bufsize=1)
        self._read()  # {"ready": true} once the model is loaded

    def _read(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._err.seek(0)
            raise RuntimeError(f"llama.cpp peer on {self.name} exited ({self._proc.returncode}): "
                               f"{self._err.read()[-1500:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp peer on {self.name}: {reply['error'][-1500:]}")
        return reply

    def ask(self, **cmd) -> dict:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def _rate(self, reply: dict, new: int) -> float:
        if reply["min_tokens"] < new:  # the driver never stops at EOS: this would be a bug
            raise RuntimeError(f"llama.cpp peer on {self.name}: a sequence stopped after {reply['min_tokens']} tokens")
        return float(reply["tok_s"])

    def decode(self, prompt: int, new: int, seed: int, warmup: int = 8) -> float:
        """Batch-1 greedy decode tok/s after a ``prompt``-token prompt."""
        return self._rate(self.ask(op="decode", prompt=prompt, new=new, seed=seed, warmup=warmup), new)

    def prefill(self, prompt: int, seed: int) -> float:
        """``prompt`` / time to the first token, the prompt in one batch."""
        return float(self.ask(op="prefill", prompt=prompt, seed=seed)["tok_s"])

    def batch(self, n: int, prompt: int, new: int, seed: int, warmup: int = 8) -> float:
        """Steady decode tok/s summed over ``n`` sequences generating at once."""
        return self._rate(self.ask(op="batch", n=n, prompt=prompt, new=new, seed=seed, warmup=warmup), new)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # the driver's loop ends at EOF and exits
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._err.close()

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
