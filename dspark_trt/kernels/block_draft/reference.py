"""Torch semantics of draft sampling that the block_draft kernel reproduces (the CPU path of runtime.dispatch).

Owns the exact rule every drafter samples by, written in the DSpark drafter's own terms
(dspark_trt/runtime/drafters/dspark.py): with x_0 = anchor (a target id) and, for k = 1..γ,
    w1x    = W1[x_{k-1}]                          # markov_w1.weight [Vt, r] (nn.Embedding), param dtype
    bias   = F.linear(w1x, W2).float()            # markov_w2.weight [Vd, r] (nn.Linear): rounded to param dtype
    logits = U_k + bias                           # [B, Vd] float32
    q_k    = spec_decode.accept.target_probs(logits, T, top_p)           (one-hot argmax for T ≤ 0)
    i_k    = argmax(logits) (T ≤ 0) or the exponential race over q_k on STREAM_DRAFT:
             u_v = rng.uniform(seed, position_k, STREAM_DRAFT, lane=v), argmax_v q_v / -log(u_v + 2**-25)
    x_k    = d2t[i_k]                             # draft-vocab id → target id (identity without a reduced vocab)
    c_k    = sigmoid((conf_bias_k + w1x·w_conf) / conf_temp_k)    (optional; conf_bias_k = w_h·h_k + b)
position_k = positions + k - 1 (positions = absolute position of d_1, as in spec_decode.accept.sample_accept).
Without a Markov head (w1 = w2 = None: LM / PARD drafters, DSpark drafters built without one) the bias is 0 and
each position is sampled from U_k alone — `sample_block`. q is the serving distribution of
spec_decode.accept.target_probs (the same temperature + top-p as the target's), and the only randomness is
spec_decode.rng on STREAM_DRAFT, distinct from acceptance's streams, so draft and accept draws are independent
and a seed fixes the draft. Pure torch; no triton.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode import rng
from dspark_trt.spec_decode.accept import exponential_race, target_probs


class MarkovBlock(NamedTuple):
    """Result of γ Markov steps for B rows."""

    tokens: torch.Tensor  # [B, γ] long target ids
    q: torch.Tensor | None  # [B, γ, Vd] float32 draft distributions over the draft vocabulary (None: not asked for)
    conf: torch.Tensor | None  # [B, γ] float32 confidences (None without a confidence head)


def empty_block(b: int, gamma: int, vd: int, device: torch.device, with_conf: bool) -> MarkovBlock:
    """Output buffers of a launch: tokens [B, γ] int64, q [B, γ, Vd] f32, conf [B, γ] f32 (None without conf)."""
    return MarkovBlock(torch.empty(b, gamma, dtype=torch.int64, device=device),
                       torch.empty(b, gamma, vd, dtype=torch.float32, device=device),
                       torch.empty(b, gamma, dtype=torch.float32, device=device) if with_conf else None)


def draft_race(
    weights: torch.Tensor,  # [B, V] float32 ≥ 0
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B] long
    """spec_decode.accept.exponential_race on STREAM_DRAFT: argmax_v weights_v / -log(u_v + 2**-25), lowest
    index on ties (the acceptance's own race, on the drafter's stream)."""
    return exponential_race(weights, seeds, positions, stream=rng.STREAM_DRAFT)


def pick(
    logits: torch.Tensor,  # [B, Vd] float32
    temperature: torch.Tensor,  # [B] f32 (≤ 0 → greedy)
    top_p: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of this draft token
) -> tuple[torch.Tensor, torch.Tensor]:  # (ids [B] long, q [B, Vd] float32)
    """One draft position: q = target_probs(logits, T, top_p) (one-hot argmax for greedy rows); sampled rows
    take the STREAM_DRAFT race over q, greedy rows the argmax (lowest index on ties)."""
    greedy_ids = logits.argmax(dim=-1)  # [B]
    sampled = temperature > 0
    if not bool(sampled.any()):  # = target_probs for T ≤ 0, without the softmax
        return greedy_ids, F.one_hot(greedy_ids, logits.shape[-1]).to(torch.float32)
    q = target_probs(logits, temperature, top_p)  # [B, Vd]
    return torch.where(sampled, draft_race(q, seeds, positions), greedy_ids), q


def _rows(b: int, dev: torch.device, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
          top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_p, seeds, positions) broadcast to [B] on `dev`."""
    t = temperature.float().to(dev).expand(b)
    tp = torch.ones(b, device=dev) if top_p is None else top_p.float().to(dev).expand(b)
    return t, tp, seeds.to(dev).expand(b), positions.to(device=dev, dtype=torch.int64).expand(b)


def sample_block(
    logits: torch.Tensor,  # [B, T, V] float32: T independent draft positions
    temperature: torch.Tensor,  # [B] f32 (≤ 0 → greedy)
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of the first of the T tokens
    top_p: torch.Tensor | None = None,  # [B] f32 in (0, 1]
) -> MarkovBlock:
    """T draft positions with no Markov head (token t at positions + t) → MarkovBlock(tokens [B, T], q [B, T, V],
    conf None); equal to markov_block with w1 = w2 = None."""
    b, n, v = logits.shape
    t, tp, seeds, positions = _rows(b, logits.device, temperature, seeds, positions, top_p)
    toks = torch.empty(b, n, dtype=torch.long, device=logits.device)
    q = torch.empty(b, n, v, dtype=torch.float32, device=logits.device)
    for i in range(n):
        toks[:, i], q[:, i] = pick(logits[:, i].float(), t, tp, seeds, positions + i)
    return MarkovBlock(toks, q, None)


def check_shapes(backbone_logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int, int]:
    """→ (B, γ, Vd, r) or InvalidArgumentError."""
    if backbone_logits.dim() != 3 or w1.dim() != 2 or w2.dim() != 2:
        raise InvalidArgumentError(
            f"markov_block expects U [B, γ, Vd], W1 [Vt, r], W2 [Vd, r] (nn.Linear weight); got "
            f"{tuple(backbone_logits.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}")
    b, gamma, vd = backbone_logits.shape
    r = w1.shape[1]
    if w2.shape != (vd, r):
        raise InvalidArgumentError(f"W2 must be [Vd={vd}, r={r}] (markov_w2.weight), got {tuple(w2.shape)}")
    return b, gamma, vd, r


def markov_block(
    backbone_logits: torch.Tensor,  # [B, γ, Vd] U (float32)
    anchor: torch.Tensor,  # [B] long target ids x_0
    w1: torch.Tensor | None,  # [Vt, r]; None with w2 = None: no Markov head (sample_block)
    w2: torch.Tensor | None,  # [Vd, r]
    temperature: torch.Tensor,  # [B] f32 (≤ 0 → greedy)
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of d_1
    top_p: torch.Tensor | None = None,  # [B] f32 in (0, 1]
    d2t: torch.Tensor | None = None,  # [Vd] long draft id → target id
    conf_bias: torch.Tensor | None = None,  # [B, γ] f32
    w_conf: torch.Tensor | None = None,  # [r] f32
    conf_temp: torch.Tensor | None = None,  # [γ] f32
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> MarkovBlock:
    """γ Markov steps left to right (the semantics above). `linear(w1x [B, r], W2) → [B, Vd] float32` computes the
    bias F.linear(w1x, W2) rounded to the param dtype (default: F.linear itself; the CPU runtime passes its native
    product, the same rounding). All-greedy blocks build their one-hot q once, after the loop."""
    if w1 is None or w2 is None:
        if w1 is not None or w2 is not None or d2t is not None or conf_bias is not None:
            raise InvalidArgumentError("markov_block without a Markov head takes w1 = w2 = d2t = conf_bias = None "
                                       "(each position sampled from U alone); pass both W1 and W2 otherwise")
        return sample_block(backbone_logits, temperature, seeds, positions, top_p)
    b, gamma, vd, _ = check_shapes(backbone_logits, w1, w2)
    dev = backbone_logits.device
    t, tp, seeds, positions = _rows(b, dev, temperature, seeds, positions, top_p)
    prev = anchor.to(device=dev, dtype=torch.long)
    toks = torch.empty(b, gamma, dtype=torch.long, device=dev)
    greedy = not bool((t > 0).any())
    ids = torch.empty(b, gamma, dtype=torch.long, device=dev)  # draft-vocab ids (greedy: the one-hot q's hot lane)
    q = None if greedy else torch.empty(b, gamma, vd, dtype=torch.float32, device=dev)
    has_conf = conf_bias is not None and w_conf is not None
    conf = torch.empty(b, gamma, dtype=torch.float32, device=dev) if has_conf else None
    bias_of = linear or (lambda x, w: F.linear(x, w).float())
    d2t = None if d2t is None else d2t.to(dev)
    u = backbone_logits.float()  # [B, γ, Vd]
    wc = None if conf is None else w_conf.float()  # [r]
    for i in range(gamma):
        w1x = w1[prev]  # [B, r]
        logits = u[:, i] + bias_of(w1x, w2)  # [B, Vd]
        if greedy:
            idx = logits.argmax(dim=-1)  # [B], lowest index on ties
        else:
            idx, q[:, i] = pick(logits, t, tp, seeds, positions + i)  # [B], [B, Vd]
        ids[:, i] = idx
        prev = idx if d2t is None else d2t[idx]
        toks[:, i] = prev
        if conf is not None:
            ct = 1.0 if conf_temp is None else conf_temp[i].float()
            conf[:, i] = torch.sigmoid((conf_bias[:, i].float() + (w1x.float() * wc).sum(-1)) / ct)  # per-row sums
    if q is None:
        q = F.one_hot(ids, vd).to(torch.float32)  # [B, γ, Vd]
    return MarkovBlock(toks, q, conf)
