"""Torch launchers for the fused acceptance kernels (CUDA, or CPU under TRITON_INTERPRET=1).

Owns argument checking, the split heuristic (how many programs share one logits row), the workspace and the
two launches; returns dspark_trt.spec_decode.accept.AcceptResult so callers cannot tell it from the reference.
Top-p < 1 needs a sort over V and is not fused: `supports_sampling` tells the dispatcher to use the reference.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import triton

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.accept import AcceptResult
from dspark_trt.kernels.fused_accept.kernel import accept_finalize_kernel, accept_stats_kernel

log = logging.getLogger(__name__)

BLOCK_V = 2048  # tile of the online softmax (elements; 4 KiB of bf16)
FINAL_BLOCK_V = 1024  # tile of the exponential-race row pass
NUM_WARPS = 8
FINAL_NUM_WARPS = 4
TARGET_PROGRAMS = 2048  # ≥ 2 full waves of 256-thread programs on 132 SMs (H200): balanced tails
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Static launch parameters of one acceptance call (also what the TensorRT plugin declares)."""

    rows: int  # B*(K+1)
    splits: int  # S programs per row
    chunk: int  # V elements per split (multiple of BLOCK_V)
    block_s: int  # next power of two ≥ S


def plan(batch: int, kp1: int, vocab: int, target_programs: int | None = None) -> LaunchPlan:
    """Choose S so that B*(K+1)*S ≈ target_programs (default TARGET_PROGRAMS) without tiles smaller than BLOCK_V."""
    target_programs = TARGET_PROGRAMS if target_programs is None else target_programs
    rows = max(batch * kp1, 1)
    tiles = triton.cdiv(vocab, BLOCK_V)
    splits = max(1, min(tiles, triton.cdiv(target_programs, rows)))
    chunk = triton.cdiv(tiles, splits) * BLOCK_V
    splits = triton.cdiv(vocab, chunk)
    return LaunchPlan(rows=rows, splits=splits, chunk=chunk, block_s=triton.next_power_of_2(splits))


def supports_sampling(top_p: torch.Tensor) -> bool:  # [B]
    """The fused sampler implements top_p = 1 only (nucleus filtering needs a sort over V)."""
    return bool((top_p >= 1.0).all())


def _check(logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int]:
    if logits.dim() != 3 or logits.dtype not in LOGIT_DTYPES:
        raise InvalidArgumentError(
            f"logits must be [B, K+1, V] fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    b, kp1, v = logits.shape
    if draft.shape != (b, kp1 - 1) or k.shape != (b,):
        raise InvalidArgumentError(
            f"draft must be [B, K] = [{b}, {kp1 - 1}] and k [B]; got {tuple(draft.shape)}, {tuple(k.shape)}")
    if v >= 2**31 - 1:
        raise InvalidArgumentError(f"vocabulary {v} too large for int32 indices")
    return b, kp1, v


def _launch(
    logits: torch.Tensor,  # [B, K+1, V]
    draft: torch.Tensor,  # [B, K]
    q: torch.Tensor | None,  # [B, K, V]
    k: torch.Tensor,  # [B]
    temperature: torch.Tensor,  # [B]
    seeds: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B]
) -> AcceptResult:
    b, kp1, v = _check(logits, draft, k)
    dev = logits.device
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    draft = draft.to(device=dev, dtype=torch.int64).contiguous()
    k = k.to(device=dev, dtype=torch.int64).contiguous()
    temperature = temperature.to(device=dev, dtype=torch.float32).contiguous()
    seeds = (seeds.to(device=dev, dtype=torch.int64) & 0xFFFFFFFF).contiguous()
    positions = positions.to(device=dev, dtype=torch.int64).contiguous()
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    next_token = torch.empty(b, dtype=torch.int64, device=dev)
    top1 = torch.empty(b, kp1, dtype=torch.float32, device=dev)
    margin = torch.empty(b, kp1, dtype=torch.float32, device=dev)
    if b == 0:
        return AcceptResult(accepted, next_token, top1, margin)
    p = plan(b, kp1, v)
    part_f = torch.empty(p.rows, p.splits, 3, dtype=torch.float32, device=dev)  # [B*(K+1), S, 3]
    part_i = torch.empty(p.rows, p.splits, dtype=torch.int32, device=dev)  # [B*(K+1), S]
    accept_stats_kernel[(p.rows, p.splits)](
        logits, k, temperature, v, kp1, p.splits, p.chunk, logits.stride(0), logits.stride(1), part_f, part_i,
        BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
    )
    has_q = q is not None
    if has_q:
        q = q.to(device=dev, dtype=torch.float32)
        q = q if q.stride(-1) == 1 else q.contiguous()
    q_arg = q if has_q else part_f  # any valid pointer; never read when HAS_Q is False
    accept_finalize_kernel[(b,)](
        logits, draft, q_arg, k, temperature, seeds, positions, part_f, part_i,
        v, kp1, p.splits, logits.stride(0), logits.stride(1), draft.stride(0),
        q.stride(0) if has_q else 0, q.stride(1) if has_q else 0,
        accepted, next_token, top1, margin,
        HAS_Q=has_q, BLOCK_S=p.block_s, BLOCK_V=FINAL_BLOCK_V, num_warps=FINAL_NUM_WARPS,
    )
    return AcceptResult(accepted, next_token, top1, margin)


def greedy_accept(
    logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16
    draft: torch.Tensor,  # [B, K] long
    k: torch.Tensor,  # [B] long
) -> AcceptResult:
    """Kernel twin of spec_decode.accept.greedy_accept."""
    b = logits.shape[0]
    zeros_f = torch.zeros(b, dtype=torch.float32, device=logits.device)
    zeros_i = torch.zeros(b, dtype=torch.int64, device=logits.device)
    return _launch(logits, draft, None, k, zeros_f, zeros_i, zeros_i)


def sample_accept(
    logits: torch.Tensor,  # [B, K+1, V]
    draft: torch.Tensor,  # [B, K] long
    q: torch.Tensor | None,  # [B, K, V] draft distributions
    k: torch.Tensor,  # [B] long
    temperature: torch.Tensor,  # [B] f32
    top_p: torch.Tensor,  # [B] f32; must be 1 (see supports_sampling)
    seeds: torch.Tensor,  # [B] long
    positions: torch.Tensor,  # [B] long absolute position of d_1
) -> AcceptResult:
    """Kernel twin of spec_decode.accept.sample_accept for top_p = 1 (greedy rows inside the batch are fine)."""
    if not supports_sampling(top_p):
        raise InvalidArgumentError("fused sample_accept supports top_p = 1 only; use spec_decode.accept.sample_accept")
    b, kp1, v = _check(logits, draft, k)
    if bool((temperature > 0).any()) and (q is None or q.shape != (b, kp1 - 1, v)):
        raise InvalidArgumentError(
            f"q must be the draft distributions [B, K, V] = [{b}, {kp1 - 1}, {v}] for sampled rows, got "
            f"{None if q is None else tuple(q.shape)}")
    return _launch(logits, draft, q if bool((temperature > 0).any()) else None, k, temperature, seeds, positions)
