"""The pure-torch fallback's products (runtime/ops.py tile_linear): exact by construction on any CPU.

Asserts: every row's product is the same alone, in any batch and at any place in it, for bf16 on either product
dtype the path may pick (bf16 kernels, or fp32 kernels on upcast weights) and fp32; inside `ragged_rows` a long
prompt's rows are one product of their own (the same alone or beside other requests) and padding rows are zeros;
the dtype choice is a measurement made once and logged.
"""
from __future__ import annotations

import logging

import pytest
import torch

from dspark_trt.runtime import ops


@pytest.fixture(params=["bf16-kernels", "bf16-via-fp32", "fp32"])
def case(request, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.dtype, bool]:  # noqa: ANN001
    if request.param == "fp32":
        return torch.float32, False
    via = request.param == "bf16-via-fp32"
    monkeypatch.setitem(ops._f32_products, "bf16", via)
    return torch.bfloat16, via


def _wx(dtype: torch.dtype, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(96, 130, generator=g) * 0.1).to(dtype), torch.randn(rows, 130, generator=g).to(dtype)


def test_rows_are_the_same_alone_and_anywhere_in_a_batch(case: tuple[torch.dtype, bool]) -> None:
    dtype, via = case
    w, x = _wx(dtype, 37)
    full = ops.tile_linear(x, w)  # [37, 96]
    assert full.dtype == dtype
    for i in range(x.shape[0]):
        assert torch.equal(ops.tile_linear(x[i:i + 1], w)[0], full[i]), f"row {i} alone differs"
    assert torch.equal(ops.tile_linear(x[5:], w), full[5:])
    ref = (x.float() @ w.float().T).to(dtype)  # [37, 96] a plain reference, to within rounding
    assert torch.allclose(full.float(), ref.float(), atol=0.05, rtol=0.02)
    if via:
        assert "_dspark_f32" in w.__dict__, "bf16 via fp32 keeps an fp32 copy of the weight"


def test_a_long_prompt_is_one_product_of_its_own_rows(case: tuple[torch.dtype, bool]) -> None:
    dtype, _ = case
    n_long = ops.ROW_EXACT_MAX_T + 7
    w, x = _wx(dtype, n_long, seed=1)
    with ops.ragged_rows(n_long, [n_long]):
        alone = ops.tile_linear(x, w)  # [n_long, 96]
    T, lengths = n_long, [3, n_long, 1]
    batch = torch.randn(3 * T, 130).to(dtype)  # [B·T, in], junk in the padding rows
    batch[T:2 * T] = x
    with ops.ragged_rows(T, lengths):
        got = ops.tile_linear(batch, w)
    assert torch.equal(got[T:2 * T], alone), "a long prompt's rows depend on the other requests"
    assert torch.equal(got[3:T], torch.zeros_like(got[3:T])), "padding rows are zeros"
    for i in range(3):  # short rows are row products: equal to the row alone
        assert torch.equal(got[i], ops.tile_linear(batch[i:i + 1], w)[0])


def test_the_product_dtype_is_measured_once_and_logged(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ops, "_f32_products", {})
    with caplog.at_level(logging.INFO, logger="dspark_trt.runtime.ops"):
        first = ops._bf16_via_f32()
        assert ops._bf16_via_f32() == first
    msgs = [r.getMessage() for r in caplog.records if "torch path: bf16 products" in r.getMessage()]
    assert len(msgs) == 1 and ("fp32 kernels" in msgs[0] or "bf16 kernels" in msgs[0]), msgs


def test_bf16_matrix_products_are_judged_once_and_slow_without_a_bf16_isa(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """training's autocast and the benches' HF rows ask `bf16_matmul_fast`: measured once, logged; a CPU with neither
    AVX512_BF16 nor AMX runs torch's bf16 GEMM on a scalar fallback (~100x slower), so it must answer False there."""
    from dspark_trt.runtime import native

    monkeypatch.setattr(ops, "_f32_products", {})
    with caplog.at_level(logging.INFO, logger="dspark_trt.runtime.ops"):
        first = ops.bf16_matmul_fast()
        assert ops.bf16_matmul_fast() == first and ops.bf16_matmul_fast("cuda") is True
    msgs = [r.getMessage() for r in caplog.records if "bf16 matrix products" in r.getMessage()]
    assert len(msgs) == 1, msgs
    if not native.cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        assert first is False, msgs
