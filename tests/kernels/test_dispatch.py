"""dspark_trt.runtime.dispatch: the single routing point (CPU → torch reference, CUDA → kernels)."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.runtime import dispatch
from dspark_trt.spec_decode import accept as ref
from dspark_trt.spec_decode.protocols import SamplingParams


def _batch(b: int = 2, kmax: int = 3, v: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, kmax + 1, v, generator=g)  # [B, K+1, V]
    draft = torch.randint(0, v, (b, kmax), generator=g)
    q = torch.softmax(torch.randn(b, kmax, v, generator=g), -1)
    return logits, draft, torch.full((b,), kmax), q


def test_cpu_tensors_never_use_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dispatch.use_kernels(torch.zeros(2))
    monkeypatch.setenv("DSPARK_KERNELS", "0")
    assert not dispatch.use_kernels(torch.zeros(2))


def test_greedy_routes_to_reference() -> None:
    logits, draft, k, _ = _batch()
    got = dispatch.accept(logits, draft, k, None, [SamplingParams(), SamplingParams()])
    want = ref.greedy_accept(logits, draft, k)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)


def test_sampling_routes_to_reference_with_positions() -> None:
    logits, draft, k, q = _batch()
    sp = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.2, top_p=0.9, seed=4)]
    pos = torch.tensor([10, 20])
    got = dispatch.accept(logits, draft, k, q, sp, positions=pos)
    want = ref.sample_accept(logits, draft, q, k, torch.tensor([0.8, 1.2]), torch.tensor([1.0, 0.9]),
                             torch.tensor([3, 4]), pos)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)


def test_sampling_without_positions_is_a_user_error() -> None:
    logits, draft, k, q = _batch()
    with pytest.raises(InvalidArgumentError, match="positions"):
        dispatch.accept(logits, draft, k, q, [SamplingParams(temperature=1.0)] * 2)


def test_shape_errors() -> None:
    logits, draft, k, _ = _batch()
    with pytest.raises(InvalidArgumentError):
        dispatch.accept(logits, draft[:, :2], k, None, [SamplingParams()] * 2)
    with pytest.raises(InvalidArgumentError):
        dispatch.accept(logits, draft, k, None, [SamplingParams()])


def test_markov_block_routes_to_reference() -> None:
    from dspark_trt.kernels.block_draft import reference

    g = torch.Generator().manual_seed(1)
    u, w1, w2 = torch.randn(2, 3, 40, generator=g), torch.randn(40, 4, generator=g), torch.randn(40, 4, generator=g)
    anchor, pos = torch.tensor([1, 2]), torch.tensor([7, 9])
    sp = [SamplingParams(temperature=0.7, seed=5), SamplingParams()]
    got = dispatch.markov_block(u, anchor, w1, w2, sp, pos)
    want = reference.markov_block(u, anchor, w1, w2, torch.tensor([0.7, 0.0]), torch.tensor([5, 0]), pos)
    assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.q, want.q)


def test_kernel_branch_under_interpreter(monkeypatch: pytest.MonkeyPatch, interpreted_kernels: object) -> None:
    """Force the kernel branch on CPU (Triton interpreter): same results as the reference; top_p < 1 falls back."""
    calls: list[str] = []
    monkeypatch.setattr(dispatch, "use_kernels", lambda *t: True)
    real_sample = interpreted_kernels.sample_accept  # type: ignore[attr-defined]

    def spy(*a: object, **kw: object) -> object:
        calls.append("kernel")
        return real_sample(*a, **kw)

    monkeypatch.setattr(interpreted_kernels, "sample_accept", spy)
    logits, draft, k, q = _batch(3, 3, 300)
    g = dispatch.accept(logits, draft, k, None, [SamplingParams()] * 3)
    want = ref.greedy_accept(logits, draft, k)
    assert torch.equal(g.accepted, want.accepted) and torch.equal(g.next_token, want.next_token)
    sp = [SamplingParams(temperature=0.9, seed=s) for s in range(3)]
    pos = torch.tensor([4, 5, 6])
    got = dispatch.accept(logits, draft, k, q, sp, positions=pos)
    want = ref.sample_accept(logits, draft, q, k, torch.full((3,), 0.9), torch.ones(3), torch.arange(3), pos)
    assert torch.equal(got.next_token, want.next_token) and calls == ["kernel"]
    dispatch.accept(logits, draft, k, q, [SamplingParams(temperature=0.9, top_p=0.5)] * 3, positions=pos)
    assert calls == ["kernel"]  # nucleus sampling went to the reference
