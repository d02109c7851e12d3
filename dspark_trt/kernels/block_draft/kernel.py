"""OpenAI Triton kernel of the DSpark Markov head over a whole block: γ dependent steps in one launch.

Owns `markov_block_kernel`, grid (B,): program b loops k = 1..γ; each step gathers z = W1[x_{k-1}] (r values),
streams W2 (nn.Linear layout [Vd, r]) in [BLOCK_R, BLOCK_V] tiles to form x = (U_k + z·W2) / T into the q row
with an online max/argmax/Σexp, then re-reads that row once to normalise q and run the exponential race
(STREAM_DRAFT) for sampled rows; the drawn token (mapped through d2t) feeds step k+1. Optional confidence
c_k = sigmoid((conf_bias_k + z·w_conf) / T_k). Semantics are dspark_trt/kernels/block_draft/reference.py (top_p = 1).
Parameter order follows the TensorRT QDP AOT ABI (inputs, int32 scalars, outputs, constexprs).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_trt.kernels import _rng

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
BIG_IDX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def write_q_and_race(qrow, V, m, s, am, sampled, seed, pos, offs_v, BLOCK_V: tl.constexpr):
    """One block position's q over V tiles (softmax from the running max m and sum s; one-hot at argmax am when
    greedy), stored into qrow, and the exponential-race pick on spec_decode.rng's STREAM_DRAFT. Returns the race winner."""
    best = tl.full((), -1.0, tl.float32)
    arg = tl.full((), 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs_v
        vmask = idx < V
        x = tl.load(qrow + idx, mask=vmask, other=NEG_INF)
        p = tl.exp(x - m) / s
        p = tl.where(sampled, p, tl.where(idx == am, 1.0, 0.0))
        tl.store(qrow + idx, p, mask=vmask)
        e = _rng.race_denominator(seed, pos, _rng.STREAM_DRAFT, idx)
        best, arg = _rng.race_chunk(p, vmask, e, idx, best, arg)
    return arg


@triton.jit
def markov_block_kernel(
    u_ptr,  # in [B, γ, Vd] backbone logits U (fp32/bf16/fp16), last stride 1
    anchor_ptr,  # in [B] int64/int32 x_0 (target id)
    w1_ptr,  # in [Vt, R] Markov embedding (markov_w1.weight), row-major
    w2_ptr,  # in [Vd, R] Markov projection (markov_w2.weight, nn.Linear layout), row-major
    d2t_ptr,  # in [Vd] int64/int32 draft id → target id (read when HAS_D2T)
    temp_ptr,  # in [B] fp32 (≤ 0 → argmax)
    seed_ptr,  # in [B] int64/int32
    pos_ptr,  # in [B] int64/int32 absolute position of d_1
    cbias_ptr,  # in [B, γ] fp32 confidence bias w_h·h_k + b (read when HAS_CONF)
    wconf_ptr,  # in [R] fp32 W1 half of the confidence weight (read when HAS_CONF)
    ctemp_ptr,  # in [γ] fp32 confidence temperatures (read when HAS_CONF)
    V,
    R,
    GAMMA,
    stride_ub,
    stride_uk,
    tok_ptr,  # out [B, γ] int64/int32 target ids
    q_ptr,  # out [B, γ, Vd] fp32 (scratch for x, then q)
    conf_ptr,  # out [B, γ] fp32 (written when HAS_CONF)
    HAS_D2T: tl.constexpr,
    HAS_CONF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    t_raw = tl.load(temp_ptr + b)
    sampled = t_raw > 0.0
    t = tl.where(sampled, t_raw, 1.0)
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    prev = tl.load(anchor_ptr + b).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    for i in range(0, GAMMA):
        z = tl.load(w1_ptr + prev * R + offs_r, mask=rmask, other=0.0).to(tl.float32)  # [BLOCK_R] W1[x_{k-1}]
        urow = u_ptr + b.to(tl.int64) * stride_ub + i * stride_uk
        qrow = q_ptr + (b.to(tl.int64) * GAMMA + i) * V
        m = tl.full((), NEG_INF, tl.float32)
        s = tl.full((), 0.0, tl.float32)
        am = tl.full((), BIG_IDX, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + offs_v
            vmask = idx < V
            w2 = tl.load(w2_ptr + idx[None, :] * R + offs_r[:, None], mask=rmask[:, None] & vmask[None, :],
                         other=0.0)  # [BLOCK_R, BLOCK_V] tile of W2ᵀ
            bias = tl.sum(z[:, None] * w2.to(tl.float32), axis=0)  # [BLOCK_V]
            bias = bias.to(w2_ptr.dtype.element_ty).to(tl.float32)  # F.linear rounds to the weight dtype
            x = (tl.load(urow + idx, mask=vmask, other=0.0).to(tl.float32) + bias) / t
            x = tl.where(vmask, x, NEG_INF)
            tl.store(qrow + idx, x, mask=vmask)
            tm = tl.max(x, axis=0)
            ti = tl.min(tl.where(x == tm, idx, BIG_IDX), axis=0)
            new_m = tl.maximum(m, tm)
            alpha = tl.where(m == NEG_INF, 0.0, tl.exp(m - new_m))
            s = s * alpha + tl.sum(tl.where(vmask, tl.exp(x - new_m), 0.0), axis=0)
            am = tl.where(tm > m, ti, am)
            m = new_m
        tl.debug_barrier()
        pos = pos0 + i
        arg = write_q_and_race(qrow, V, m, s, am, sampled, seed, pos, offs_v, BLOCK_V)
        tl.debug_barrier()
        tok = tl.where(sampled, arg, am).to(tl.int64)
        if HAS_D2T:
            tok = tl.load(d2t_ptr + tok).to(tl.int64)
        tl.store(tok_ptr + b.to(tl.int64) * GAMMA + i, tok)
        if HAS_CONF:
            wc = tl.load(wconf_ptr + offs_r, mask=rmask, other=0.0).to(tl.float32)
            cb = tl.load(cbias_ptr + b.to(tl.int64) * GAMMA + i)
            logit = (cb + tl.sum(z * wc, axis=0)) / tl.load(ctemp_ptr + i)
            tl.store(conf_ptr + b.to(tl.int64) * GAMMA + i, 1.0 / (1.0 + tl.exp(-logit)))
        prev = tok
