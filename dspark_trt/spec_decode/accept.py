"""Verification of one speculative round: greedy acceptance and exact rejection sampling.

Owns the reference semantics that the fused acceptance kernels (dspark_trt/kernels/) must reproduce bit for bit
(up to float32 rounding of the softmax; a sampled row with a deterministic proposal takes the coupled rule of
`sample_accept`, which only this reference runs): which draft tokens are accepted, which token is committed
after them (recovered at the first rejection, bonus when all K are accepted), and the per-position
confidence signals (target top-1 probability and top-1 − top-2 margin). Also owns `target_probs`, the
one temperature + top-p transform that drafter and target both use. Pure torch: knows nothing of
models, caches, Triton or the runtime.

Shapes: B rows (requests), K = max verify length in the batch (row b verifies k[b] ≤ K tokens),
V vocabulary. logits [B, K+1, V] are the target's outputs for [anchor, d_1..d_K]: position j predicts
the token after d_j (position 0 predicts d_1). Positions j > k[b] of row b are ignored.

Conventions every implementation follows:
- argmax ties resolve to the LOWEST vocabulary index (torch.argmax's rule).
- top1 / margin at ignored positions (j > k[b]) are 0.
- Sampling randomness comes only from `dspark_trt.spec_decode.rng.uniform` (see `sample_accept`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode import rng

__all__ = ["AcceptResult", "deterministic_rows", "exponential_race", "greedy_accept", "greedy_chain", "sample_accept",
           "target_probs", "top_signals"]

_U_OFFSET = 2.0 ** -25  # keeps exponential-race uniforms strictly inside (0, 1)


@dataclass
class AcceptResult:
    """Outcome of verifying one round for B rows."""

    accepted: torch.Tensor  # [B] long: draft tokens accepted (0 ≤ accepted ≤ k)
    next_token: torch.Tensor  # [B] long: recovered token (accepted < k) or bonus token (accepted == k)
    top1: torch.Tensor  # [B, K+1] float32: target top-1 probability per position (0 past k)
    margin: torch.Tensor  # [B, K+1] float32: top-1 − top-2 probability per position (0 past k)

    def committed(self, draft: torch.Tensor, row: int) -> list[int]:
        """Tokens row `row` commits this round: d_1..d_accepted then next_token (length accepted + 1)."""
        n = int(self.accepted[row])
        return [int(t) for t in draft[row, :n].tolist()] + [int(self.next_token[row])]


def _check(logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    if logits.dim() != 3:
        raise InvalidArgumentError(f"logits must be [B, K+1, V], got shape {tuple(logits.shape)}; pass verify() output")
    b, kp1, v = logits.shape
    if draft.shape != (b, kp1 - 1):
        raise InvalidArgumentError(
            f"draft must be [B, K] = [{b}, {kp1 - 1}] to match logits {tuple(logits.shape)}, got {tuple(draft.shape)}")
    if k.shape != (b,):
        raise InvalidArgumentError(f"k must be [B] = [{b}], got {tuple(k.shape)}")
    if b and (int(k.min()) < 0 or int(k.max()) > kp1 - 1):
        raise InvalidArgumentError(f"k must lie in [0, {kp1 - 1}] (the verified length), got {k.tolist()}")
    return b, kp1 - 1, v


def top_signals(probs: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, K+1, V], valid [B, K+1] bool → (top1 [B, K+1], margin [B, K+1]); zero where not valid."""
    if probs.shape[-1] >= 2:
        two = probs.topk(2, dim=-1).values  # [B, K+1, 2]
        top1, margin = two[..., 0], two[..., 0] - two[..., 1]
    else:
        top1 = probs[..., 0]
        margin = top1.clone()
    return torch.where(valid, top1.float(), 0.0), torch.where(valid, margin.float(), 0.0)


def _valid(k: torch.Tensor, kp1: int) -> torch.Tensor:
    return torch.arange(kp1, device=k.device).unsqueeze(0) <= k.unsqueeze(1)  # [B, K+1]


def greedy_accept(
    logits: torch.Tensor,  # [B, K+1, V]
    draft: torch.Tensor,  # [B, K] long
    k: torch.Tensor,  # [B] long
) -> AcceptResult:
    """Greedy verification: accept the longest prefix where d_j == argmax(logits[:, j-1]) (j ≤ k), then commit
    argmax at the first mismatch (recovered) or at position k (bonus). K = 0 is plain decoding: next_token =
    argmax(logits[:, 0]). top1/margin come from softmax(logits) at temperature 1."""
    _check(logits, draft, k)
    k = k.to(torch.long)
    logits = logits.float()
    target = logits.argmax(dim=-1)  # [B, K+1]
    top1, margin = top_signals(torch.softmax(logits, dim=-1), _valid(k, logits.shape[1]))
    return greedy_chain(target, draft, k, top1, margin)


def greedy_chain(
    target: torch.Tensor,  # [B, K+1] long: the target's argmax per verify position
    draft: torch.Tensor,  # [B, K] long
    k: torch.Tensor,  # [B] long
    top1: torch.Tensor,  # [B, K+1] float32 (0 past k)
    margin: torch.Tensor,  # [B, K+1] float32 (0 past k)
) -> AcceptResult:
    """The greedy acceptance chain from the argmax per position: accepted = the longest prefix with d_j ==
    target[j − 1] (j ≤ k), next_token = target[accepted] (recovered or bonus). greedy_accept's rule, shared with
    runtime.dispatch's native statistics (which compute target, top1 and margin in one pass over the logits)."""
    kmax = draft.shape[1]
    k = k.to(torch.long)
    match = (target[:, :kmax] == draft.to(torch.long)) & (torch.arange(kmax, device=k.device).unsqueeze(0) < k.unsqueeze(1))  # [B, K]
    accepted = match.to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target.gather(1, accepted.unsqueeze(1)).squeeze(1)  # [B]
    return AcceptResult(accepted, next_token, top1, margin)


def target_probs(
    logits: torch.Tensor,  # [B, ..., V]
    temperature: torch.Tensor | float,  # [B] or scalar; ≤ 0 → greedy (one-hot argmax)
    top_p: torch.Tensor | float = 1.0,  # [B] or scalar in (0, 1]
) -> torch.Tensor:  # [B, ..., V] float32
    """The serving distribution: softmax(logits / T), then top-p (nucleus) filtering, renormalised.

    Top-p rule (exact): order tokens by probability descending, ties by ascending vocabulary index; keep a token
    iff the total probability of the tokens strictly before it is < top_p (so the top-1 is always kept); zero the
    rest and renormalise. Rows with T ≤ 0 get a one-hot at argmax (lowest index on ties). Used for the target AND
    the drafter so both see identical settings."""
    logits = logits.float()
    b, v = logits.shape[0], logits.shape[-1]
    view = (b,) + (1,) * (logits.dim() - 1)
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(b).reshape(view)
    p_top = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(b).reshape(view)
    if bool(((p_top <= 0) | (p_top > 1)).any()):
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {p_top.flatten().tolist()}")
    greedy = t <= 0
    probs = torch.softmax(logits / torch.where(greedy, torch.ones_like(t), t), dim=-1)
    if bool((p_top < 1).any()):
        # stable descending sort: equal probabilities keep ascending index order
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < p_top
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.nn.functional.one_hot(logits.argmax(dim=-1), v).to(probs.dtype)
        probs = torch.where(greedy, onehot, probs)
    return probs


def exponential_race(
    weights: torch.Tensor,  # [B, V] float32, ≥ 0, need not be normalised
    seeds: torch.Tensor,  # [B] long
    positions: torch.Tensor,  # [B] long
    stream: int = rng.STREAM_RESAMPLE,
) -> torch.Tensor:  # [B] long
    """Draw one token per row with probability ∝ weights, using one uniform per vocabulary lane.

    Exact rule (the kernel must match): for each lane v,
        u_v = rng.uniform(seed, position, stream, lane=v)                   # float32 in [0, 1)
        e_v = -log(u_v + 2**-25)                                            # float32, in (0, 17.4]
        score_v = weights_v / e_v                                           # float32 division
    token = argmax_v score_v (lowest index on ties). Zero-weight lanes score 0 and never win unless every weight
    is 0 (then lane 0 is returned; callers never pass an all-zero row). One pass over V tiles: keep a running
    (max score, index) pair per row. Drafters sample with stream=STREAM_DRAFT (position = the draft token's
    absolute position) so a request's output depends only on its seed, never on batch neighbours."""
    v = weights.shape[-1]
    lanes = torch.arange(v, dtype=torch.int64, device=weights.device).unsqueeze(0)  # [1, V]
    u = rng.uniform(seeds.to(torch.int64).unsqueeze(1), positions.to(torch.int64).unsqueeze(1),
                    stream, lanes)  # [B, V]
    e = -torch.log(u + _U_OFFSET)
    return (weights.float() / e).argmax(dim=-1)


def sample_accept(
    logits: torch.Tensor,  # [B, K+1, V]
    draft: torch.Tensor,  # [B, K] long
    q: torch.Tensor | None,  # [B, K, V] draft distributions (already at the serving temperature/top-p)
    k: torch.Tensor,  # [B] long
    temperature: torch.Tensor,  # [B] float; ≤ 0 → greedy row
    top_p: torch.Tensor,  # [B] float in (0, 1]
    seeds: torch.Tensor,  # [B] long (request seed; any int, used mod 2**32)
    positions: torch.Tensor,  # [B] long: absolute sequence position of d_1 (= committed length incl. prompt)
) -> AcceptResult:
    """Exact speculative rejection sampling (Leviathan et al. / Chen et al.) with counter-based randomness.

    Per sampled row (temperature > 0), with p_j = target_probs(logits[:, j], T, top_p) and d_j at absolute
    position pos_j = positions + j - 1 (j = 1..k):
      1. u_j = rng.uniform(seed, pos_j, STREAM_ACCEPT, lane 0); accept d_j iff u_j * q_j(d_j) < p_j(d_j)
         (= u < min(1, p/q); float32), stopping at the first rejection.
      2. first rejection at j = accepted + 1: next_token = exponential_race(max(0, p_j − q_j), seed, pos_j),
         or exponential_race(p_j, ...) if that residual is all zero (only possible when p_j == q_j).
      3. all k accepted: bonus = exponential_race(p_{k+1}, seed, positions + k) from logits position k.
    So the committed token at absolute position P always uses the STREAM_RESAMPLE uniforms keyed (seed, P).
    Rows with a deterministic proposal (`deterministic_rows`: q_j(d_j) = 1 at every verified j — a suffix match's
    one-hot q) take the coupled form of the same rule instead: d_j is accepted iff the target's own sample at its
    position, exponential_race(p_j, seed, pos_j), is d_j, and the committed token is that sample. It is exact
    rejection sampling (acceptance p_j(d_j) = min(1, p/q); a rejection commits the race's winner, which, given it is
    not d_j, is distributed as the residual) and commits, token for token, what plain sampling with this seed commits.
    Greedy rows (temperature ≤ 0) use greedy_accept semantics and ignore q. top1/margin come from p (the serving
    distribution) for sampled rows and from softmax(logits) for greedy rows; 0 past k."""
    b, kmax, v = _check(logits, draft, k)
    k = k.to(torch.long)
    dev = logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(b)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=dev).expand(b)
    seeds = torch.as_tensor(seeds, dtype=torch.int64, device=dev).expand(b) & rng.MASK32
    positions = torch.as_tensor(positions, dtype=torch.int64, device=dev).expand(b)
    greedy_rows = temperature <= 0
    if bool(greedy_rows.all()):
        return greedy_accept(logits, draft, k)
    res = greedy_accept(logits, draft, k) if bool(greedy_rows.any()) else None  # the greedy rows' outcome
    if q is None or q.shape != (b, kmax, v):
        raise InvalidArgumentError(
            f"q must be the draft distributions [B, K, V] = [{b}, {kmax}, {v}] for sampled rows, got "
            f"{None if q is None else tuple(q.shape)}; make the drafter return q when temperature > 0")
    p = target_probs(logits, temperature, top_p)  # [B, K+1, V]
    d = draft.to(torch.long)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)  # [B]
    sampled = torch.zeros(b, dtype=torch.long, device=dev)  # [B]
    coupled = deterministic_rows(q, d, k) & ~greedy_rows  # [B]
    rest = (~coupled & ~greedy_rows).nonzero()[:, 0]  # the rows of the u-test rule (each row's draws its own)
    if len(rest) == b:  # every row (no copies)
        accepted, sampled = _uniform_accept(p, d, q.float(), k, seeds, positions)
    elif len(rest):
        accepted[rest], sampled[rest] = _uniform_accept(p[rest], d[rest], q[rest].float(), k[rest], seeds[rest],
                                                        positions[rest])
    if bool(coupled.any()):
        rows = coupled.nonzero()[:, 0]
        accepted[rows], sampled[rows] = _coupled_accept(p, d, k, seeds, positions, rows)
    top1_s, margin_s = top_signals(p, _valid(k, kmax + 1))
    if res is None:
        return AcceptResult(accepted=accepted, next_token=sampled, top1=top1_s, margin=margin_s)
    g = greedy_rows
    return AcceptResult(
        accepted=torch.where(g, res.accepted, accepted),
        next_token=torch.where(g, res.next_token, sampled),
        top1=torch.where(g.unsqueeze(1), res.top1, top1_s),
        margin=torch.where(g.unsqueeze(1), res.margin, margin_s),
    )


def _uniform_accept(p: torch.Tensor, d: torch.Tensor, q: torch.Tensor, k: torch.Tensor, seeds: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–3 of sample_accept for R rows: p [R, K+1, V], d [R, K], q [R, K, V] f32, k / seeds / positions [R]
    → (accepted [R], next_token [R])."""
    r, kmax, v = q.shape
    j = torch.arange(kmax, device=p.device).unsqueeze(0)  # [1, K]
    p_d = p[:, :kmax].gather(2, d.unsqueeze(2)).squeeze(2)  # [R, K]
    q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)  # [R, K]
    u = rng.uniform(seeds.unsqueeze(1), positions.unsqueeze(1) + j, rng.STREAM_ACCEPT)  # [R, K]
    ok = (u * q_d < p_d) & (j < k.unsqueeze(1))
    accepted = ok.to(torch.long).cumprod(dim=1).sum(dim=1)  # [R]
    idx = accepted.view(r, 1, 1).expand(r, 1, v)
    p_at = p.gather(1, idx).squeeze(1)  # [R, V] target dist at the committed position
    q_pad = torch.cat([q, torch.zeros(r, 1, v, device=q.device)], dim=1)  # [R, K+1, V]; q at k unused (bonus)
    q_at = q_pad.gather(1, idx).squeeze(1)  # [R, V]
    rejected = accepted < k  # [R]
    residual = torch.clamp(p_at - q_at, min=0.0)
    empty = residual.sum(dim=-1) <= 0
    weights = torch.where((rejected & ~empty).unsqueeze(1), residual, p_at)  # [R, V]
    return accepted, exponential_race(weights, seeds, positions + accepted)


def deterministic_rows(q: torch.Tensor | None, draft: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose proposal is deterministic — q_j(d_j) = 1 at every verified position j < k (a one-hot q,
    as the suffix proposer's; a row with k = 0 counts). sample_accept verifies them coupled to the target's sampler.
    q [B, K, V] | None (None: no row), draft [B, K] long, k [B]."""
    b, kmax = draft.shape
    if q is None:
        return torch.zeros(b, dtype=torch.bool, device=draft.device)
    q_d = q.gather(2, draft.to(torch.long).unsqueeze(2)).squeeze(2).float()  # [B, K]
    j = torch.arange(kmax, device=draft.device).unsqueeze(0)  # [1, K]
    return ((q_d == 1.0) | (j >= k.to(draft.device).unsqueeze(1))).all(dim=1)


def _coupled_accept(p: torch.Tensor, draft: torch.Tensor, k: torch.Tensor, seeds: torch.Tensor,
                    positions: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coupled rule for `rows` [R] (sample_accept): position by position, the target's own sample
    exponential_race(p_j, seed, pos_j); d_j accepted while it equals it; the first sample that does not (or the one
    after d_k) is committed. p [B, K+1, V] serving distributions, draft [B, K] → (accepted [R], next_token [R]);
    one race per committed token, as plain sampling draws."""
    kmax = draft.shape[1]
    acc = torch.zeros(len(rows), dtype=torch.long)
    nxt = torch.zeros(len(rows), dtype=torch.long)
    live = torch.arange(len(rows))  # indices into rows still accepting
    for j in range(kmax + 1):
        if not len(live):
            break
        r = rows[live]
        won = exponential_race(p[r, j], seeds[r], positions[r] + j)  # [L] the target's sample at pos_j
        hit = (j < k[r]) & (won == draft[r, j]) if j < kmax else torch.zeros_like(won, dtype=torch.bool)
        acc[live[hit]] += 1
        nxt[live[~hit]] = won[~hit]
        live = live[hit]
    return acc, nxt
