"""Greedy acceptance on the native engines (runtime/native/greedy.cpp via runtime.dispatch.accept) against the torch
reference (spec_decode.accept.greedy_accept) and against each other.

Asserts: accepted and committed tokens equal the reference's on every engine (ties to the lowest index, rows past k
ignored); top-1 and margin agree with softmax + topk to float32 rounding; every engine computes the same bits; a row
alone gives the bits it gives in a batch; rows with NaN or only −inf keep the reference's rules (fallback).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_trt.runtime import dispatch, native, ops
from dspark_trt.spec_decode.accept import greedy_accept
from dspark_trt.spec_decode.protocols import SamplingParams

ENGINES = native.runnable_engines()
pytestmark = pytest.mark.skipif(not ENGINES, reason=f"no native engine runs here ({native.unavailable_reason()})")
V = 49152 + 5  # the default target's vocabulary plus a tail that is not a multiple of 16


def _case(seed: int, b: int, kmax: int, v: int = V, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, kmax + 1, v, generator=g) * 4  # [B, K+1, V]
    target = logits.argmax(-1)
    draft = target[:, :kmax].clone()  # [B, K]
    for r in range(b):  # a rejection at a random position in some rows
        j = int(torch.randint(0, kmax + 1, (1,), generator=g))
        if j < kmax:
            draft[r, j] = (draft[r, j] + 1) % v
    if ties:  # the maximum twice (lowest index wins, margin 0), and near the tail
        top = logits[0, 0].max() + 1
        logits[0, 0, v - 3] = top
        logits[0, 0, 17] = top
    k = torch.randint(0, kmax + 1, (b,), generator=g)  # [B]
    return logits, draft, k


def _native(logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor, engine: str):  # noqa: ANN202
    with native.use_engine(engine):
        assert ops.choose_kernel(logits).native
        res = dispatch.accept(logits, draft, k, None, [SamplingParams()] * logits.shape[0])
    return res


@pytest.mark.parametrize("engine", ENGINES)
@given(seed=st.integers(0, 2 ** 16), b=st.integers(1, 5), kmax=st.integers(0, 8))
@settings(max_examples=12, deadline=None)
def test_native_greedy_accept_equals_the_reference(engine: str, seed: int, b: int, kmax: int) -> None:
    logits, draft, k = _case(seed, b, kmax)
    ref = greedy_accept(logits, draft, k)
    got = _native(logits, draft, k, engine)
    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.next_token, ref.next_token)
    assert torch.allclose(got.top1, ref.top1, rtol=1e-5, atol=1e-7)
    assert torch.allclose(got.margin, ref.margin, rtol=1e-4, atol=1e-6)
    past = torch.arange(kmax + 1)[None] > k[:, None]  # [B, K+1]: ignored positions
    assert not got.top1[past].any() and not got.margin[past].any()


def test_a_tie_commits_the_lowest_index_with_margin_zero() -> None:
    logits, draft, k = _case(3, 1, 0)
    for engine in ENGINES:
        got = _native(logits, draft, k, engine)
        assert int(got.next_token[0]) == 17 and float(got.margin[0, 0]) == 0.0, engine


@pytest.mark.skipif(len(ENGINES) < 2, reason=f"only {ENGINES} runs on this CPU: nothing to compare")
def test_engines_agree_bit_for_bit_on_greedy_statistics() -> None:
    for seed in range(4):
        logits, draft, k = _case(seed, 4, 7)
        got = {e: _native(logits, draft, k, e) for e in ENGINES}
        ref = got[ENGINES[0]]
        for e in ENGINES[1:]:
            for f in ("accepted", "next_token", "top1", "margin"):
                assert torch.equal(getattr(got[e], f), getattr(ref, f)), f"{e} vs {ENGINES[0]}: {f}"


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_statistics_of_a_row_alone_equal_the_batch(engine: str) -> None:
    logits, draft, k = _case(9, 6, 4)
    full = _native(logits, draft, k, engine)
    for r in range(6):
        alone = _native(logits[r:r + 1].contiguous(), draft[r:r + 1], k[r:r + 1], engine)
        for f in ("accepted", "next_token", "top1", "margin"):
            assert torch.equal(getattr(alone, f)[0], getattr(full, f)[r]), f"{engine} row {r}: {f}"


@pytest.mark.parametrize("bad", ["nan", "ninf"])
def test_rows_with_nan_or_only_minus_infinity_keep_the_reference_rules(bad: str) -> None:
    logits, draft, k = _case(5, 2, 2, ties=False)
    k[:] = 2
    if bad == "nan":
        logits[1, 1, 100] = float("nan")
    else:
        logits[1, 1, :] = float("-inf")
    ref = greedy_accept(logits, draft, k)
    assert native.greedy_stats(logits, k) is None  # the engine declines the batch ...
    for engine in ENGINES:  # ... and dispatch answers with the reference's result
        got = _native(logits, draft, k, engine)
        assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.next_token, ref.next_token)
        assert torch.equal(got.top1.isnan(), ref.top1.isnan())
