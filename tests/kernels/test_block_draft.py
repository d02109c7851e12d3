"""block_draft kernel (Triton interpreter on CPU) against dspark_trt/kernels/block_draft/reference.py, and the reference
against the DSpark drafter's own Markov step (F.linear / nn.Embedding layout, d2t map, confidence head).

Exact tokens; q and confidences within tolerance (bf16 weights: the Markov bias is rounded to bf16 like
F.linear, so q may differ by one bf16 ulp of a logit).
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch

from dspark_trt.kernels.block_draft import reference as R

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")


def _inputs(b: int, gamma: int, vt: int, vd: int, r: int, wdtype: torch.dtype, seed: int, d2t: bool,
            greedy_rows: int = 1) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(b, generator=g) + 0.5
    t[:greedy_rows] = 0.0
    return dict(
        backbone_logits=torch.randn(b, gamma, vd, generator=g) * 2,  # [B, γ, Vd]
        anchor=torch.randint(0, vt, (b,), generator=g),
        w1=(torch.randn(vt, r, generator=g) * 0.3).to(wdtype),  # [Vt, r]
        w2=(torch.randn(vd, r, generator=g) * 0.3).to(wdtype),  # [Vd, r]
        temperature=t,
        seeds=torch.randint(0, 2**40, (b,), generator=g),
        positions=torch.randint(0, 4000, (b,), generator=g),
        d2t=torch.randperm(vt, generator=g)[:vd] if d2t else None,
        conf_bias=torch.randn(b, gamma, generator=g),
        w_conf=torch.randn(r, generator=g) * 0.1,
        conf_temp=torch.rand(gamma, generator=g) + 0.5,
    )


CASES = [  # (B, γ, Vt, Vd, r, weight dtype, d2t)
    (3, 4, 300, 300, 16, torch.float32, False),
    (2, 7, 1000, 700, 32, torch.bfloat16, True),
    (4, 1, 1500, 1500, 8, torch.float32, False),
    (2, 3, 2100, 2100, 64, torch.bfloat16, False),
]


@pytest.mark.parametrize("b,gamma,vt,vd,r,wdtype,d2t", CASES)
def test_kernel_matches_reference(interpreted_kernels: ModuleType, b: int, gamma: int, vt: int, vd: int, r: int,
                                  wdtype: torch.dtype, d2t: bool) -> None:
    a = _inputs(b, gamma, vt, vd, r, wdtype, seed=b + gamma + vd + r, d2t=d2t)
    got = interpreted_kernels.markov_block(**a)
    want = R.markov_block(**a)
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    tol = 1e-5 if wdtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.q, want.q, atol=tol, rtol=1e-3)
    torch.testing.assert_close(got.conf, want.conf, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got.q.sum(-1), torch.ones(b, gamma), atol=1e-4)


def test_all_greedy_without_confidence(interpreted_kernels: ModuleType) -> None:
    a = _inputs(3, 5, 400, 400, 16, torch.float32, seed=5, d2t=False, greedy_rows=3)
    a.update(conf_bias=None, w_conf=None, conf_temp=None)
    got = interpreted_kernels.markov_block(**a)
    want = R.markov_block(**a)
    assert got.conf is None and torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.q.argmax(-1), got.tokens) and bool((got.q.max(-1).values == 1.0).all())


def test_reference_equals_drafter_markov_step() -> None:
    """One greedy step of the reference = the drafter's own torch code path (Embedding → Linear → argmax)."""
    from torch import nn

    g = torch.Generator().manual_seed(0)
    vt, vd, r, b = 50, 40, 8, 3
    emb, lin = nn.Embedding(vt, r), nn.Linear(r, vd, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vt, r, generator=g))
        lin.weight.copy_(torch.randn(vd, r, generator=g))
    d2t = torch.randperm(vt, generator=g)[:vd]
    u = torch.randn(b, 1, vd, generator=g)
    prev = torch.randint(0, vt, (b,), generator=g)
    with torch.no_grad():
        drafter_logits = u[:, 0] + lin(emb(prev)).float()
    out = R.markov_block(u, prev, emb.weight.detach(), lin.weight.detach(), torch.zeros(b), torch.zeros(b),
                         torch.zeros(b), d2t=d2t)
    assert torch.equal(out.tokens[:, 0], d2t[drafter_logits.argmax(-1)])


def test_reference_sampling_uses_draft_stream() -> None:
    """Sampled tokens follow the STREAM_DRAFT race: same (seed, position) → same token; other seeds differ."""
    a = _inputs(1, 1, 500, 500, 8, torch.float32, seed=9, d2t=False, greedy_rows=0)
    first = R.markov_block(**a).tokens
    assert torch.equal(first, R.markov_block(**a).tokens)
    others = set()
    for s in range(8):
        a["seeds"] = torch.tensor([s])
        others.add(int(R.markov_block(**a).tokens[0, 0]))
    assert len(others) > 1


@pytest.mark.parametrize("wdtype,d2t", [(torch.float32, False), (torch.bfloat16, True)])
def test_split_variant_matches_reference(interpreted_kernels: ModuleType, wdtype: torch.dtype, d2t: bool) -> None:
    """The batched vocabulary-split variant (2 launches per step): 18 requests = two request blocks of 16."""
    a = _inputs(18, 2, 400, 300, 16, wdtype, seed=77, d2t=d2t, greedy_rows=5)
    got = interpreted_kernels.markov_block(**a, impl="split")
    want = R.markov_block(**a)
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    torch.testing.assert_close(got.q, want.q, atol=1e-5 if wdtype == torch.float32 else 5e-3, rtol=1e-3)
    torch.testing.assert_close(got.conf, want.conf, atol=1e-5, rtol=1e-5)
