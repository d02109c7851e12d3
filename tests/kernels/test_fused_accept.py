"""fused_accept kernels (Triton interpreter on CPU) against spec_decode.accept, the torch oracle.

Exact accepted lengths and tokens; top-1 / margin within float32 tolerance. Shapes cover V below, at and above
the tile (2048) and several splits, K = 0, K = γ, all-accepted and first-rejected rows, bf16 and fp32 logits,
mixed greedy/sampled batches, argmax ties across splits.
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch

from dspark_trt.spec_decode import accept as ref
from dspark_trt.spec_decode.accept import AcceptResult

ATOL = 2e-6
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")


def _assert_same(got: AcceptResult, want: AcceptResult) -> None:
    assert torch.equal(got.accepted, want.accepted), (got.accepted, want.accepted)
    assert torch.equal(got.next_token, want.next_token), (got.next_token, want.next_token)
    torch.testing.assert_close(got.top1, want.top1, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(got.margin, want.margin, atol=ATOL, rtol=1e-5)


def _greedy_batch(b: int, kmax: int, v: int, dtype: torch.dtype, seed: int,
                  k_mode: str = "random") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, kmax + 1, v, generator=g) * 3).to(dtype)  # [B, K+1, V]
    target = logits.float().argmax(-1)  # [B, K+1]
    draft = torch.randint(0, v, (b, kmax), generator=g)  # [B, K] mostly rejected at position 1
    for row in range(b):
        if row % 3 == 0:
            draft[row] = target[row, :kmax]  # all accepted → bonus
        elif row % 3 == 1 and kmax >= 2:
            draft[row, : kmax // 2] = target[row, : kmax // 2]  # accepted prefix, then a rejection
    if k_mode == "full":
        k = torch.full((b,), kmax, dtype=torch.long)
    else:
        k = torch.randint(0, kmax + 1, (b,), generator=g)
    return logits, draft, k


GREEDY_CASES = [  # (B, K, V, dtype, k_mode)
    (3, 4, 1000, torch.float32, "random"),
    (4, 0, 700, torch.bfloat16, "full"),  # K = 0: plain decoding
    (5, 7, 2048, torch.float32, "full"),  # K = γ, V = one tile
    (3, 3, 5000, torch.bfloat16, "random"),  # 3 tiles, last partial, several splits
    (2, 5, 4097, torch.float32, "full"),
    (1, 1, 31, torch.float32, "full"),
]


@pytest.mark.parametrize("b,kmax,v,dtype,k_mode", GREEDY_CASES)
def test_greedy_matches_reference(interpreted_kernels: ModuleType, b: int, kmax: int, v: int,
                                  dtype: torch.dtype, k_mode: str) -> None:
    logits, draft, k = _greedy_batch(b, kmax, v, dtype, seed=b * 100 + kmax * 10 + v, k_mode=k_mode)
    _assert_same(interpreted_kernels.greedy_accept(logits, draft, k), ref.greedy_accept(logits, draft, k))


def test_greedy_all_accepted_and_first_rejected(interpreted_kernels: ModuleType) -> None:
    logits, _, _ = _greedy_batch(2, 4, 3000, torch.float32, seed=7)
    target = logits.argmax(-1)
    draft = torch.stack([target[0, :4], (target[1, :4] + 1) % 3000])  # row 0 all accepted, row 1 rejected at d_1
    k = torch.tensor([4, 4])
    got = interpreted_kernels.greedy_accept(logits, draft, k)
    assert got.accepted.tolist() == [4, 0]
    assert got.next_token.tolist() == [int(target[0, 4]), int(target[1, 0])]
    _assert_same(got, ref.greedy_accept(logits, draft, k))


def test_greedy_ties_pick_lowest_index_across_splits(interpreted_kernels: ModuleType) -> None:
    v = 6000  # 3 tiles → 3 splits for one row
    logits = torch.zeros(1, 2, v)
    logits[0, 0, [4500, 100, 2500]] = 5.0  # equal maxima in three different splits
    logits[0, 1, [5999, 3000]] = 2.0
    draft, k = torch.tensor([[100]]), torch.tensor([1])
    got = interpreted_kernels.greedy_accept(logits, draft, k)
    want = ref.greedy_accept(logits, draft, k)
    assert got.accepted.tolist() == [1] and got.next_token.tolist() == [3000]
    _assert_same(got, want)
    assert float(got.margin[0, 0]) == 0.0  # duplicate top-1 → margin 0


def test_large_vocab_bf16(interpreted_kernels: ModuleType) -> None:
    logits, draft, k = _greedy_batch(2, 3, 49152, torch.bfloat16, seed=3, k_mode="full")
    _assert_same(interpreted_kernels.greedy_accept(logits, draft, k), ref.greedy_accept(logits, draft, k))


def _sample_batch(b: int, kmax: int, v: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, kmax + 1, v, generator=g) * 2).to(dtype)  # [B, K+1, V]
    temperature = torch.rand(b, generator=g) + 0.5
    temperature[0] = 0.0  # one greedy row inside a sampled batch
    p = ref.target_probs(logits[:, :kmax], temperature, 1.0)  # [B, K, V]
    noise = torch.softmax(torch.randn(b, kmax, v, generator=g) * 2, -1)
    mix = torch.rand(b, 1, 1, generator=g)
    q = (mix * p + (1 - mix) * noise) if kmax else noise  # [B, K, V] partly close to p → long accepted prefixes
    if kmax:
        draft = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, kmax)
    else:
        draft = torch.zeros(b, 0, dtype=torch.long)
    return dict(logits=logits, draft=draft, q=q, k=torch.randint(0, kmax + 1, (b,), generator=g),
                temperature=temperature, top_p=torch.ones(b), seeds=torch.randint(0, 2**40, (b,), generator=g),
                positions=torch.randint(0, 4000, (b,), generator=g))


SAMPLE_CASES = [  # (B, K, V, dtype)
    (4, 3, 5000, torch.float32),
    (4, 2, 3000, torch.bfloat16),
    (6, 7, 1000, torch.float32),
    (3, 0, 777, torch.float32),
    (2, 4, 4099, torch.bfloat16),
]


@pytest.mark.parametrize("b,kmax,v,dtype", SAMPLE_CASES)
def test_sampling_matches_reference(interpreted_kernels: ModuleType, b: int, kmax: int, v: int,
                                    dtype: torch.dtype) -> None:
    a = _sample_batch(b, kmax, v, dtype, seed=b * 1000 + kmax * 10 + v)
    got = interpreted_kernels.sample_accept(**a)
    _assert_same(got, ref.sample_accept(**a))


def test_sampling_outcomes_vary(interpreted_kernels: ModuleType) -> None:
    """Across seeds both rejections and full acceptances happen (the chain is really exercised)."""
    accepted, full = [], 0
    for seed in range(4):
        a = _sample_batch(6, 3, 800, torch.float32, seed=seed)
        a["k"] = torch.full((6,), 3)
        got = interpreted_kernels.sample_accept(**a)
        _assert_same(got, ref.sample_accept(**a))
        accepted += got.accepted[1:].tolist()
        full += int((got.accepted[1:] == 3).sum())
    assert min(accepted) == 0 and full > 0


def test_top_p_is_rejected(interpreted_kernels: ModuleType) -> None:
    from dspark_trt.errors import InvalidArgumentError

    a = _sample_batch(2, 2, 100, torch.float32, seed=1)
    a["top_p"] = torch.tensor([0.9, 1.0])
    assert not interpreted_kernels.supports_sampling(a["top_p"])
    with pytest.raises(InvalidArgumentError):
        interpreted_kernels.sample_accept(**a)


@pytest.mark.parametrize("eps", [1e-3, -1e-3])
def test_sampling_acceptance_boundary(interpreted_kernels: ModuleType, eps: float) -> None:
    """q(d) set 0.1 % above / below p(d)/u: the kernel must reject / accept exactly like the reference."""
    from dspark_trt.spec_decode import rng

    b, v = 8, 300
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(b, 2, v, generator=g)  # [B, 2, V]
    temperature, seeds = torch.full((b,), 0.9), torch.randint(0, 2**32, (b,), generator=g)
    positions = torch.randint(0, 1000, (b,), generator=g)
    p = ref.target_probs(logits[:, 0], temperature, 1.0)  # [B, V]
    draft = p.argmin(-1, keepdim=True)  # small p(d) so that q(d) = p(d)/u stays < 1
    u = rng.uniform(seeds, positions, rng.STREAM_ACCEPT)  # [B]
    q_d = p.gather(1, draft).squeeze(1) / u * (1 + eps)
    q = torch.full((b, 1, v), 1.0)
    q[:, 0].scatter_(1, draft, 0.0)
    q = q / q.sum(-1, keepdim=True) * (1 - q_d).view(b, 1, 1)
    q[:, 0].scatter_(1, draft, q_d.unsqueeze(1))
    a = dict(logits=logits, draft=draft, q=q, k=torch.ones(b, dtype=torch.long), temperature=temperature,
             top_p=torch.ones(b), seeds=seeds, positions=positions)
    got, want = interpreted_kernels.sample_accept(**a), ref.sample_accept(**a)
    assert want.accepted.tolist() == ([0] * b if eps > 0 else [1] * b)
    _assert_same(got, want)


def test_random_shapes(interpreted_kernels: ModuleType) -> None:
    """Seeded random (B, K, V, dtype, mode) draws, V mostly not a multiple of the 2048 tile."""
    g = torch.Generator().manual_seed(2026)
    for i in range(8):
        b = int(torch.randint(1, 7, (1,), generator=g))
        kmax = int(torch.randint(0, 8, (1,), generator=g))
        v = int(torch.randint(2, 6000, (1,), generator=g))
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        if i % 3 == 2:
            a = _sample_batch(b, kmax, v, dtype, seed=i)
            _assert_same(interpreted_kernels.sample_accept(**a), ref.sample_accept(**a))
        else:
            logits, draft, k = _greedy_batch(b, kmax, v, dtype, seed=i)
            _assert_same(interpreted_kernels.greedy_accept(logits, draft, k), ref.greedy_accept(logits, draft, k))
