"""Torch launchers for the block_draft kernel (CUDA, or CPU under TRITON_INTERPRET=1).

Owns argument checks, tile choice and output allocation; semantics are plugins/block_draft/reference.py.
Top-p < 1 is not fused (`supports_sampling`); the dispatcher sends such batches to the reference.
"""
from __future__ import annotations

import logging

import torch
import triton

from dspark_trt.errors import InvalidArgumentError
from plugins.block_draft.kernel import markov_block_kernel

log = logging.getLogger(__name__)

NUM_WARPS = 4
MAX_TILE_ELEMS = 8192  # BLOCK_R * BLOCK_V held in registers per program


def tiles(rank: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_V) for a Markov rank r: BLOCK_R = next pow2 ≥ r, BLOCK_V = 8192 / BLOCK_R (16..1024)."""
    block_r = triton.next_power_of_2(max(rank, 1))
    block_v = max(16, min(1024, MAX_TILE_ELEMS // block_r))
    return block_r, block_v


def supports_sampling(top_p: torch.Tensor | None) -> bool:  # [B]
    """The fused Markov sampler implements top_p = 1 only."""
    return top_p is None or bool((top_p >= 1.0).all())


def markov_block_conf(
    backbone_logits: torch.Tensor,  # [B, γ, V]
    anchor: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of d_1
    conf_bias: torch.Tensor | None = None,  # [B, γ]
    w_conf: torch.Tensor | None = None,  # [r]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """→ (tokens [B, γ] long, q [B, γ, V] f32, conf [B, γ] f32 or None), one launch."""
    if backbone_logits.dim() != 3 or w1.dim() != 2 or w2.dim() != 2:
        raise InvalidArgumentError(
            f"markov_block expects U [B, γ, V], W1 [V, r], W2 [r, V]; got {tuple(backbone_logits.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}")
    b, gamma, v = backbone_logits.shape
    r = w1.shape[1]
    if w1.shape[0] != v or w2.shape != (r, v):
        raise InvalidArgumentError(f"W1 must be [V={v}, r] and W2 [r, V={v}]; got {tuple(w1.shape)}, {tuple(w2.shape)}")
    dev = backbone_logits.device
    u = backbone_logits if backbone_logits.stride(-1) == 1 else backbone_logits.contiguous()
    w1 = w1.contiguous()
    w2 = w2.contiguous()
    tokens = torch.empty(b, gamma, dtype=torch.int64, device=dev)
    q = torch.empty(b, gamma, v, dtype=torch.float32, device=dev)
    has_conf = conf_bias is not None and w_conf is not None
    conf = torch.empty(b, gamma, dtype=torch.float32, device=dev) if has_conf else None
    if b == 0 or gamma == 0:
        return tokens, q, conf
    cb = conf_bias.to(device=dev, dtype=torch.float32).contiguous() if has_conf else q
    wc = w_conf.to(device=dev, dtype=torch.float32).contiguous() if has_conf else q
    block_r, block_v = tiles(r)
    markov_block_kernel[(b,)](
        u, anchor.to(device=dev, dtype=torch.int64).contiguous(), w1, w2,
        temperature.to(device=dev, dtype=torch.float32).expand(b).contiguous(),
        (seeds.to(device=dev, dtype=torch.int64).expand(b) & 0xFFFFFFFF).contiguous(),
        positions.to(device=dev, dtype=torch.int64).expand(b).contiguous(),
        cb, wc, tokens, q, conf if has_conf else q, v, r, gamma, u.stride(0), u.stride(1),
        HAS_CONF=has_conf, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=NUM_WARPS,
    )
    return tokens, q, conf


def markov_block(
    backbone_logits: torch.Tensor,  # [B, γ, V]
    anchor: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
    want_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """→ (tokens [B, γ] long, q [B, γ, V] f32 or None)."""
    tokens, q, _ = markov_block_conf(backbone_logits, anchor, w1, w2, temperature, seeds, positions)
    return tokens, (q if want_q else None)


def markov_step(
    backbone_logits: torch.Tensor,  # [B, V]
    prev: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [V, r]
    w2: torch.Tensor,  # [r, V]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of this token
    want_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step = a block of γ = 1 → (token [B] long, q [B, V] f32 or None)."""
    tokens, q = markov_block(backbone_logits.unsqueeze(1), prev, w1, w2, temperature, seeds, positions, want_q)
    return tokens[:, 0], (None if q is None else q[:, 0])
