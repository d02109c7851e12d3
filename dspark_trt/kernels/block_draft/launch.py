"""Torch launcher for the block_draft kernel (CUDA, or CPU under TRITON_INTERPRET=1).

Owns argument checks, tile choice and output allocation; semantics are dspark_trt/kernels/block_draft/reference.py
(same arguments, same MarkovBlock result). Top-p < 1 is not fused (`supports_sampling`); the dispatcher
sends such batches to the reference.
"""
from __future__ import annotations

import logging
import os

import torch
import triton

from dspark_trt.kernels.block_draft.kernel import markov_block_kernel
from dspark_trt.kernels.block_draft.reference import MarkovBlock, check_shapes, empty_block

log = logging.getLogger(__name__)

NUM_WARPS = 4
MAX_TILE_ELEMS = 8192  # BLOCK_R * BLOCK_V held in registers per program
SPLIT_MIN_BATCH = 8  # provisional (no GPU measurement yet): from here on W2 is shared across requests (split.py)


def choose_impl(batch: int, on_cuda: bool) -> str:
    """'one' (one launch, a program per request) or 'split' (2 launches per step, W2 read once per 16 requests).
    DSPARK_MARKOV_IMPL=one|split overrides; the interpreter always gets 'one' unless overridden."""
    forced = os.environ.get("DSPARK_MARKOV_IMPL")
    if forced in ("one", "split"):
        return forced
    return "split" if on_cuda and batch >= SPLIT_MIN_BATCH else "one"


def tiles(rank: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_V) for a Markov rank r: BLOCK_R = next pow2 ≥ r, BLOCK_V = 8192 / BLOCK_R (16..1024)."""
    block_r = triton.next_power_of_2(max(rank, 1))
    block_v = max(16, min(1024, MAX_TILE_ELEMS // block_r))
    return block_r, block_v


def supports_sampling(top_p: torch.Tensor | None) -> bool:  # [B]
    """The fused Markov sampler implements top_p = 1 only."""
    return top_p is None or bool((top_p >= 1.0).all())


def markov_block(
    backbone_logits: torch.Tensor,  # [B, γ, Vd]
    anchor: torch.Tensor,  # [B] long target ids
    w1: torch.Tensor,  # [Vt, r]
    w2: torch.Tensor,  # [Vd, r]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64 absolute position of d_1
    top_p: torch.Tensor | None = None,  # [B]; must be 1 (see supports_sampling)
    d2t: torch.Tensor | None = None,  # [Vd] long
    conf_bias: torch.Tensor | None = None,  # [B, γ]
    w_conf: torch.Tensor | None = None,  # [r]
    conf_temp: torch.Tensor | None = None,  # [γ]
    impl: str | None = None,  # "one" | "split" | None (choose_impl)
) -> MarkovBlock:
    """γ Markov steps → MarkovBlock(tokens [B, γ], q [B, γ, Vd], conf [B, γ] | None): one launch, or the
    batched split variant for larger batches (see choose_impl)."""
    b, gamma, vd, r = check_shapes(backbone_logits, w1, w2)
    if not supports_sampling(top_p):
        from dspark_trt.errors import InvalidArgumentError

        raise InvalidArgumentError("fused markov_block supports top_p = 1 only; use dspark_trt.kernels.block_draft.reference")
    if (impl or choose_impl(b, backbone_logits.is_cuda)) == "split":
        from dspark_trt.kernels.block_draft.split import markov_block_split

        return markov_block_split(backbone_logits, anchor, w1, w2, temperature, seeds, positions, d2t, conf_bias,
                                  w_conf, conf_temp)
    dev = backbone_logits.device
    u = backbone_logits if backbone_logits.stride(-1) == 1 else backbone_logits.contiguous()
    w1 = w1.contiguous()
    w2 = w2.contiguous()
    has_conf = conf_bias is not None and w_conf is not None
    out = empty_block(b, gamma, vd, dev, has_conf)
    tokens, q, conf = out.tokens, out.q, out.conf
    if b == 0 or gamma == 0:
        return out
    f32 = dict(device=dev, dtype=torch.float32)
    cb = conf_bias.to(**f32).contiguous() if has_conf else q
    wc = w_conf.to(**f32).contiguous() if has_conf else q
    ct = (torch.ones(gamma, **f32) if conf_temp is None else conf_temp.to(**f32).contiguous()) if has_conf else q
    d2t_arg = d2t.to(device=dev, dtype=torch.int64).contiguous() if d2t is not None else tokens
    block_r, block_v = tiles(r)
    markov_block_kernel[(b,)](
        u, anchor.to(device=dev, dtype=torch.int64).contiguous(), w1, w2, d2t_arg,
        temperature.to(**f32).expand(b).contiguous(),
        (seeds.to(device=dev, dtype=torch.int64).expand(b) & 0xFFFFFFFF).contiguous(),
        positions.to(device=dev, dtype=torch.int64).expand(b).contiguous(),
        cb, wc, ct, vd, r, gamma, u.stride(0), u.stride(1), tokens, q, conf if has_conf else q,
        HAS_D2T=d2t is not None, HAS_CONF=has_conf, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=NUM_WARPS,
    )
    return MarkovBlock(tokens, q, conf)
