"""The native small-step decode kernels (native_decode.c): built at load, called through ctypes.

:func:`library` compiles ``native_decode.c`` once per source, compiler and ISA into a cache
folder (``PDSERVE_NATIVE_CACHE``, default ``~/.cache/pdserve/native``; a few seconds with gcc)
and loads it. The ISA is the one torch dispatches at (``torch.backends.cpu.get_cpu_capability()``,
which ``ATEN_CPU_CAPABILITY`` lowers, as ``make test-avx2`` does): AVX-512 or AVX2 + FMA; any
other CPU, or a machine without a C compiler, gets None and keeps the compiled graphs
(engine/models/single_token.py). The library links the libgomp torch loaded (same soname), so
its threads are torch's OpenMP pool, not a second one competing for the cores.

:class:`NativeLayers` holds the C structs of one model (pointers into the decoder's huge-page
weights, which must outlive it) and runs the calls the compiled graphs would.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models import int4_blocks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_decode.c")
AMX_SOURCE = SOURCE.with_name("native_amx.c")  # included by SOURCE
# What each torch dispatch level may use: exactly what make test-avx2's smallest CPU has, or
# the AVX-512 subset every AVX-512 CPU of this project's kind has (F, BW, VL, DQ).
ISA_FLAGS = {"AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
             "AVX2": ("-mavx2", "-mfma")}
# Added on an AVX-512 CPU that has VNNI (only the INT8-activation kernels use it: vpdpbusd, one
# instruction for what vpmaddubsw + vpmaddwd do otherwise, with the same integer result);
# PDSERVE_NATIVE_VNNI=0 builds without it, as a CPU without VNNI runs.
VNNI_FLAG = "-mavx512vnni"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where that cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_vnni() -> bool:
    return "avx512_vnni" in cpu_flags()
W_F32, W_I8, W_I4 = 0, 1, 2


def cache_dir() -> Path:
    env = os.environ.get("PDSERVE_NATIVE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "native"


# -ffp-contract=off: a multiply and an add written apart stay apart, rounded twice as torch's
# eager ops round them (gcc would fuse them into an FMA); the GEMVs' FMAs are written as such.
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")


def _build(cmd: list[str], out: Path) -> None:
    """Run ``cmd`` (the compile line, writing to the path after its "-o") into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # compiled next to its final name, then renamed: processes building at once each get a
    # whole file, never a half-written one
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [tmp if a == "{out}" else a for a in cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would lock other users out of a shared cache
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library for this process's ISA, or None (logged) where there is none.

    ``CC`` picks the compiler (default gcc): it must link GNU OpenMP (libgomp), the runtime
    torch ships, or its threads would be a second pool competing with torch's."""
    cap = torch.backends.cpu.get_cpu_capability()
    vnni = cap == "AVX512" and cpu_has_vnni() and os.environ.get("PDSERVE_NATIVE_VNNI", "1") != "0"
    return _load(cap, vnni)


@functools.cache
def build_library(cap: str, vnni: bool = False) -> ctypes.CDLL | None:
    """The library built for torch dispatch level ``cap`` ("AVX512", "AVX2"), with VNNI or not
    (tests build each variant this CPU can run), or None (logged) where there is none."""
    return _load(cap, vnni)


def _load(cap: str, vnni: bool) -> ctypes.CDLL | None:
    flags = ISA_FLAGS.get(cap)
    if flags is None or platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("native decode kernels: none for %s/%s, using the compiled graphs", platform.machine(), cap)
        return None
    flags = (*flags, VNNI_FLAG) if vnni else flags
    try:
        cc = shlex.split(os.environ.get("CC") or "gcc")
        cmd = [*cc, *BASE_FLAGS, *flags, str(SOURCE), "-o", "{out}", "-lm"]
        # the key covers the source, the whole command and the compiler's version: a change to
        # any of them builds anew instead of loading a stale library
        version = subprocess.run([*cc, "-dumpfullversion"], capture_output=True, text=True, timeout=60).stdout
        src = SOURCE.read_bytes() + AMX_SOURCE.read_bytes()
        key = hashlib.sha256(src + "\0".join((*cmd, version.strip())).encode()).hexdigest()[:16]
        so = cache_dir() / f"native_decode_{cap.lower()}{'_vnni' if vnni else ''}_{key}.so"
        if not so.exists():
            _build(cmd, so)
        lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        # no compiler, a failed build, an unwritable or unknown home: the compiled graphs serve
        log.warning("native decode kernels unavailable (%s), using the compiled graphs", str(e).splitlines()[0])
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.pd_pre.argtypes = [p, p, i, p, p, p, p]
    lib.pd_post.argtypes = [p, p, i, p, p]
    lib.pd_post_pre.argtypes = [p, p, p, i, p, p, p, p, p]
    lib.pd_logits.argtypes = [p, p, p, i, p, p]
    lib.pd_layer.argtypes = [p, p, p, i, p, p, p, p, p, p, p, p]
    for f in (lib.pd_pre, lib.pd_post, lib.pd_post_pre, lib.pd_logits, lib.pd_layer):
        f.restype = None
    lib.pd_vector_width.restype = i
    lib.pd_linear.argtypes = [p, i, p, p, i]
    lib.pd_dequant_i4.argtypes = [p, p, i]
    lib.pd_linear.restype = lib.pd_dequant_i4.restype = None
    lib.pd_amx_linear.argtypes = [p, i, p, p, i]
    lib.pd_amx_linear.restype = None
    lib.pd_amx_init.restype = i
    i64 = ctypes.c_int64
    lib.pd_mask_logits.argtypes = [p, i64, p, i, p, i64, i64]
    lib.pd_mask_logits.restype = None
    return lib


def enabled_library() -> ctypes.CDLL | None:
    """:func:`library`, unless ``PDSERVE_NATIVE_DECODE=0`` turns the native kernels off (every
    user of them asks here, so one switch turns them all off)."""
    return library() if os.environ.get("PDSERVE_NATIVE_DECODE", "1") != "0" else None


@functools.cache
def amx_library() -> ctypes.CDLL | None:
    """:func:`enabled_library` where prefill-sized INT4 / INT8 steps run on AMX (native_amx.c:
    fp32 arithmetic, the codes times x in three bf16 limbs): the AVX-512 build on a CPU with
    AMX-BF16 whose kernel grants the tile state; ``PDSERVE_AMX=0`` turns it off (the fp32 GEMM
    on the dequantized weight then serves, as on every other CPU)."""
    lib = enabled_library()
    if lib is None or lib.pd_vector_width() != 16 or os.environ.get("PDSERVE_AMX", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or "amx_bf16" not in cpu_flags():
        return None
    return lib if lib.pd_amx_init() == 1 else None


def amx_fits(n: int, k: int, group: int) -> bool:
    """Whether the AMX kernel takes an [n, k] linear: whole blocks of 16 rows and 32 inputs,
    INT4 groups of whole blocks (group 0: INT8, one scale per row)."""
    return n % 16 == 0 and k % 32 == 0 and group % 32 == 0


def amx_linear(lib: ctypes.CDLL, lin: ctypes.Structure, x: torch.Tensor) -> torch.Tensor:
    """x [R, K] fp32 contiguous (the weight's column order) -> x W^T + b [R, N] on AMX."""
    y = torch.empty(x.shape[0], lin.n)
    lib.pd_amx_linear(ctypes.addressof(lin), x.shape[0], x.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


class Lin(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("zs", ctypes.c_void_p), ("b", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kind", ctypes.c_int64), ("group", ctypes.c_int64),
                ("aq", ctypes.c_int64), ("meta", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Lin), ("o", Lin), ("gu", Lin), ("d", Lin), ("ln1", ctypes.c_void_p),
                ("ln2", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("post_attn", ctypes.c_void_p), ("post_ffn", ctypes.c_void_p), ("act", ctypes.c_int64),
                ("window", ctypes.c_int64)]


ACT_SILU, ACT_GELU_TANH = 0, 1


@dataclass(frozen=True)
class LayerSpec:
    """What a layer's C struct holds besides its linears (native_decode.c ``layer_t``): fp32
    norm weights as the kernel multiplies them (Gemma's ``1 + w`` already added), None where the
    family has no such norm; the MLP's activation; the attention window (0: none)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None
    post_ffn: torch.Tensor | None = None
    act: int = ACT_SILU
    window: int = 0


class Ctx(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("inter", ctypes.c_int64), ("nq", ctypes.c_int64),
                ("nkv", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("max_rows", ctypes.c_int64),
                ("threads", ctypes.c_int64), ("eps", ctypes.c_float), ("scratch", ctypes.c_void_p)]


class Attn(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("width", ctypes.c_int64), ("block_size", ctypes.c_int64), ("scale", ctypes.c_float)]


def int4_weights(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, lanes: int, out: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An INT4 linear in the kernels' layout: q [N, K] (0..15) packed into ``out`` (uint8
    [N, K/2]) in blocks of 2 * ``lanes`` columns (byte i: column i low, column lanes + i high),
    and its group scales and zero points [N, K/group] as they are (fp32): the kernels apply
    w = (q - zero) * scale as q * scale + (-zero * scale), one FMA, on every path."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // (2 * lanes), 2, lanes)
    out.view(n, k // (2 * lanes), lanes).copy_(blocks[:, :, 0] | (blocks[:, :, 1] << 4))
    return out, scale.float().contiguous(), zero.float().contiguous()


def int4_codes(w: torch.Tensor, lanes: int) -> torch.Tensor:
    """Inverse of :func:`int4_weights`' packing: the codes q [N, K] (uint8, 0..15)."""
    n, half = w.shape
    blocks = w.view(n, half // lanes, 1, lanes)
    return torch.cat((blocks & 15, blocks >> 4), 2).view(n, 2 * half)


def int8_activations_fit(kind: int, k: int, group: int, lanes: int) -> bool:
    """Whether the INT8-activation kernel serves a linear of this kind with k inputs: INT4 in
    whole chunks of 8 x ``lanes`` inputs and weight groups that are whole activation groups of
    32; INT8 in whole 64-byte chunks. fp32 linears keep fp32 activations."""
    if kind == W_I4:
        return k % (8 * lanes) == 0 and group % 32 == 0
    return kind == W_I8 and k % 64 == 0


def int4_meta_fits(k: int, group: int) -> bool:
    """Whether rows of k inputs in groups of ``group`` can hold compact scales: whole groups in
    whole superblocks (the kernel reads whole superblocks)."""
    return k % group == 0 and (k // group) % int4_blocks.SUPER == 0


def check_int4_meta(meta: torch.Tensor | None, n: int, k: int, group: int) -> None:
    """``meta`` is None or the compact scales of an [n, k] INT4 weight (engine/models/int4_blocks.py)."""
    if meta is None:
        return
    want = (n, k // group // int4_blocks.SUPER * int4_blocks.BLOCK_BYTES)
    if not int4_meta_fits(k, group) or meta.dtype != torch.uint8 or tuple(meta.shape) != want or not meta.is_contiguous():
        raise ValueError(f"compact INT4 scales {tuple(meta.shape)} {meta.dtype}, want contiguous uint8 {want}")


class Int4Kernel:
    """One INT4 linear served by this library from its weights in :func:`int4_weights`' layout
    (the only copy the process holds): any number of rows through the GEMV, or the weights
    dequantized for a GEMM. ``meta``: the compact form of s and z (engine/models/int4_blocks.py),
    which the kernel then reads instead of them. The tensors must outlive this object (their
    owner holds both)."""

    def __init__(self, lib: ctypes.CDLL, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                 group: int, int8_activations: bool = False, meta: torch.Tensor | None = None) -> None:
        if not (w.is_contiguous() and s.is_contiguous() and z.is_contiguous() and b.is_contiguous()):
            raise ValueError("INT4 kernel tensors must be contiguous")
        if s.dtype != torch.float32 or z.dtype != torch.float32 or w.dtype != torch.uint8:
            raise ValueError(f"INT4 kernel reads uint8 codes and fp32 scales/zeros, got {w.dtype} {s.dtype} {z.dtype}")
        n, half = w.shape
        if int8_activations and not int8_activations_fit(W_I4, 2 * half, group, lib.pd_vector_width()):
            raise ValueError(f"INT8 activations need inputs in chunks of {8 * lib.pd_vector_width()} and groups of "
                             f"a multiple of 32, got {2 * half} inputs in groups of {group}")
        check_int4_meta(meta, n, 2 * half, group)
        self.lib, self.n, self.k = lib, n, 2 * half
        self.lin = Lin(w.data_ptr(), s.data_ptr(), z.data_ptr(), b.data_ptr(), n, 2 * half, W_I4, group,
                       int(int8_activations), None if meta is None else meta.data_ptr())
        self.ptr = ctypes.addressof(self.lin)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] fp32 contiguous -> x W^T + b [R, N]."""
        y = torch.empty(x.shape[0], self.n)
        self.lib.pd_linear(self.ptr, x.shape[0], x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """The weights as fp32 [N, K] into ``out`` (numel >= N * K), bit for bit what the GEMV applies."""
        w = out[:self.n * self.k].view(self.n, self.k)
        self.lib.pd_dequant_i4(self.ptr, w.data_ptr(), torch.get_num_threads())
        return w


class Int8Kernel:
    """One INT8 linear with INT8 activations (the only INT8 use outside the one-token layers):
    w int8 [N, K] in interleave4 order, s [N] scales, zs [N] = zero * scale (0 when symmetric).
    The tensors must outlive this object (their owner holds both)."""

    def __init__(self, lib: ctypes.CDLL, w: torch.Tensor, s: torch.Tensor, zs: torch.Tensor, b: torch.Tensor) -> None:
        n, k = w.shape
        if not int8_activations_fit(W_I8, k, 0, lib.pd_vector_width()):
            raise ValueError(f"INT8 activations need inputs in chunks of 64, got {k}")
        for t in (w, s, zs, b):
            if not t.is_contiguous():
                raise ValueError("INT8 kernel tensors must be contiguous")
        if w.dtype != torch.int8 or s.dtype != torch.float32 or zs.dtype != torch.float32:
            raise ValueError(f"INT8 kernel reads int8 weights and fp32 scales, got {w.dtype} {s.dtype} {zs.dtype}")
        self.lib, self.n, self.k = lib, n, k
        self.lin = Lin(w.data_ptr(), s.data_ptr(), zs.data_ptr(), b.data_ptr(), n, k, W_I8, 0, 1, None)
        self.ptr = ctypes.addressof(self.lin)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] fp32 contiguous (natural column order: quantizing it reorders) -> x W^T + b [R, N]."""
        y = torch.empty(x.shape[0], self.n)
        self.lib.pd_linear(self.ptr, x.shape[0], x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y


class NativeLayers:
    """One model's structs and buffers. ``lin``: the linears by name ("{i}.qkv", "{i}.o",
    "{i}.gu", "{i}.d", "head"), each fp32 or INT8 words as single_token.py holds them (w, s,
    zs, b), or INT4 in the layout of :func:`int4_weights` (w, s, z, b, group, meta: the compact
    scales or None); ``specs``: each layer's norms, activation and window; ``norm``: the final
    norm's weight (as the kernel multiplies it)."""

    def __init__(self, lib: ctypes.CDLL, lin: dict[str, tuple], specs: list[LayerSpec], norm: torch.Tensor,
                 eps: float, nq: int, nkv: int, max_rows: int, int8_activations: bool = False) -> None:
        self.lib = lib
        self.int8_activations = int8_activations  # INT4/INT8 linears that fit quantize their inputs
        self._keep: list[torch.Tensor] = []  # every tensor a struct points into
        n = len(specs)
        self.layers = (Layer * n)()
        for i, sp in enumerate(specs):
            norms = [self._ptr(t) for t in (sp.ln1, sp.ln2, sp.q_norm, sp.k_norm, sp.post_attn, sp.post_ffn)]
            self.layers[i] = Layer(self._lin(lin[f"{i}.qkv"]), self._lin(lin[f"{i}.o"]), self._lin(lin[f"{i}.gu"]),
                                   self._lin(lin[f"{i}.d"]), *norms, sp.act, sp.window)
        hidden, inter = specs[0].ln1.numel(), self.layers[0].gu.n // 2
        self.head_dim = self.layers[0].qkv.n // (nq + 2 * nkv)
        self.head = self._lin(lin["head"])
        self.vocab = self.head.n
        self.norm = self._ptr(norm)
        wide = max(hidden, 2 * inter, nq * self.head_dim)  # every linear's input and output
        self.scratch = torch.empty(4 * max_rows * wide)
        self.ctx = Ctx(hidden, inter, nq, nkv, self.head_dim, max_rows, torch.get_num_threads(), eps,
                       self.scratch.data_ptr())
        self.ctx_p = ctypes.addressof(self.ctx)
        self.layer_p = [ctypes.addressof(self.layers[i]) for i in range(n)]
        self.head_p = ctypes.addressof(self.head)
        # the q/k/v of each step size, rewritten by every layer (attention reads them first),
        # and the attention output the native attention writes
        self.qkv = [torch.empty(r, nq + 2 * nkv, self.head_dim) for r in range(1, max_rows + 1)]
        self.o = torch.empty(max_rows, nq * self.head_dim)
        self.lanes = lib.pd_vector_width()

    def attends(self, backend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether attention can run natively too: the CPU SDPA backend's layout (flat fp32 slots
        [slots, nkv, D], contiguous) and a head size the kernel's vectors and buffer fit."""
        k = kv_caches[0][0]
        return (getattr(backend, "name", "") == "sdpa" and k.dtype == torch.float32 and k.is_contiguous()
                and k.device.type == "cpu" and self.head_dim % self.lanes == 0 and self.head_dim <= 256)

    def step_attention(self, meta, positions: torch.Tensor, scale: float) -> tuple[Attn, list[torch.Tensor]]:
        """The step's Attn struct (and the tensors it points into, to keep alive for the step)."""
        width = max(len(t) for t in meta.block_tables)
        rows = []
        for q, table in zip(meta.query_lens, meta.block_tables):
            rows += [list(table) + [0] * (width - len(table))] * q
        tables = torch.tensor(rows, dtype=torch.long)
        slots, pos = meta.slot_mapping.contiguous(), positions.to(torch.long).contiguous()
        return (Attn(slots.data_ptr(), pos.data_ptr(), tables.data_ptr(), width, meta.block_size, scale),
                [slots, pos, tables])

    def layer(self, i: int, last: bool, h: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attn_p: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Layer i's attention (its K/V into the cache first), o_proj and MLP into h, and unless
        ``last`` layer i+1's norm + qkv + rotary into ``qkv``."""
        self.lib.pd_layer(self.ctx_p, self.layer_p[i], None if last else self.layer_p[i + 1], h.shape[0],
                          h.data_ptr(), qkv.data_ptr(), self.o.data_ptr(), cos.data_ptr(), sin.data_ptr(), attn_p,
                          kv[0].data_ptr(), kv[1].data_ptr())

    def _ptr(self, t: torch.Tensor | None) -> int | None:
        if t is None:  # the struct's NULL: no such norm
            return None
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _lin(self, lin: tuple) -> Lin:
        w, s, zs, b = lin[:4]
        if not w.is_contiguous():
            raise ValueError("native kernels read contiguous weights")
        kind = {torch.int32: W_I8, torch.uint8: W_I4}.get(w.dtype, W_F32)
        k = w.shape[-1] * {W_I8: 4, W_I4: 2, W_F32: 1}[kind]
        group = lin[4] if kind == W_I4 else 0
        meta = lin[5] if kind == W_I4 and len(lin) > 5 else None
        check_int4_meta(meta, w.shape[0], k, group)
        aq = self.int8_activations and int8_activations_fit(kind, k, group, self.lib.pd_vector_width())
        self._keep += [w] if meta is None else [w, meta]
        return Lin(w.data_ptr(), self._ptr(s), self._ptr(zs), self._ptr(b), w.shape[0], k, kind, group, int(aq),
                   None if meta is None else meta.data_ptr())

    def set_threads(self, threads: int) -> None:
        self.ctx.threads = max(1, threads)

    def pre(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """norm + qkv + rotary of layer 0 into this step size's q/k/v buffer [R, nq+2nkv, D].
        The buffers (scratch, q/k/v, attention output) are this object's: one step at a time."""
        if not 1 <= h.shape[0] <= self.ctx.max_rows or not h.is_contiguous():
            raise ValueError(f"native kernels take 1..{self.ctx.max_rows} contiguous rows, got {tuple(h.shape)}")
        out = self.qkv[h.shape[0] - 1]
        self.lib.pd_pre(self.ctx_p, self.layer_p[0], h.shape[0], h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                        out.data_ptr())
        return out

    def post_pre(self, i: int, h: torch.Tensor, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Layer i's o_proj and MLP into h (in place), then layer i+1's norm + qkv + rotary."""
        out = self.qkv[h.shape[0] - 1]
        self.lib.pd_post_pre(self.ctx_p, self.layer_p[i], self.layer_p[i + 1], h.shape[0], h.data_ptr(),
                             o.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr())
        return out

    def post(self, i: int, h: torch.Tensor, o: torch.Tensor) -> None:
        self.lib.pd_post(self.ctx_p, self.layer_p[i], h.shape[0], h.data_ptr(), o.data_ptr())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if not 1 <= h.shape[0] <= self.ctx.max_rows:
            raise ValueError(f"native kernels take 1..{self.ctx.max_rows} rows, got {h.shape[0]}")
        h = h.contiguous()
        out = torch.empty(h.shape[0], self.vocab)
        self.lib.pd_logits(self.ctx_p, self.head_p, self.norm, h.shape[0], h.data_ptr(), out.data_ptr())
        return out
