"""Torch semantics of the DSpark Markov block that the block_draft kernel reproduces (the CPU path of dispatch).

Owns the exact rule, written in the DSpark drafter's own terms (dspark_trt/runtime/drafters/dspark.py,
DSparkDrafter.propose): with x_0 = anchor (a target id) and, for k = 1..γ,
    w1x    = W1[x_{k-1}]                          # markov_w1.weight [Vt, r] (nn.Embedding), param dtype
    bias   = F.linear(w1x, W2).float()            # markov_w2.weight [Vd, r] (nn.Linear): rounded to param dtype
    logits = U_k + bias                           # [B, Vd] float32
    q_k    = spec_decode.accept.target_probs(logits, T, top_p)           (one-hot argmax for T ≤ 0)
    i_k    = argmax(logits) (T ≤ 0) or the exponential race over q_k on STREAM_DRAFT:
             u_v = rng.uniform(seed, position_k, STREAM_DRAFT, lane=v), argmax_v q_v / -log(u_v + 2**-25)
    x_k    = d2t[i_k]                             # draft-vocab id → target id (identity without a reduced vocab)
    c_k    = sigmoid((conf_bias_k + w1x·w_conf) / conf_temp_k)    (optional; conf_bias_k = w_h·h_k + b)
position_k = positions + k - 1 (positions = absolute position of d_1, as in spec_decode.accept.sample_accept).
The drafter samples with torch.multinomial today; kernels need the counter-based race above (docs/plugins.md).
Pure torch; no triton.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode import rng
from dspark_trt.spec_decode.accept import target_probs

_U_OFFSET = 2.0 ** -25


class MarkovBlock(NamedTuple):
    """Result of γ Markov steps for B rows."""

    tokens: torch.Tensor  # [B, γ] long target ids
    q: torch.Tensor  # [B, γ, Vd] float32 draft distributions over the draft vocabulary
    conf: torch.Tensor | None  # [B, γ] float32 confidences (None without a confidence head)


def draft_race(
    weights: torch.Tensor,  # [B, V] float32 ≥ 0
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B] long
    """Exponential race on STREAM_DRAFT: argmax_v weights_v / -log(u_v + 2**-25), lowest index on ties."""
    lanes = torch.arange(weights.shape[-1], dtype=torch.int64, device=weights.device).unsqueeze(0)  # [1, V]
    u = rng.uniform((seeds.to(torch.int64) & rng.MASK32).unsqueeze(1), positions.to(torch.int64).unsqueeze(1),
                    rng.STREAM_DRAFT, lanes)  # [B, V]
    return (weights.float() / -torch.log(u + _U_OFFSET)).argmax(dim=-1)


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
    w1: torch.Tensor,  # [Vt, r]
    w2: torch.Tensor,  # [Vd, r]
    temperature: torch.Tensor,  # [B] f32 (≤ 0 → greedy)
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of d_1
    top_p: torch.Tensor | None = None,  # [B] f32 in (0, 1]
    d2t: torch.Tensor | None = None,  # [Vd] long draft id → target id
    conf_bias: torch.Tensor | None = None,  # [B, γ] f32
    w_conf: torch.Tensor | None = None,  # [r] f32
    conf_temp: torch.Tensor | None = None,  # [γ] f32
) -> MarkovBlock:
    """γ Markov steps left to right (the semantics above)."""
    b, gamma, vd, _ = check_shapes(backbone_logits, w1, w2)
    dev = backbone_logits.device
    t = temperature.float().to(dev).expand(b)
    tp = torch.ones(b, device=dev) if top_p is None else top_p.float().to(dev).expand(b)
    seeds = seeds.to(dev).expand(b)
    positions = positions.to(device=dev, dtype=torch.int64).expand(b)
    prev = anchor.to(device=dev, dtype=torch.long)
    toks = torch.empty(b, gamma, dtype=torch.long, device=dev)
    q = torch.empty(b, gamma, vd, dtype=torch.float32, device=dev)
    has_conf = conf_bias is not None and w_conf is not None
    conf = torch.empty(b, gamma, dtype=torch.float32, device=dev) if has_conf else None
    for i in range(gamma):
        w1x = w1[prev]  # [B, r]
        logits = backbone_logits[:, i].float() + F.linear(w1x, w2).float()  # [B, Vd]
        qi = target_probs(logits, t, tp)  # [B, Vd]
        idx = torch.where(t > 0, draft_race(qi, seeds, positions + i), logits.argmax(dim=-1))
        prev = idx if d2t is None else d2t.to(dev)[idx]
        toks[:, i] = prev
        q[:, i] = qi
        if conf is not None:
            ct = 1.0 if conf_temp is None else conf_temp[i].float()
            conf[:, i] = torch.sigmoid((conf_bias[:, i].float() + w1x.float() @ w_conf.float()) / ct)
    return MarkovBlock(toks, q, conf)
