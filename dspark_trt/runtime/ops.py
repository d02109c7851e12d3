"""Row-invariant compute primitives of the runtime: every row's result is bit-identical whatever other rows share
the call, so a request's logits do not depend on the batch it is in, on the K it verifies, or on whether its
prompt was prefilled alone (docs/runtime.md, "Batch invariance").

Owns: the kernel choice — `choose_kernel`, the one function every caller asks "native (which engine) or torch?"
(the engine itself, amx > avx512 > avx2 > torch by CPUID or DSPARK_NATIVE_ENGINE, is runtime.native's), and
`kernel_path`, which forces one path inside a block — and the pure-torch ("torch") implementations: products row
by row (one [1, in] product per row, the same call whatever the batch; a long prompt's rows in one product of its
own), per-query attention spans, per-request long-prompt attention, the torch path's product dtype (chosen by
measurement), and whether bf16 matrix products are fast on this CPU (`bf16_matmul_fast`, measured). Knows nothing
about models or caches beyond the tensors it is handed.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.runtime import native

log = logging.getLogger(__name__)

SPAN_ALIGN = 64  # torch path: a query at position p attends over keys [0, ceil((p+1)/64)·64), tail masked
ROW_EXACT_MAX_T = 32  # torch path: prompts longer than this use one SDPA / one product per request, not per row
PATHS = ("native", "torch")

_forced: str | None = None
# (T, lengths) of the ragged batch whose rows the products see: set by the model's torch forward
_rows: contextvars.ContextVar[tuple[int, Sequence[int]] | None] = contextvars.ContextVar("dspark_rows", default=None)
_f32_products: dict[str, bool] = {}


@contextlib.contextmanager
def kernel_path(name: str) -> Iterator[str]:
    """Force the runtime onto one kernel path ("native" | "torch") inside the block (tests, benchmarks)."""
    global _forced
    if name not in PATHS:
        raise InvalidArgumentError(f"kernel path must be one of {PATHS}, got {name!r}")
    if name == "native":
        if not native.available():
            raise InvalidArgumentError(f"native kernels are not available here: {native.unavailable_reason()}")
    old, _forced = _forced, name
    try:
        yield name
    finally:
        _forced = old


@dataclass(frozen=True)
class Kernel:
    """`choose_kernel`'s answer: the engine a computation runs on and, for a product, its packing kind there."""

    engine: str  # "amx" | "avx512" | "avx2" (runtime.native), or "torch" (this module's path; off the CPU torch's own)
    kind: native.Pack | None = None  # the product's packing kind on that engine (None: torch, or no weight asked about)

    @property
    def native(self) -> bool:
        return self.engine != "torch"


TORCH = Kernel("torch")
_NATIVE_DTYPES = (torch.bfloat16, torch.float32)  # the native kernels' activation (and cache) dtypes


def choose_kernel(x: torch.Tensor | torch.dtype, *tensors: torch.Tensor,
                  weight: torch.Tensor | torch.dtype | None = None, sq: bool = False, autograd: bool = False) -> Kernel:
    """The one answer to "native (which engine) or torch?" for a computation over activations x (or their dtype, for
    a plan bound ahead of its calls) and `tensors` (caches, weights), and, with `weight` (a tensor, or its dtype when
    the weight is made only for the native path), the packing kind of the product x · weightᵀ (sq: SmoothQuant).

    Torch when a tensor is off the CPU, when `autograd` is asked for while autograd records (the native kernels have
    no backward), inside `kernel_path("torch")`, when runtime.native's engine is torch (no engine runs here,
    DSPARK_NATIVE=0, DSPARK_NATIVE_ENGINE=torch), for activations other than bf16 / fp32, or when the engine has no
    packing kind for the weight with these activations (`native.kind_for`); else the engine in use (this thread's
    `native.use_engine` one inside such a block).
    """
    on = [x, *tensors] if isinstance(x, torch.Tensor) else list(tensors)
    if isinstance(weight, torch.Tensor):
        on.append(weight)
    if any(t.device.type != "cpu" for t in on) or (autograd and torch.is_grad_enabled()) or _forced == "torch":
        return TORCH
    x_dtype = x if isinstance(x, torch.dtype) else x.dtype
    engine = native.engine()
    if engine == "torch" or x_dtype not in _NATIVE_DTYPES:
        return TORCH
    if weight is None:
        return Kernel(engine)
    kind = native.kind_for(weight if isinstance(weight, torch.dtype) else weight.dtype, x_dtype, sq)
    return TORCH if kind is None else Kernel(engine, kind)


def product(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M, in] · wᵀ → [M, out] (no bias), row-invariant: the native kernel where `choose_kernel` says so, else
    `tile_linear`."""
    kern = choose_kernel(x2, weight=w)
    return native.linear(x2, w, kern.kind) if kern.native else tile_linear(x2, w)


# ---------------------------------------------------------------------------------------------------- torch path
@contextlib.contextmanager
def ragged_rows(T: int, lengths: Sequence[int]) -> Iterator[None]:
    """Tell the torch path's products inside the block that their [B·T, in] rows are B requests of T columns with
    lengths[b] real tokens each (the rest padding): a long prompt's rows then run as one product of its own."""
    token = _rows.set((T, list(lengths)))
    try:
        yield
    finally:
        _rows.reset(token)


def _fastest_bf16_fp32(op, fp32_args: tuple[torch.Tensor, ...], rounds: int, calls: int = 1,
                       give_up: float = float("inf")) -> dict[str, float]:  # noqa: ANN001 - a product
    """Fastest seconds of `calls` × op on fp32_args and on their bf16 copies, interleaved `rounds` times (a drift in
    the machine's speed hits both alike); stops early once bf16 is give_up × slower than fp32."""
    cases = (("bf16", tuple(t.bfloat16() for t in fp32_args)), ("fp32", fp32_args))
    best = {"bf16": float("inf"), "fp32": float("inf")}
    for _ in range(rounds):
        for name, args in cases:
            t0 = time.perf_counter()
            for _ in range(calls):
                op(*args)
            best[name] = min(best[name], time.perf_counter() - t0)
        if best["bf16"] > give_up * best["fp32"]:
            break
    return best


def _bf16_via_f32() -> bool:
    """Whether bf16 products are faster on fp32 kernels (upcast weights, output rounded to bf16) than on torch's
    bf16 kernels on this CPU: measured once per process (CPUs without native bf16 run bf16 GEMV several times slower)."""
    if "bf16" not in _f32_products:
        g = torch.Generator().manual_seed(0)
        best = _fastest_bf16_fp32(torch.mv, (torch.randn(1536, 576, generator=g), torch.randn(576, generator=g)),
                                  rounds=12, calls=4)
        _f32_products["bf16"] = best["fp32"] < best["bf16"]
        log.info("torch path: bf16 products on %s kernels (one [1536, 576] GEMV x4: bf16 %.2f ms, fp32 %.2f ms)",
                 "fp32" if _f32_products["bf16"] else "bf16", best["bf16"] * 1e3, best["fp32"] * 1e3)
    return _f32_products["bf16"]


def bf16_matmul_fast(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 matrix products (training's autocast, a bf16 Hugging Face model) are at least as fast as fp32 ones
    here: True on CUDA; on the CPU measured once per process on a [256, 576] × [576, 1536] product (CPUs without
    AVX512_BF16 / AMX run torch's bf16 GEMM on a scalar fallback: 1.2 vs 160 GFLOP/s on a Zen 3 core pair)."""
    if torch.device(device).type != "cpu":
        return True
    if "gemm" not in _f32_products:
        g = torch.Generator().manual_seed(0)
        ab = (torch.randn(256, 576, generator=g), torch.randn(576, 1536, generator=g))
        best = _fastest_bf16_fp32(torch.matmul, ab, rounds=3, give_up=50.0)  # one slow bf16 product decides
        _f32_products["gemm"] = best["fp32"] < best["bf16"]
        log.info("bf16 matrix products %s here ([256, 576] x [576, 1536]: bf16 %.2f ms, fp32 %.2f ms)",
                 "slower than fp32" if _f32_products["gemm"] else "fast", best["bf16"] * 1e3, best["fp32"] * 1e3)
    return not _f32_products["gemm"]


def _compute_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight the torch path multiplies with: w, or its fp32 copy (cached per tensor version) for bf16."""
    if w.dtype != torch.bfloat16 or not _bf16_via_f32():
        return w
    try:
        version = w._version
    except RuntimeError:  # an inference tensor
        version = -1
    key = (w.data_ptr(), version, tuple(w.shape))
    hit = w.__dict__.get("_dspark_f32")
    if hit is None or hit[0] != key:
        hit = (key, w.detach().float())
        w.__dict__["_dspark_f32"] = hit
    return hit[1]


def tile_linear(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M, in] · wᵀ → [M, out] (no bias), every row's bits independent of the other rows by construction.

    Off the CPU this is F.linear. On the CPU each row is its own torch.mv on an aligned copy of the row — the same
    call on the same shape whatever M, the batch or the row's place in it — so decode, verify blocks and batched
    rows agree on every CPU, whatever torch's GEMM kernels do with row blocking. Inside `ragged_rows`, a request with
    more than ROW_EXACT_MAX_T real tokens (a prompt) runs as one product over its own rows only (the same call alone
    or batched) and padding rows are zeros. bf16 runs on fp32 kernels where the CPU makes them faster
    (`_bf16_via_f32`), the result rounded to bf16 either way.
    """
    M = x2.shape[0]
    if x2.device.type != "cpu":
        return F.linear(x2, w)
    wc = _compute_weight(w)
    out = x2.new_zeros(M, w.shape[0])  # [M, out]
    rows = _rows.get()
    groups: list[tuple[int, int]] = [(i, 1) for i in range(M)]  # (first row, rows) per product
    if rows is not None and rows[0] * len(rows[1]) == M:
        T, lengths = rows
        groups = []
        for b, n in enumerate(lengths):
            n = max(0, min(T, int(n)))
            groups += [(b * T, n)] if n > ROW_EXACT_MAX_T else [(b * T + t, 1) for t in range(n)]
    for r0, n in groups:
        xs = x2[r0:r0 + n].to(wc.dtype, copy=True)  # [n, in], a fresh aligned buffer
        y = torch.mv(wc, xs[0]).unsqueeze(0) if n == 1 else torch.mm(xs, wc.t())  # [n, out]
        out[r0:r0 + n] = y
    return out


def _span(p: int, max_seq: int) -> int:
    return min(-(-(p + 1) // SPAN_ALIGN) * SPAN_ALIGN, max_seq)


def attend_torch(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, slots: Sequence[int], starts: Sequence[int],
                 lengths: Sequence[int], window: int | None, scale: float) -> torch.Tensor:
    """q [B, T, H, D] (row b's query t sits at position starts[b] + t), ck/cv [S, Hkv, max_seq, D] one layer's cache
    (already holding this step's keys) → attention output [B, T, H·D]; queries t ≥ lengths[b] get zeros.

    A query's result depends only on its own position and keys: rows of ≤ ROW_EXACT_MAX_T real tokens run one SDPA
    call per query over that query's own aligned span, longer rows one SDPA per request over the request's own
    span. So a token gets the same bits decoded alone, verified in a K+1 block, or batched with other requests —
    by construction (the same call on the same shapes), not by SDPA's batch entries happening to agree.
    """
    B, T, H, D = q.shape
    Hkv, max_seq = ck.shape[1], ck.shape[2]
    gqa = H != Hkv
    out = q.new_zeros(B, T, H * D)  # [B, T, H·D]
    groups: dict[int, list[tuple[int, int]]] = {}  # span → [(row, t)]
    for b in range(B):
        n = lengths[b]
        if n > ROW_EXACT_MAX_T:
            s0, slot = starts[b], slots[b]
            span = _span(s0 + n - 1, max_seq)
            keys = torch.arange(span)
            pos = s0 + torch.arange(n)
            m = keys[None, :] <= pos[:, None]  # [n, span]
            if window is not None:
                m &= keys[None, :] > pos[:, None] - window
            o = F.scaled_dot_product_attention(q[b:b + 1, :n].transpose(1, 2), ck[slot:slot + 1, :, :span],
                                               cv[slot:slot + 1, :, :span], attn_mask=m[None, None], scale=scale,
                                               enable_gqa=gqa)  # [1, H, n, D]
            out[b, :n] = o[0].transpose(0, 1).reshape(n, H * D)
            continue
        for t in range(n):
            groups.setdefault(_span(starts[b] + t, max_seq), []).append((b, t))
    for span, members in groups.items():
        keys = torch.arange(span)
        for b, t in members:  # one SDPA call per query: the same call alone or batched (fp32 SDPA batch entries
            p = starts[b] + t  # are not bit-identical to single calls on every CPU)
            m = keys <= p  # [span]
            if window is not None:
                m &= keys > p - window
            s = slots[b]
            o = F.scaled_dot_product_attention(q[b, t].reshape(1, H, 1, D), ck[s:s + 1, :, :span], cv[s:s + 1, :, :span],
                                               attn_mask=m.reshape(1, 1, 1, span), scale=scale,
                                               enable_gqa=gqa)  # [1, H, 1, D]
            out[b, t] = o.reshape(H * D)
    return out
