"""spec_decode.accept: greedy acceptance, exact rejection sampling, the serving distribution."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats as sstats

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode import rng
from dspark_trt.spec_decode.accept import (deterministic_rows, exponential_race, greedy_accept, sample_accept,
                                          target_probs)


def _chi_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs (expected renormalised in float64; zero-prob cells must be 0)."""
    c = counts.double().numpy()
    e = probs.double() / probs.double().sum() * c.sum()
    keep = e.numpy() > 0
    assert c[~keep].sum() == 0, "a zero-probability token was committed"
    return float(sstats.chisquare(c[keep], e.numpy()[keep]).pvalue)


def _onehot_logits(rows: list[list[int]], v: int = 8, hi: float = 5.0) -> torch.Tensor:
    """logits [B, K+1, V] whose argmax at each position is the given token."""
    out = torch.zeros(len(rows), len(rows[0]), v)
    for b, r in enumerate(rows):
        for j, t in enumerate(r):
            out[b, j, t] = hi
    return out


def test_greedy_early_mismatch_recovers_target_token() -> None:
    logits = _onehot_logits([[3, 4, 5, 6]])  # target wants 3,4,5 then bonus 6
    res = greedy_accept(logits, torch.tensor([[3, 1, 5]]), torch.tensor([3]))
    assert res.accepted.tolist() == [1]
    assert res.next_token.tolist() == [4]  # recovered at the first rejection
    assert res.committed(torch.tensor([[3, 1, 5]]), 0) == [3, 4]


def test_greedy_all_accepted_gives_bonus() -> None:
    logits = _onehot_logits([[3, 4, 5, 6]])
    res = greedy_accept(logits, torch.tensor([[3, 4, 5]]), torch.tensor([3]))
    assert res.accepted.tolist() == [3]
    assert res.next_token.tolist() == [6]


def test_greedy_k0_is_plain_decoding() -> None:
    logits = _onehot_logits([[2]])
    res = greedy_accept(logits, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    assert res.accepted.tolist() == [0] and res.next_token.tolist() == [2]
    assert res.top1.shape == (1, 1)


def test_greedy_rows_with_different_k_ignore_positions_past_k() -> None:
    logits = _onehot_logits([[1, 2, 3], [1, 2, 3]])
    draft = torch.tensor([[1, 2], [1, 2]])
    res = greedy_accept(logits, draft, torch.tensor([2, 1]))
    assert res.accepted.tolist() == [2, 1]
    assert res.next_token.tolist() == [3, 2]  # row 1 verified only d_1: bonus from position 1
    assert res.top1[1, 2] == 0 and res.margin[1, 2] == 0 and res.top1[1, 1] > 0


def test_greedy_signals_are_top1_and_margin() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    res = greedy_accept(logits, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    assert res.top1.item() == pytest.approx(0.5, abs=1e-6)
    assert res.margin.item() == pytest.approx(0.2, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 5), st.integers(2, 9), st.integers(0, 10_000))
def test_greedy_matches_sequential_reference(b: int, kmax: int, v: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, kmax + 1, v, generator=g)
    target = logits.argmax(-1)
    draft = torch.where(torch.rand(b, kmax, generator=g) < 0.7, target[:, :kmax], torch.randint(0, v, (b, kmax), generator=g))
    k = torch.randint(0, kmax + 1, (b,), generator=g)
    res = greedy_accept(logits, draft, k)
    for r in range(b):
        n = 0
        while n < int(k[r]) and int(draft[r, n]) == int(target[r, n]):
            n += 1
        assert int(res.accepted[r]) == n
        assert int(res.next_token[r]) == int(target[r, n])


def test_bad_shapes_and_k_raise_clear_errors() -> None:
    logits = torch.zeros(1, 3, 5)
    with pytest.raises(InvalidArgumentError, match="draft must be"):
        greedy_accept(logits, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
    with pytest.raises(InvalidArgumentError, match=r"k must lie in \[0, 2\]"):
        greedy_accept(logits, torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]))
    with pytest.raises(InvalidArgumentError, match="top_p"):
        target_probs(logits, 1.0, 0.0)


def test_target_probs_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    p = target_probs(logits, torch.tensor([1.0]), torch.tensor([0.6]))
    # 0.4 (before 0) kept, 0.3 (before 0.4 < 0.6) kept, 0.2 (before 0.7) dropped
    assert torch.allclose(p, torch.tensor([[0.0, 4 / 7, 3 / 7, 0.0]]), atol=1e-6)
    assert target_probs(logits, torch.tensor([0.0]), torch.tensor([1.0])).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    hot = target_probs(logits, torch.tensor([0.5]), torch.tensor([1.0]))
    assert hot[0, 1] > 0.4 and torch.allclose(hot.sum(-1), torch.ones(1))


def test_sample_greedy_rows_follow_greedy_semantics() -> None:
    logits = _onehot_logits([[3, 4, 5]])
    draft = torch.tensor([[3, 1]])
    q = torch.full((1, 2, 8), 1 / 8)
    res = sample_accept(logits, draft, q, torch.tensor([2]), torch.tensor([0.0]), torch.tensor([1.0]),
                        torch.tensor([7]), torch.tensor([10]))
    assert res.accepted.tolist() == [1] and res.next_token.tolist() == [4]


def test_sample_accepts_when_p_dominates_q_and_bonus_is_from_last_position() -> None:
    v = 6
    logits = torch.full((1, 3, v), -30.0)
    logits[0, 0, 2] = logits[0, 1, 3] = logits[0, 2, 5] = 30.0  # p is (numerically) one-hot
    q = torch.full((1, 2, v), 1 / v)
    res = sample_accept(logits, torch.tensor([[2, 3]]), q, torch.tensor([2]), torch.tensor([1.0]),
                        torch.tensor([1.0]), torch.tensor([1]), torch.tensor([0]))
    assert res.accepted.tolist() == [2]  # p/q = 6 > 1 → always accepted
    assert res.next_token.tolist() == [5]


def test_sample_rejection_resamples_from_residual() -> None:
    v = 4
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # draft always proposes 0, which p never allows
    logits = torch.log(p.clamp_min(1e-30)).view(1, 1, v).repeat(1, 2, 1)
    seen = set()
    for s in range(40):
        res = sample_accept(logits, torch.tensor([[0]]), q, torch.tensor([1]), torch.tensor([1.0]),
                            torch.tensor([1.0]), torch.tensor([s]), torch.tensor([5]))
        assert res.accepted.item() == 0
        seen.add(res.next_token.item())
    assert seen == {1, 2}


def test_sample_requires_q_for_sampled_rows() -> None:
    with pytest.raises(InvalidArgumentError, match="q must be"):
        sample_accept(torch.zeros(1, 2, 4), torch.zeros(1, 1, dtype=torch.long), None, torch.tensor([1]),
                      torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0]))


def test_exponential_race_follows_weights() -> None:
    w = torch.tensor([0.1, 0.0, 0.6, 0.3])
    n = 4000
    toks = exponential_race(w.expand(n, 4), torch.arange(n), torch.full((n,), 3))
    counts = torch.bincount(toks, minlength=4)
    assert counts[1] == 0
    assert _chi_p(counts, w) > 1e-3


def test_speculative_sampling_preserves_target_distribution() -> None:
    """Draft sampled from q, verified against p: the committed tokens are distributed as p (chi-square)."""
    v, kmax, n = 6, 2, 3000
    g = torch.Generator().manual_seed(0)
    logits1 = torch.randn(1, kmax + 1, v, generator=g) * 1.5  # same target dists for every trial
    qlogits = torch.randn(1, kmax, v, generator=g) * 1.5
    temp, top_p = torch.full((n,), 0.9), torch.full((n,), 1.0)
    p = target_probs(logits1, 0.9, 1.0)[0]  # [K+1, V]
    q = target_probs(qlogits, 0.9, 1.0).expand(n, kmax, v)
    seeds = torch.arange(n) + 1000
    # draft tokens sampled from q with the draft stream (independent of the verifier's draws)
    u = rng.uniform(seeds.unsqueeze(1), torch.arange(kmax).unsqueeze(0), rng.STREAM_DRAFT)  # [n, K]
    draft = torch.searchsorted(q.cumsum(-1), u.unsqueeze(-1)).squeeze(-1).clamp_max(v - 1)  # [n, K]
    # K=2 draft with p independent of the prefix: first committed token ~ p[0]
    res = sample_accept(logits1.expand(n, -1, -1), draft, q, torch.full((n,), kmax), temp, top_p, seeds,
                        torch.zeros(n, dtype=torch.long))
    first = torch.where(res.accepted > 0, draft[:, 0], res.next_token)
    assert _chi_p(torch.bincount(first, minlength=v), p[0]) > 1e-3
    # the second committed token (when ≥ 2 are committed) is distributed as p[1]
    second = torch.where(res.accepted > 1, draft[:, 1], res.next_token)[res.accepted >= 1]
    assert _chi_p(torch.bincount(second, minlength=v), p[1]) > 1e-3
    # and acceptance really happens sometimes and fails sometimes (both paths exercised)
    assert 0 < int((res.accepted == 0).sum()) < n


def test_sampling_with_top_p_never_commits_filtered_tokens() -> None:
    v, n = 5, 500
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])).view(1, 1, v).repeat(n, 2, 1)
    q = torch.full((n, 1, v), 1 / v)
    draft = torch.randint(0, v, (n, 1), generator=torch.Generator().manual_seed(1))
    res = sample_accept(logits, draft, q, torch.full((n,), 1), torch.full((n,), 1.0), torch.full((n,), 0.75),
                        torch.arange(n), torch.zeros(n, dtype=torch.long))
    first = torch.where(res.accepted > 0, draft[:, 0], res.next_token)
    assert set(first.tolist()) <= {1, 2}


def _one_hot(draft: torch.Tensor, v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(draft, v).to(torch.float32)  # [B, K, V]


def test_deterministic_rows_are_the_one_hot_q_rows_over_their_verified_positions() -> None:
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    q = _one_hot(draft, 5)
    q[1, 2] = 0.2  # row 1: position 3 not one-hot ...
    q[2, 0] = 0.2  # row 2: position 1 not one-hot
    assert deterministic_rows(q, draft, torch.tensor([3, 3, 3])).tolist() == [True, False, False]
    assert deterministic_rows(q, draft, torch.tensor([3, 2, 0])).tolist() == [True, True, True]  # ... nor verified
    assert deterministic_rows(None, draft, torch.tensor([3, 3, 3])).tolist() == [False] * 3


@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 5), st.lists(st.integers(0, 5), min_size=6, max_size=6))
@settings(max_examples=40, deadline=None)
def test_coupled_rows_commit_the_targets_own_samples(seed: int, kmax: int, agree: list[int]) -> None:
    """A row with a one-hot q (a deterministic proposal) commits exactly the tokens the target's own sampler draws at
    each position — exponential_race(p_j, seed, pos_j), what plain sampling draws — accepting d_j while it is that
    sample: proposals that agree for the first m positions get m (≤ k) accepted, then the sample at m."""
    b, v = 6, 11
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, kmax + 1, v, generator=g) * 2
    temp, top_p = torch.full((b,), 0.8), torch.tensor([1.0, 0.9, 1.0, 0.7, 1.0, 1.0])
    seeds, pos = torch.arange(b) + seed % 1000, torch.randint(0, 500, (b,), generator=g)
    p = target_probs(logits, temp, top_p)  # [B, K+1, V]
    own = torch.stack([exponential_race(p[:, j], seeds, pos + j) for j in range(kmax + 1)], 1)  # [B, K+1]
    m = torch.tensor(agree) % (kmax + 1)  # [B] leading positions where the proposal is the target's sample
    j = torch.arange(kmax)
    draft = torch.where(j < m[:, None], own[:, :kmax], (own[:, :kmax] + 1 + j) % v)  # then a token it is not
    k = torch.randint(0, kmax + 1, (b,), generator=g)
    res = sample_accept(logits, draft, _one_hot(draft, v), k, temp, top_p, seeds, pos)
    want = torch.minimum(m, k)
    assert res.accepted.tolist() == want.tolist()
    assert res.next_token.tolist() == own.gather(1, want[:, None])[:, 0].tolist()


def test_coupled_acceptance_keeps_the_target_distribution() -> None:
    """One fixed token proposed with a one-hot q: accepted at rate p(d) (= min(1, p/q)), and the first committed token
    is distributed as p (chi-square), rejections drawing from the residual."""
    v, n = 6, 4000
    logits = (torch.randn(1, 2, v, generator=torch.Generator().manual_seed(3)) * 1.5).expand(n, -1, -1)
    p = target_probs(logits[:1], 0.9, 1.0)[0]  # [2, V]
    d = int(p[0].argsort()[v // 2])  # a token of middling probability
    draft = torch.full((n, 1), d)
    res = sample_accept(logits, draft, _one_hot(draft, v), torch.ones(n, dtype=torch.long), torch.full((n,), 0.9),
                        torch.ones(n), torch.arange(n) + 77, torch.full((n,), 9))
    rate = float(res.accepted.double().mean())
    assert abs(rate - float(p[0, d])) < 4 * (float(p[0, d]) * (1 - float(p[0, d])) / n) ** 0.5
    first = torch.where(res.accepted > 0, draft[:, 0], res.next_token)
    assert _chi_p(torch.bincount(first, minlength=v), p[0]) > 1e-3
    second = res.next_token[res.accepted > 0]  # the bonus after an accepted d: from p[1]
    assert _chi_p(torch.bincount(second, minlength=v), p[1]) > 1e-3
