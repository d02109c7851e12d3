"""Torch semantics of the DSpark Markov step that the block_draft kernel reproduces (the CPU path of dispatch).

Owns the exact rule (until the DSpark drafter exposes its own function, which this must then equal):
    z      = W1[x_{k-1}]                                   # [B, r] float32
    logits = U_k + z @ W2                                  # [B, V] float32
    q_k    = spec.accept.target_probs(logits, T, top_p)    # one-hot argmax for T ≤ 0
    x_k    = argmax(logits) (T ≤ 0) or the exponential race over q_k with uniforms
             rng.uniform(seed, position_k, STREAM_DRAFT, lane=v), e_v = -log(u_v + 2**-25), argmax q_v / e_v
    c_k    = sigmoid(conf_bias_k + z · w_conf)             # optional confidence (the W1 half of the head)
with position_k = positions + k - 1 (positions = absolute position of d_1, as in spec.accept.sample_accept).
Pure torch; no triton.
"""
from __future__ import annotations

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec import rng
from dspark_trt.spec.accept import target_probs

_U_OFFSET = 2.0 ** -25


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


def markov_logits(
    backbone_logits: torch.Tensor,  # [B, V]
    prev: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, V] f32, z [B, r] f32) of one Markov step."""
    if backbone_logits.dim() != 2 or w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != w2.shape[0]:
        raise InvalidArgumentError(
            f"markov step expects U [B, V], W1 [V, r], W2 [r, V]; got {tuple(backbone_logits.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}")
    z = w1[prev.to(torch.long)].float()  # [B, r]
    return backbone_logits.float() + z @ w2.float(), z


def markov_step(
    backbone_logits: torch.Tensor,  # [B, V]
    prev: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of the token drafted here
    want_q: bool = True,
    top_p: torch.Tensor | None = None,  # [B] f32 in (0, 1]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """→ (token [B] long, q [B, V] f32 or None)."""
    tokens, q, _ = markov_step_conf(backbone_logits, prev, w1, w2, temperature, seeds, positions, top_p)
    return tokens, (q if want_q else None)


def markov_step_conf(
    backbone_logits: torch.Tensor,  # [B, V]
    prev: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
    top_p: torch.Tensor | None = None,  # [B]
    conf_bias: torch.Tensor | None = None,  # [B] f32: w_h·h_k + b of the confidence head
    w_conf: torch.Tensor | None = None,  # [r] f32: the W1 half of the confidence head
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """→ (token [B] long, q [B, V] f32, conf [B] f32 or None)."""
    logits, z = markov_logits(backbone_logits, prev, w1, w2)
    b = logits.shape[0]
    t = temperature.float().to(logits.device).expand(b)
    tp = torch.ones(b, device=logits.device) if top_p is None else top_p.float().to(logits.device).expand(b)
    q = target_probs(logits, t, tp)  # [B, V]
    sampled = draft_race(q, seeds.to(logits.device).expand(b), positions.to(logits.device).expand(b))
    tokens = torch.where(t > 0, sampled, logits.argmax(dim=-1))
    conf = None
    if conf_bias is not None and w_conf is not None:
        conf = torch.sigmoid(conf_bias.float() + z @ w_conf.float())
    return tokens, q, conf


def markov_block(
    backbone_logits: torch.Tensor,  # [B, γ, V]
    anchor: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of d_1
    want_q: bool = True,
    top_p: torch.Tensor | None = None,  # [B]
    conf_bias: torch.Tensor | None = None,  # [B, γ]
    w_conf: torch.Tensor | None = None,  # [r]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """γ steps left to right → (tokens [B, γ] long, q [B, γ, V] f32 or None). See markov_block_conf for c_k."""
    tokens, q, _ = markov_block_conf(backbone_logits, anchor, w1, w2, temperature, seeds, positions, top_p,
                                     conf_bias, w_conf)
    return tokens, (q if want_q else None)


def markov_block_conf(
    backbone_logits: torch.Tensor,  # [B, γ, V]
    anchor: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
    top_p: torch.Tensor | None = None,  # [B]
    conf_bias: torch.Tensor | None = None,  # [B, γ]
    w_conf: torch.Tensor | None = None,  # [r]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """→ (tokens [B, γ] long, q [B, γ, V] f32, conf [B, γ] f32 or None)."""
    if backbone_logits.dim() != 3:
        raise InvalidArgumentError(f"backbone logits must be [B, γ, V], got {tuple(backbone_logits.shape)}")
    b, gamma, _ = backbone_logits.shape
    prev = anchor.to(torch.long)
    toks, qs, confs = [], [], []
    for i in range(gamma):
        cb = None if conf_bias is None else conf_bias[:, i]
        tok, q, c = markov_step_conf(backbone_logits[:, i], prev, w1, w2, temperature, seeds, positions + i, top_p,
                                     cb, w_conf)
        toks.append(tok)
        qs.append(q)
        confs.append(c)
        prev = tok
    conf = torch.stack(confs, dim=1) if confs and confs[0] is not None else None  # [B, γ]
    if gamma == 0:
        v = backbone_logits.shape[-1]
        return (torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 0, v), conf)
    return torch.stack(toks, dim=1), torch.stack(qs, dim=1), conf
