"""Native row-invariant CPU kernels of the runtime (linear.cpp / linear_fma.cpp, attention.cpp, draft.cpp; bound by
module.cpp), compiled with torch.utils.cpp_extension at first use.

Owns: whether they can run here (x86-64 with AVX-512F/BW, a working C++ toolchain, DSPARK_NATIVE not "0"),
building and caching the extension under $DSPARK_CACHE/native (one build per kernel source, torch version and
CPU flags; later processes load it in well under a second), the packed-weight cache (weights are re-laid out once
per tensor version, see linear.cpp), the AMX switch, and typed wrappers `linear`, `rope_kv`, `attend`,
`markov_greedy`. Every failure to
build is logged once and turns the native path off (the runtime then uses the pure-torch path of runtime.ops).
Knows nothing about models.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "module.cpp", HERE / "linear.cpp", HERE / "linear_fma.cpp", HERE / "attention.cpp", HERE / "draft.cpp"]
HEADERS = [HERE / "common.h", HERE / "linear.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-DNDEBUG"]
# packing kinds, as linear.cpp `enum Pack`
P_BF16, P_F32, P_I8P, P_I8F, P_SQ, P_I8Q = 0, 1, 2, 3, 4, 5

_lock = threading.Lock()
_state: dict[str, Any] = {"ext": None, "reason": None}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_dir() -> Path:
    """Where this kernel source, torch version, flag set and CPU build (and cache) the extension."""
    src = "\n".join(p.read_text() for p in SOURCES + HEADERS)
    cpu = " ".join(sorted(f for f in _cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))))
    tag = hashlib.sha256("\n".join([src, torch.__version__, " ".join(FLAGS), cpu]).encode()).hexdigest()[:12]
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark_trt")) / "native" / f"dspark_native_{tag}"


def _build() -> ModuleType:
    if os.environ.get("DSPARK_NATIVE", "1") == "0":
        raise RuntimeError("disabled by DSPARK_NATIVE=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"needs x86-64 with AVX-512 (this is {platform.machine()})")
    flags = _cpu_flags()
    missing = {"avx512f", "avx512bw", "avx512vl"} - flags
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(sorted(missing))}")
    from torch.utils import cpp_extension

    root = build_dir()
    name = root.name
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # One builder at a time, across processes, under an flock the kernel releases when its holder dies. torch's own
    # baton (a `lock` file in the build directory) outlives a process killed mid-build (a server stopped while its
    # stub compiled) and then makes every later load wait forever; under the flock such a file is always stale.
    with open(root.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (root / "lock").unlink(missing_ok=True)
        # Compile copies kept in the cache, so every install of this source (the repo, a wheel in a venv) writes the
        # same build.ninja and reuses one build instead of recompiling whenever another install ran last.
        src_dir = root / "src"
        src_dir.mkdir(exist_ok=True)
        for p in SOURCES + HEADERS:
            if not (src_dir / p.name).exists() or (src_dir / p.name).read_bytes() != p.read_bytes():
                (src_dir / p.name).write_bytes(p.read_bytes())
        ext = cpp_extension.load(name=name, sources=[str(src_dir / p.name) for p in SOURCES], extra_cflags=FLAGS,
                                 extra_include_paths=[str(src_dir)], extra_ldflags=["-fopenmp"],
                                 build_directory=str(root), verbose=False)
    log.info("native kernels %s (%s) ready in %.1f s (%s)", name, ext.build_info(), time.perf_counter() - t0, root)
    _prune(root)
    return ext


def _prune(current: Path, keep_s: float = 86400.0) -> None:
    """Remove builds of older kernel sources (sibling dspark_native_* dirs untouched for a day)."""
    import shutil

    now = time.time()
    for d in current.parent.glob("dspark_native_*"):
        try:
            if d != current and d.is_dir() and now - d.stat().st_mtime > keep_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _ext() -> ModuleType | None:
    if _state["ext"] is None and _state["reason"] is None:
        with _lock:
            if _state["ext"] is None and _state["reason"] is None:
                try:
                    _state["ext"] = _build()
                except Exception as exc:  # noqa: BLE001 - any build failure → torch path
                    _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}"
                    log.warning("native kernels unavailable (%s); the runtime uses its pure-torch path",
                                _state["reason"])
    return _state["ext"]


def ext() -> ModuleType:
    """The built extension (raises RuntimeError when the native kernels are unavailable)."""
    e = _ext()
    if e is None:
        raise RuntimeError(f"native kernels unavailable: {_state['reason']}")
    return e


def available() -> bool:
    """True when the native kernels are built (building them on the first call)."""
    return _ext() is not None


def unavailable_reason() -> str:
    return "" if available() else str(_state["reason"])


def has_vnni() -> bool:
    ext = _ext()
    return ext is not None and "vnni" in ext.build_info()


def set_amx(on: bool) -> None:
    """Allow (default) or forbid AMX tiles for the products (benchmarks and tests of the FMA engine)."""
    ext = _ext()
    if ext is not None:
        ext.set_amx(bool(on))


def amx_active() -> bool:
    ext = _ext()
    return ext is not None and bool(ext.amx_active())


def kind_for(w: torch.Tensor, x_dtype: torch.dtype, sq: bool = False) -> int | None:
    """Packing kind for weight w with activations of x_dtype, or None when the native kernels do not cover it."""
    if sq:
        return P_SQ if w.dtype == torch.int8 and has_vnni() and x_dtype in (torch.bfloat16, torch.float32) else None
    if w.dtype == torch.int8:  # bf16 activations: exact limb products on int8 where VNNI is (no widening)
        return {torch.bfloat16: P_I8Q if has_vnni() else P_I8P, torch.float32: P_I8F}.get(x_dtype)
    if w.dtype != x_dtype:
        return None
    return {torch.bfloat16: P_BF16, torch.float32: P_F32}.get(w.dtype)


def packed(w: torch.Tensor, kind: int, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed copy of w for kind (cached on the tensor; redone when w is modified in place or moved)."""
    try:
        version = w._version
    except RuntimeError:  # an inference tensor: no version counter (and no in-place change outside inference mode)
        version = -1
    key = (kind, swiglu, w.data_ptr(), version, tuple(w.shape), w.dtype)
    cache: dict = w.__dict__.setdefault("_dspark_packed", {})
    hit = cache.get((kind, swiglu))
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    pk, rowsum = _ext().pack_weight(w.detach().contiguous(), kind, swiglu)  # type: ignore[union-attr]
    cache[(kind, swiglu)] = (key, pk, rowsum)
    return pk, rowsum


def linear(x: torch.Tensor, w: torch.Tensor, kind: int | None = None, *, bias: torch.Tensor | None = None,
           bias_f32: bool = False, scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False, out_f32: bool = False,
           sq: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ → [M, N] (or [M, N/2] with swiglu: up = rows [0, N/2), SiLU input = rows [N/2, N)).

    Epilogue order (torch / HF numerics): optional RMSNorm of x (norm = its weight), product in fp32, · scale [N],
    + bias (model dtype after rounding, or fp32 before it with bias_f32), round to the model dtype, SwiGLU, + residual
    [M, Nout]; out_f32 returns the rounded values as float32. sq = (prequant scale [K] fp32, activation scale):
    SmoothQuant int8 activations and exact int32 products.
    """
    ext = _ext()
    k = kind if kind is not None else kind_for(w, x.dtype, sq is not None)
    if ext is None or k is None:
        raise RuntimeError("native.linear called without native support for these dtypes")
    pk, rowsum = packed(w, k, swiglu)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return ext.linear(x, pk, rowsum, k, w.shape[0], swiglu, scale, bias, bias_f32, residual, norm, float(eps),
                      None if sq is None else sq[0], 0.0 if sq is None else float(sq[1]), out_f32)


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, ck: torch.Tensor,
            cv: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [B·T, (H + 2·Hkv)·D], pos [B·T] long, slots [B] long → q [B·T, H·D] with RoPE; writes k (RoPE), v to
    ck/cv [S, Hkv, max_seq, D] at (slot, :, pos)."""
    return _ext().rope_kv(qkv, cos, sin, pos, ck, cv, slots, heads, kv_heads)  # type: ignore[union-attr]


def attend(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
           lengths: torch.Tensor, heads: int, window: int | None, scale: float, bidirectional: bool = False) -> torch.Tensor:
    """q [B·T, H·D]; row b's query t at position starts[b] + t over keys ≤ it (in the window) → [B·T, H·D];
    queries t ≥ lengths[b] get zeros. bidirectional: every query of row b sees keys up to starts[b] + lengths[b] − 1."""
    return _ext().attend(q, ck, cv, slots, starts, lengths, heads, int(window or 0), float(scale),  # type: ignore[union-attr]
                         bool(bidirectional))


def markov_greedy(u: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy DSpark Markov block (draft.cpp): u [B, γ, Vd] f32, anchor [B] long target ids, W1 [Vt, r], W2 [Vd, r]
    in one param dtype, d2t [Vd] long | None → (draft-vocab ids [B, γ], target ids [B, γ]); None when the native
    kernels do not cover these dtypes."""
    k = kind_for(w2, w2.dtype) if w1.dtype == w2.dtype else None
    if _ext() is None or k is None:
        return None
    pk, rowsum = packed(w2, k)
    out = _ext().markov_greedy(u.float().contiguous(), anchor.long().contiguous(), w1.contiguous(), pk, rowsum,  # type: ignore[union-attr]
                               k, w2.shape[0], None if d2t is None else d2t.long().contiguous())
    return out[0], out[1]
