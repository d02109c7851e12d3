"""Row-invariant compute primitives of the runtime: every row's result is bit-identical whatever other rows share
the call, so a request's logits do not depend on the batch it is in, on the K it verifies, or on whether its
prompt was prefilled alone (docs/runtime.md, "Batch invariance").

Owns: the kernel-path switch (`kernel_path`, `use_native`), the pure-torch ("torch") implementations — fixed
16-row tiles for products, per-query attention spans, per-request long-prompt attention — and the dispatch to
the C++ kernels of `runtime.native` ("native") when they are built. Knows nothing about models or caches beyond
the tensors it is handed.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from dspark_trt.errors import InvalidArgumentError

TILE_ROWS = 16  # torch path: every product runs on [in, TILE_ROWS] activation tiles (rows zero-padded)
SPAN_ALIGN = 64  # torch path: a query at position p attends over keys [0, ceil((p+1)/64)·64), tail masked
ROW_EXACT_MAX_T = 32  # torch path: prompts longer than this use one SDPA per request instead of per query
PATHS = ("native", "torch")

_forced: str | None = None


@contextlib.contextmanager
def kernel_path(name: str) -> Iterator[str]:
    """Force the runtime onto one kernel path ("native" | "torch") inside the block (tests, benchmarks)."""
    global _forced
    if name not in PATHS:
        raise InvalidArgumentError(f"kernel path must be one of {PATHS}, got {name!r}")
    if name == "native":
        from dspark_trt.runtime import native

        if not native.available():
            raise InvalidArgumentError(f"native kernels are not available here: {native.unavailable_reason()}")
    old, _forced = _forced, name
    try:
        yield name
    finally:
        _forced = old


def use_native(t: torch.Tensor) -> bool:
    """True when `t` (a CPU tensor) goes through the native kernels: built, not disabled, not forced off."""
    if t.device.type != "cpu":
        return False
    if _forced is not None:
        return _forced == "native"
    if os.environ.get("DSPARK_NATIVE", "1") == "0":
        return False
    from dspark_trt.runtime import native

    return native.available()


def product(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M, in] · wᵀ → [M, out] (no bias), row-invariant: the native kernel when it covers the dtypes, else
    `tile_linear`."""
    if use_native(x2):
        from dspark_trt.runtime import native

        kind = native.kind_for(w, x2.dtype)
        if kind is not None:
            return native.linear(x2, w, kind)
    return tile_linear(x2, w)


# ---------------------------------------------------------------------------------------------------- torch path
def tile_linear(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M, in] · wᵀ → [M, out] (no bias), each row computed by a fixed-shape product.

    Off the CPU this is F.linear. On the CPU every product is torch.mm(w, tileᵀ) over a [TILE_ROWS, in] tile
    (rows zero-padded): the same kernel and blocking for every row whatever M is, and (checked in
    tests/runtime/test_batch_invariance.py) a row's result does not depend on its place in the tile. One bf16/fp16
    row uses torch.mv, which rounds exactly like the tile product; fp32 rows always use the tile (MKL's sgemv and
    sgemm round differently).
    """
    M = x2.shape[0]
    if x2.device.type != "cpu":
        return F.linear(x2, w)
    if M == 1 and w.dtype != torch.float32:
        return torch.mv(w, x2[0]).unsqueeze(0)  # [1, out]
    out = x2.new_empty(M, w.shape[0])  # [M, out]
    for i in range(0, M, TILE_ROWS):
        tile = x2[i:i + TILE_ROWS]
        n = tile.shape[0]
        if n < TILE_ROWS:
            tile = F.pad(tile, (0, 0, 0, TILE_ROWS - n))  # [TILE_ROWS, in]
        out[i:i + n] = torch.mm(w, tile.t()).t()[:n]
    return out


def _span(p: int, max_seq: int) -> int:
    return min(-(-(p + 1) // SPAN_ALIGN) * SPAN_ALIGN, max_seq)


def attend_torch(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, slots: Sequence[int], starts: Sequence[int],
                 lengths: Sequence[int], window: int | None, scale: float) -> torch.Tensor:
    """q [B, T, H, D] (row b's query t sits at position starts[b] + t), ck/cv [S, Hkv, max_seq, D] one layer's cache
    (already holding this step's keys) → attention output [B, T, H·D]; queries t ≥ lengths[b] get zeros.

    A query's result depends only on its own position and keys: rows of ≤ ROW_EXACT_MAX_T real tokens run one SDPA
    batch entry per query over that query's own aligned span (entries with equal spans share one call), longer
    rows one SDPA per request over the request's own span. So a token gets the same bits decoded alone, verified in
    a K+1 block, or batched with other requests.
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
        rows = [b for b, _ in members]
        pos = torch.tensor([starts[b] + t for b, t in members])  # [n]
        keys = torch.arange(span)
        m = keys[None, :] <= pos[:, None]  # [n, span]
        if window is not None:
            m &= keys[None, :] > pos[:, None] - window
        n = len(members)
        if all(r == rows[0] for r in rows):  # one request: its keys as an expanded view
            s = slots[rows[0]]
            kk = ck[s, :, :span].expand(n, Hkv, span, D)
            vv = cv[s, :, :span].expand(n, Hkv, span, D)
        else:
            idx = torch.tensor([slots[r] for r in rows])
            kk = ck[:, :, :span].index_select(0, idx)  # [n, Hkv, span, D]
            vv = cv[:, :, :span].index_select(0, idx)
        bi = torch.tensor(rows)
        ti = torch.tensor([t for _, t in members])
        qq = q[bi, ti].unsqueeze(2)  # [n, H, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m[:, None, None, :], scale=scale,
                                           enable_gqa=gqa)  # [n, H, 1, D]
        out[bi, ti] = o.reshape(n, H * D)
    return out
