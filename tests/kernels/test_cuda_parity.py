"""GPU-only: the OpenAI Triton fused-acceptance kernel on CUDA equals the torch reference (dspark_trt.spec_decode.accept).

Skipped on CPU-only machines (CI here); scripts/gpu_check.sh runs the wider parity + bandwidth sweep on an H200.
"""
from __future__ import annotations

import pytest
import torch

from dspark_trt.spec_decode import accept as ref
from dspark_trt.spec_decode.protocols import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_accept_cuda_matches_reference(dtype: torch.dtype) -> None:
    from dspark_trt.runtime import dispatch

    g = torch.Generator().manual_seed(0)
    B, K, V = 8, 6, 49152
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(dtype)  # [B, K+1, V]
    draft = logits[:, :K].float().argmax(-1)  # [B, K] accepted by construction ...
    draft[1::2, 2] = (draft[1::2, 2] + 1) % V  # ... except a rejection at position 3 on odd rows
    k = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])  # [B]
    want = ref.greedy_accept(logits.float(), draft, k)
    got = dispatch.accept(logits.cuda(), draft.cuda(), k.cuda(), None, [SamplingParams()] * B)
    assert torch.equal(got.accepted.cpu(), want.accepted)
    assert torch.equal(got.next_token.cpu(), want.next_token)
    torch.testing.assert_close(got.top1.cpu(), want.top1, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got.margin.cpu(), want.margin, rtol=1e-3, atol=1e-4)
