"""The native W8A16 product (int8 weights, bf16 activations as 16-bit fixed point in two int8 limbs; linear.h P_I8Q).

Asserts, on random shapes and activations spanning many binades: the output equals an exact float64 reference of
the fixed-point definition bit for bit; the AMX and FMA engines give the same bits; every row's output is the same
alone and in any batch (batch invariance / decode == verify); the fused RMSNorm, residual and SwiGLU epilogues follow
torch's op order; and the product stays within bf16 rounding of the dequantized float product.
"""
from __future__ import annotations

import math

import pytest
import torch

from dspark_trt.runtime import native

pytestmark = pytest.mark.skipif(not (native.available() and native.has_vnni()),
                                reason="native kernels with AVX512_VNNI unavailable here "
                                       f"({native.unavailable_reason() or 'no VNNI'}); W8A16 then uses P_I8P")

# (M, N, K): one AMX tile (M ≤ 8); full tiles + 1 or 2 rows on VNNI in the same pass (9, 10, 17); a second tile (12)
SHAPES = [(1, 64, 64), (3, 40, 100), (8, 960, 576), (9, 96, 1536), (10, 48, 130), (12, 40, 64), (17, 33, 65)]


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-6, 2, k)[torch.randperm(k, generator=g)]  # elements 2^-20 .. 2^7 in one row
    x = (torch.randn(m, k, generator=g) * spread).bfloat16()  # [M, K]
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # [N, K]
    s = torch.rand(n, generator=g) * 0.01  # [N] per-row weight scale
    return x, w, s


def _reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32(2^(e-14) · Σ round(x · 2^(14-e)) · w) · s, rounded to bf16: the definition, in exact float64."""
    xd = x.double()  # [M, K]
    e = torch.tensor([math.frexp(float(a))[1] if a > 0 else 0 for a in xd.abs().amax(1)], dtype=torch.float64)
    step = torch.pow(2.0, e - 14)[:, None]  # [M, 1]
    total = torch.round(xd / step) @ w.double().T  # [M, N] exact integers (< 2^53)
    return ((total * step).float() * s).bfloat16()


def _run(x: torch.Tensor, w: torch.Tensor, amx: bool, **kw) -> torch.Tensor:  # noqa: ANN003
    native.set_amx(amx)
    try:
        return native.linear(x, w, native.Pack.I8Q, **kw)
    finally:
        native.set_amx(True)


def test_w8a16_picks_limb_products() -> None:
    assert native.kind_for(torch.int8, torch.bfloat16) == native.Pack.I8Q


@pytest.mark.parametrize("shape", SHAPES)
def test_limb_product_is_exact_and_engine_independent(shape: tuple[int, int, int]) -> None:
    x, w, s = _inputs(*shape, seed=sum(shape))
    ref = _reference(x, w, s)
    fma = _run(x, w, False, scale=s)
    assert torch.equal(fma, ref), f"FMA engine: max |Δ| {float((fma.float() - ref.float()).abs().max()):.3g}"
    if native.amx_active():
        amx = _run(x, w, True, scale=s)
        assert torch.equal(amx, fma), "AMX and FMA engines differ"


@pytest.mark.parametrize("shape", SHAPES)
def test_limb_product_rows_are_batch_invariant(shape: tuple[int, int, int]) -> None:
    x, w, s = _inputs(*shape, seed=7 + sum(shape))
    full = native.linear(x, w, native.Pack.I8Q, scale=s)  # [M, N]
    for m in range(x.shape[0]):
        alone = native.linear(x[m:m + 1].contiguous(), w, native.Pack.I8Q, scale=s)  # [1, N]
        assert torch.equal(alone[0], full[m]), f"row {m} differs alone vs in a batch of {x.shape[0]}"
    sub = native.linear(x[1:].contiguous(), w, native.Pack.I8Q, scale=s) if x.shape[0] > 1 else None
    if sub is not None:
        assert torch.equal(sub, full[1:]), "rows shifted by one in the batch differ"


def test_limb_product_close_to_dequantized() -> None:
    x, w, s = _inputs(9, 960, 576, seed=3)
    y = native.linear(x, w, native.Pack.I8Q, scale=s).float()
    ref = x.float() @ (w.float() * s[:, None]).T  # [M, N]
    torch.testing.assert_close(y, ref, rtol=1 / 128, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("m", [5, 10])  # one tile; a tile + two rows on VNNI
def test_limb_product_epilogues(m: int) -> None:
    x, w, s = _inputs(m, 64, 96, seed=11)
    g = torch.Generator().manual_seed(1)
    nw = (torch.rand(96, generator=g) + 0.5).bfloat16()
    res = torch.randn(m, 32, generator=g).bfloat16()
    # RMSNorm prologue (HF numerics) == the product of the normed rows
    h = x.float()
    normed = ((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16().float() * nw.float()).bfloat16()
    assert torch.equal(native.linear(x, w, native.Pack.I8Q, scale=s, norm=nw, eps=1e-5),
                       native.linear(normed, w, native.Pack.I8Q, scale=s))
    # SwiGLU: up = rows [0, N/2), SiLU input = rows [N/2, N); then + residual
    y = _reference(x, w, s).float()  # [M, 64]
    up, fc = y[:, :32], y[:, 32:]
    expect = ((up * torch.nn.functional.silu(fc).bfloat16().float()).bfloat16().float() + res.float()).bfloat16()
    got = native.linear(x, w, native.Pack.I8Q, scale=s, swiglu=True, residual=res)
    torch.testing.assert_close(got.float(), expect.float(), rtol=2 ** -7, atol=1e-30)
    for amx in (False, True):
        assert torch.equal(_run(x, w, amx, scale=s, swiglu=True, residual=res), got), f"amx={amx} SwiGLU differs"


def test_bidirectional_attention_sees_the_whole_span() -> None:
    """native.attend(bidirectional=True) (the drafter's block attention): every query of a row attends to keys
    0..starts + lengths − 1 — equal to SDPA without a mask within fp32 rounding — and a row's output is the same
    alone and in a batch with rows of other context lengths."""
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, S, MS, T = 6, 2, 64, 3, 64, 4
    ck = torch.randn(S, Hkv, MS, D, generator=g)  # [S, Hkv, max_seq, D]
    cv = torch.randn(S, Hkv, MS, D, generator=g)
    starts = torch.tensor([10, 3, 20])  # context lengths; the block's T keys follow them
    q = torch.randn(S * T, H * D, generator=g)  # [B·T, H·D]
    slots = torch.arange(S)
    out = native.attend(q, ck, cv, slots, starts, torch.full((S,), T), H, None, D ** -0.5, bidirectional=True)
    for b in range(S):
        n = int(starts[b]) + T
        qb = q[b * T:(b + 1) * T].view(T, H, D).transpose(0, 1)  # [H, T, D]
        k = ck[b, :, :n].repeat_interleave(H // Hkv, dim=0)  # [H, n, D]
        v = cv[b, :, :n].repeat_interleave(H // Hkv, dim=0)
        ref = torch.nn.functional.scaled_dot_product_attention(qb, k, v).transpose(0, 1).reshape(T, H * D)
        torch.testing.assert_close(out[b * T:(b + 1) * T], ref, rtol=1e-5, atol=1e-5)
        alone = native.attend(q[b * T:(b + 1) * T].contiguous(), ck, cv, slots[b:b + 1], starts[b:b + 1],
                              torch.tensor([T]), H, None, D ** -0.5, bidirectional=True)
        assert torch.equal(alone, out[b * T:(b + 1) * T]), f"row {b} differs alone vs batched"
    causal = native.attend(q, ck, cv, slots, starts, torch.full((S,), T), H, None, D ** -0.5)
    assert not torch.equal(causal, out)  # the flag changes what the block's early queries see


@pytest.mark.parametrize("threads", [1, 2])
def test_causal_attention_of_a_verify_block_equals_its_queries_alone(threads: int) -> None:
    """A verify block of 9 queries (one request: with 2 threads its queries are split into chunks, each widening its
    keys once more) gives every query the bits it gets alone, as decode — and stays within fp32 rounding of causal
    SDPA over the same keys."""
    g = torch.Generator().manual_seed(9)
    H, Hkv, D, MS, T, start = 9, 3, 64, 128, 9, 70
    ck = torch.randn(1, Hkv, MS, D, generator=g).bfloat16()  # [1, Hkv, max_seq, D]
    cv = torch.randn(1, Hkv, MS, D, generator=g).bfloat16()
    q = torch.randn(T, H * D, generator=g).bfloat16()  # [T, H·D]
    slots, before = torch.tensor([0]), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = native.attend(q, ck, cv, slots, torch.tensor([start]), torch.tensor([T]), H, None, D ** -0.5)
        for t in range(T):
            alone = native.attend(q[t:t + 1].contiguous(), ck, cv, slots, torch.tensor([start + t]), torch.tensor([1]),
                                  H, None, D ** -0.5)
            assert torch.equal(alone[0], block[t]), f"query {t} differs alone vs in the verify block"
    finally:
        torch.set_num_threads(before)
    n = start + T
    qh = q.float().view(T, H, D).transpose(0, 1)  # [H, T, D]
    k = ck[0, :, :n].float().repeat_interleave(H // Hkv, dim=0)  # [H, n, D]
    v = cv[0, :, :n].float().repeat_interleave(H // Hkv, dim=0)
    mask = torch.arange(n)[None, :] <= (start + torch.arange(T))[:, None]  # [T, n]
    ref = torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask).transpose(0, 1).reshape(T, H * D)
    torch.testing.assert_close(block.float(), ref, rtol=2 ** -7, atol=2 ** -7)
