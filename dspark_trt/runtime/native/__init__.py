"""Native row-invariant CPU kernels of the runtime, in one build per engine, compiled with
torch.utils.cpp_extension at first use.

Engines, best first: `amx` (AMX tiles, the AVX-512 build), `avx512` (the same build with AMX off: AVX-512 FMA,
VNNI), `avx2` (AVX2 + FMA, x86-64-v3: every x86-64 CPU of the last decade; int8 products on vpmaddwd), then the
pure-torch path of runtime.ops (`torch`). Every engine computes the same bits (exact integer products, the same
fp32 accumulation order lane for lane), so decode == verify and batched == alone hold on each and across them.

Owns: choosing the engine by CPUID when the kernels first load (`DSPARK_NATIVE_ENGINE` = amx | avx512 | avx2 |
torch forces one, `DSPARK_NATIVE=0` means torch), logging the choice once, building and caching each engine's
extension under $DSPARK_CACHE/native (one build per kernel source, torch version, flags and CPU), the packed-weight
cache (weights re-laid out once per tensor version, see linear.h), the packing kinds (`Pack`: their one definition,
handed to every C++ build as -DDSPARK_P_* flags), each engine's product coverage (`kind_for`), the AMX switch, and
typed wrappers `linear`, `rope_kv`, `attend`, `markov_greedy`. Every failure to build is logged once and moves to the
next engine. Whether a computation runs here or on the torch path is `runtime.ops.choose_kernel`'s answer. Knows
nothing about models.
"""
from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
ENGINES = ("amx", "avx512", "avx2")  # best first; "torch" when none runs


class Pack(enum.IntEnum):
    """Packing kinds of a product's weight (layouts: linear.h); plan.h's `enum Pack` takes these values."""

    BF16 = 0  # bf16 weight, bf16 activations
    F32 = 1  # fp32 weight, fp32 activations
    I8P = 2  # W8A16 with bf16 activations, widened exactly to bf16 (no exact int8 products: no VNNI)
    I8F = 3  # W8A16 with fp32 activations
    SQ = 4  # SmoothQuant: int8 x int8
    I8Q = 5  # W8A16 with bf16 activations as exact integer limb products


PACK_FLAGS = [f"-DDSPARK_P_{k.name}={k.value}" for k in Pack]
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-DNDEBUG", *PACK_FLAGS]


@dataclass(frozen=True)
class Build:
    """One compiled extension: its sources, headers, compiler flags and the CPU flags it needs."""

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    flags: tuple[str, ...]
    needs: frozenset[str]


BUILDS = {
    "avx512": Build("avx512", ("module.cpp", "pack.cpp", "linear.cpp", "linear_amx.cpp", "linear_fma.cpp",
                               "attention.cpp", "draft.cpp", "markov.cpp", "greedy.cpp"),
                    ("common.h", "plan.h", "simd512.h", "linear.h", "rope.h", "attend.h"), ("-march=native",),
                    frozenset({"avx512f", "avx512bw", "avx512vl"})),
    # x86-64-v3 exactly (no AVX-512 even where the CPU has it); hidden symbols: both builds can share a process
    "avx2": Build("avx2", ("module.cpp", "pack.cpp", "avx2/linear.cpp", "avx2/attention.cpp", "avx2/draft.cpp",
                   "markov.cpp", "greedy.cpp"),
                  ("common.h", "plan.h", "simd256.h", "rope.h", "attend.h"), ("-march=x86-64-v3", "-mtune=native", "-fvisibility=hidden"),
                  frozenset({"avx2", "fma", "f16c", "bmi2"})),
}
ENGINE_BUILD = {"amx": "avx512", "avx512": "avx512", "avx2": "avx2"}
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})

_lock = threading.RLock()
_state: dict[str, Any] = {"ext": None, "engine": None, "reason": None}
_builds: dict[str, ModuleType | str] = {}  # build name → extension, or why it is unavailable
_override = threading.local()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_family() -> str:
    """The CPU family by vector ISA, as benchmarks are filed (never compared across families): avx512-amx
    (Sapphire Rapids class), avx512 (Zen 4 class), avx2 (Zen 3 / Haswell class), other."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512-amx" if AMX_FLAGS <= flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "other"


def report_suffix() -> str:
    """`<family>`, or `<family>-engine-<engine>` when the engine in use is not the family's best: benchmark file
    names (docs/benchmarks-<suffix>.md, docs/benchmarks-runtime-<suffix>.md)."""
    best = {"avx512-amx": "amx", "avx512": "avx512", "avx2": "avx2"}.get(cpu_family(), "torch")
    fam, eng = cpu_family(), engine()
    return fam if eng == best else f"{fam}-engine-{eng}"


def cpu_summary() -> dict[str, Any]:
    """The CPU model, the vector flags that choose an engine, and the engine in use (bench headers, --json)."""
    flags = cpu_flags()
    keep = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"cpu": cpu_model(), "family": cpu_family(), "flags": keep, "engine": engine(),
            "engine_reason": unavailable_reason() or None}


def _cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark_trt")) / "native"


@functools.lru_cache(maxsize=1)
def _ninja_dir() -> str | None:
    """The directory of the `ninja` package's binary (a dependency of this project): ninja.BIN_DIR where it holds
    one, else where the package's distribution installed its executable (a venv that borrows another's site-packages
    through a .pth has no ninja in its own bin, so BIN_DIR comes back empty); None: not installed (PATH decides)."""
    try:
        import ninja

        if ninja.BIN_DIR and os.path.isfile(os.path.join(ninja.BIN_DIR, "ninja")):
            return str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    from importlib import metadata

    try:
        files = metadata.files("ninja") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:  # e.g. ../../../bin/ninja, relative to site-packages
        if f.name == "ninja" and "bin" in f.parts:
            exe = Path(str(f.locate())).resolve()
            if exe.is_file() and os.access(exe, os.X_OK):
                return str(exe.parent)
    return None


@functools.lru_cache(maxsize=1)
def _ninja_version() -> str:
    """`ninja --version` of the binary builds run with (`_one_ninja`); "" when none runs."""
    bindir = _ninja_dir()
    exe = os.path.join(bindir, "ninja") if bindir else "ninja"
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=1)
def _toolchain() -> tuple[str, ...]:
    """What else torch.utils.cpp_extension writes into a build's build.ninja (torch's and Python's include
    directories, the interpreter's version) and the ninja that builds it (two ninja versions hash a command apart in
    `.ninja_log`, so each takes the other's outputs for stale)."""
    import sysconfig

    from torch.utils import cpp_extension

    return (*cpp_extension.include_paths(), sysconfig.get_paths()["include"], sys.version, _ninja_version())


def build_dir(build: str | None = None) -> Path:
    """Where this engine build's source, torch version, flags and CPU build (and cache) the extension."""
    b = BUILDS[build or ENGINE_BUILD.get(engine(), "avx2")]
    src = "\n".join((HERE / f).read_text() for f in b.sources + b.headers)
    cpu = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))))
    # The include paths and interpreter end up in build.ninja: processes that differ in them (a Triton stub's
    # interpreter vs the CLI's, two venvs) get their own directory instead of rebuilding one in turn.
    key = "\n".join([src, torch.__version__, " ".join(COMMON_FLAGS + list(b.flags)), cpu, *_toolchain()])
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    return _cache_root() / f"dspark_native_{b.name}_{tag}"


@contextlib.contextmanager
def _one_ninja() -> Iterator[None]:
    """Build with the `ninja` package's binary (a dependency of this project, `_ninja_dir`) whatever PATH says. Two
    ninja versions hash a command differently in `.ninja_log`, so each takes the other's outputs for stale: a CLI with
    the system's ninja 1.11 first on PATH and a Triton stub with the venv's 1.13 first rebuilt one cache directory in
    turn, 1–2 minutes every time (measured on a 2-core Zen 3); so did a venv borrowing this one's packages (its
    ninja.BIN_DIR empty: the system's ninja ran). The version is part of the build's key too (`_toolchain`)."""
    bindir = _ninja_dir()
    if bindir is None:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([bindir] + [p for p in old.split(os.pathsep) if p and p != bindir])
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _compile(b: Build) -> ModuleType:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"needs x86-64 (this is {platform.machine()})")
    missing = b.needs - cpu_flags()
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(sorted(missing))}")
    from torch.utils import cpp_extension

    root = build_dir(b.name)
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
        for f in b.sources + b.headers:
            dst = src_dir / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists() or dst.read_bytes() != (HERE / f).read_bytes():
                dst.write_bytes((HERE / f).read_bytes())
        with _one_ninja():
            ext = cpp_extension.load(name=name, sources=[str(src_dir / f) for f in b.sources],
                                     extra_cflags=COMMON_FLAGS + list(b.flags), extra_include_paths=[str(src_dir)],
                                     extra_ldflags=["-fopenmp"], build_directory=str(root), verbose=False)
    log.info("native build %s (%s) ready in %.1f s (%s)", name, ext.build_info(), time.perf_counter() - t0, root)
    _prune(root, b.name)
    return ext


def load_build(build: str) -> ModuleType | None:
    """The extension of one build ("avx512" | "avx2"), compiled on first use; None (reason logged) when it cannot
    run or build here. Independent of the engine in use: tests compare engines with it."""
    with _lock:
        if build not in _builds:
            try:
                _builds[build] = _compile(BUILDS[build])
            except Exception as exc:  # noqa: BLE001 - any build failure → the next engine
                msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
                _builds[build] = f"{type(exc).__name__}: {msg}"
                log.info("native build %s unavailable (%s)", build, _builds[build])
        got = _builds[build]
    return got if isinstance(got, ModuleType) else None


def build_reason(build: str) -> str:
    """Why load_build(build) is None ('' when it loaded)."""
    load_build(build)
    got = _builds.get(build)
    return got if isinstance(got, str) else ""


def engine_runs(name: str) -> str:
    """'' when engine `name` can run here, else why not."""
    if name == "torch":
        return ""
    if name not in ENGINE_BUILD:
        return f"unknown engine {name!r} (one of {', '.join(ENGINES)}, torch)"
    if name == "amx":
        missing = AMX_FLAGS - cpu_flags()
        if missing:
            return f"the CPU lacks {', '.join(sorted(missing))}"
    ext = load_build(ENGINE_BUILD[name])
    if ext is None:
        return build_reason(ENGINE_BUILD[name])
    if name == "amx" and "+amx" not in ext.build_info():
        return "the build has no AMX (compiler or kernel without AMX support)"
    return ""


def runnable_engines() -> list[str]:
    """The native engines that run on this machine, best first (tests compare them; builds compile on first use)."""
    return [e for e in ENGINES if not engine_runs(e)]


def _choose() -> tuple[str, str]:
    """(engine, why the better ones are not used): DSPARK_NATIVE_ENGINE, else the best engine that runs."""
    if os.environ.get("DSPARK_NATIVE", "1") == "0":
        return "torch", "disabled by DSPARK_NATIVE=0"
    forced = os.environ.get("DSPARK_NATIVE_ENGINE", "").strip().lower()
    if forced and forced != "auto":
        why = engine_runs(forced)
        return ("torch", f"DSPARK_NATIVE_ENGINE={forced}: {why}") if why else (forced, "")
    skipped = []
    for name in ENGINES:
        why = engine_runs(name)
        if not why:
            return name, "; ".join(skipped)
        skipped.append(f"{name}: {why}")
    return "torch", "; ".join(skipped)


def _ext() -> ModuleType | None:
    forced = getattr(_override, "ext", None)
    if forced is not None:
        return forced
    if _state["engine"] is None:
        name, why = _choose()
        with _lock:
            if _state["engine"] is None:
                _state["engine"] = name
                _state["reason"] = why if name == "torch" else None
                _state["ext"] = None if name == "torch" else load_build(ENGINE_BUILD[name])
                if name == "torch":
                    log.warning("native kernels unavailable (%s); the runtime uses its pure-torch path", why)
                else:
                    _state["ext"].set_amx(name == "amx")
                    log.info("native engine %s (%s)%s", name, _state["ext"].build_info(),
                             f"; not used: {why}" if why else "")
    return _state["ext"]


def engine() -> str:
    """The engine the runtime's CPU kernels run on: amx | avx512 | avx2 | torch (chosen on the first call)."""
    forced = getattr(_override, "name", None)
    if forced is not None:
        return forced
    _ext()
    return str(_state["engine"])


@contextlib.contextmanager
def use_engine(name: str) -> Iterator[str]:
    """Run the native wrappers on engine `name` in this thread inside the block (tests and benchmarks comparing
    engines in one process). Raises RuntimeError when it cannot run here."""
    why = engine_runs(name)
    if why or name == "torch":
        raise RuntimeError(f"engine {name} cannot be selected here: {why or 'torch is not a native engine'}")
    ext = load_build(ENGINE_BUILD[name])
    assert ext is not None
    old = (getattr(_override, "ext", None), getattr(_override, "name", None))
    _override.ext, _override.name = ext, name
    prev_amx = bool(ext.amx_active())
    ext.set_amx(name == "amx")
    try:
        yield name
    finally:
        ext.set_amx(prev_amx)
        _override.ext, _override.name = old


def _prune(current: Path, build: str, keep_s: float = 86400.0) -> None:
    """Remove builds of older kernel sources of this build (sibling dirs untouched for a day), and pre-engine ones."""
    import re
    import shutil

    now = time.time()
    for d in current.parent.glob("dspark_native_*"):
        mine = d.name.startswith(f"dspark_native_{build}_") or re.fullmatch(r"dspark_native_[0-9a-f]{12}", d.name)
        try:
            if mine and d != current and d.is_dir() and now - d.stat().st_mtime > keep_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


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
    """True when the engine has exact int8 x int8 products (AVX-512 VNNI, or AVX2's vpmaddwd)."""
    ext = _ext()
    return ext is not None and ("vnni" in ext.build_info() or ext.build_info().startswith("avx2"))


def set_amx(on: bool) -> None:
    """Allow or forbid AMX tiles for the products of the AVX-512 build (tests of its FMA engine)."""
    ext = _ext()
    if ext is not None:
        ext.set_amx(bool(on))


def amx_active() -> bool:
    ext = _ext()
    return ext is not None and bool(ext.amx_active())


def kind_for(w_dtype: torch.dtype, x_dtype: torch.dtype, sq: bool = False) -> Pack | None:
    """The engine's packing kind for a w_dtype weight with x_dtype activations (sq: SmoothQuant int8 activations),
    or None when its products do not cover them."""
    if sq:
        return Pack.SQ if w_dtype == torch.int8 and has_vnni() and x_dtype in (torch.bfloat16, torch.float32) else None
    if w_dtype == torch.int8:  # bf16 activations: exact limb products on int8 where VNNI is (no widening)
        return {torch.bfloat16: Pack.I8Q if has_vnni() else Pack.I8P, torch.float32: Pack.I8F}.get(x_dtype)
    if w_dtype != x_dtype:
        return None
    return {torch.bfloat16: Pack.BF16, torch.float32: Pack.F32}.get(w_dtype)


def packed(w: torch.Tensor, kind: Pack, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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


def linear(x: torch.Tensor, w: torch.Tensor, kind: Pack | None = None, *, bias: torch.Tensor | None = None,
           bias_f32: bool = False, scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False, out_f32: bool = False,
           sq: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [M, K] · w [N, K]ᵀ → [M, N] (or [M, N/2] with swiglu: up = rows [0, N/2), SiLU input = rows [N/2, N)).

    Epilogue order (torch / HF numerics): optional RMSNorm of x (norm = its weight), product in fp32, · scale [N],
    + bias (model dtype after rounding, or fp32 before it with bias_f32), round to the model dtype, SwiGLU, + residual
    [M, Nout]; out_f32 returns the rounded values as float32. sq = (prequant scale [K] fp32, activation scale):
    SmoothQuant int8 activations and exact int32 products. kind: the product's packing kind (default `kind_for`'s).
    """
    ext = _ext()
    k = kind if kind is not None else kind_for(w.dtype, x.dtype, sq is not None)
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
           lengths: torch.Tensor, heads: int, window: int | None, scale: float, bidirectional: bool = False,
           offsets: torch.Tensor | None = None) -> torch.Tensor:
    """q [B·T, H·D]; row b's query t at position starts[b] + t over keys ≤ it (in the window) → [B·T, H·D];
    queries t ≥ lengths[b] get zeros. bidirectional: every query of row b sees keys up to starts[b] + lengths[b] − 1.
    offsets [B] long: q and the output are packed instead (row b's queries at rows offsets[b] .., Σ lengths rows)."""
    return _ext().attend(q, ck, cv, slots, starts, lengths, heads, int(window or 0), float(scale),  # type: ignore[union-attr]
                         bool(bidirectional), offsets)


def markov_greedy(u: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  d2t: torch.Tensor | None, kind: Pack | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy DSpark Markov block (draft.cpp): u [B, γ, Vd] f32, anchor [B] long target ids, W1 [Vt, r], W2 [Vd, r]
    in one float dtype (the bias W2·W1[x] is unscaled), d2t [Vd] long | None → (draft-vocab ids [B, γ], target ids
    [B, γ]). kind: the W2 product's packing kind (default `kind_for`'s)."""
    k = kind if kind is not None else kind_for(w2.dtype, w1.dtype)
    if _ext() is None or k is None or w1.dtype != w2.dtype:
        raise RuntimeError("native.markov_greedy called without native support for these dtypes")
    pk, rowsum = packed(w2, k)
    out = _ext().markov_greedy(u.float().contiguous(), anchor.long().contiguous(), w1.contiguous(), pk, rowsum,  # type: ignore[union-attr]
                               k, w2.shape[0], None if d2t is None else d2t.long().contiguous())
    return out[0], out[1]


def greedy_stats(logits: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Greedy verify statistics (greedy.cpp): logits [B, K+1, V] float32 on the CPU, k [B] → (argmax [B, K+1] long,
    top1 [B, K+1], margin [B, K+1] float32), rows past k zero; None where no engine runs or a verified row holds a
    NaN or only −inf (the caller keeps torch's rules for those)."""
    ext = _ext()
    if ext is None or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    arg, top1, margin, ok = ext.greedy_stats(logits.contiguous(), k.long().contiguous())
    return (arg, top1, margin) if bool(ok.all()) else None
