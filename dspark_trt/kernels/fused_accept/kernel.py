"""OpenAI Triton kernels of the fused acceptance step (one read of the target logits).

Owns two kernels, the launch order and the partial-statistics layout between them:

1. `accept_stats_kernel`, grid (B*(K+1), S): program (row, s) streams V-chunk s of one logits row in BLOCK_V
   tiles with a lane-wise online softmax (one exp per element, one reduction per program) and writes a partial
   (max x, lowest argmax, second max x, Σ exp(x − max)) where x = logits / T (T = 1 for greedy rows).
   Splitting V over S programs keeps small batches bandwidth-bound.
2. `accept_finalize_kernel`, grid (B,): merges the S partials of each position (top-1 probability, top-1 − top-2
   margin, argmax), runs the acceptance chain (greedy: d_j == argmax; sampled: u·q(d) < p(d)), and for sampled rows
   draws the committed token by the exponential race of spec_decode.accept over the one committed row (residual
   max(0, p − q) at a rejection, p for the bonus). Greedy rows never re-read logits.

Semantics are spec_decode.accept.greedy_accept / sample_accept (top_p = 1; the launcher routes top-p < 1 elsewhere).
Knows nothing of torch. Parameter order follows the TensorRT QDP AOT ABI: input pointers, then int32 scalars,
then output pointers, then constexprs (dspark_trt/kernels/fused_accept/trt.py compiles these very functions).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_trt.kernels import _rng

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
BIG_IDX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def accept_stats_kernel(
    logits_ptr,  # in [B, K+1, V] fp32/bf16/fp16, row-major with stride_lb, stride_lk, 1
    k_ptr,  # in [B] int64/int32 verify lengths
    temp_ptr,  # in [B] fp32 temperature (≤ 0 → greedy → T = 1)
    V,
    KP1,
    S,
    chunk,  # V elements per split (multiple of BLOCK_V)
    stride_lb,
    stride_lk,
    part_f_ptr,  # out [B*(K+1), S, 3] fp32: (max x, second max x, Σ exp(x − max))
    part_i_ptr,  # out [B*(K+1), S] int32: lowest argmax index
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // KP1
    j = row % KP1
    kb = tl.load(k_ptr + b).to(tl.int32)
    out = row.to(tl.int64) * S + split
    if j > kb:  # ignored position: a neutral partial (p = one-hot at index 0), no logits read
        tl.store(part_f_ptr + out * 3 + 0, 0.0)
        tl.store(part_f_ptr + out * 3 + 1, NEG_INF)
        tl.store(part_f_ptr + out * 3 + 2, tl.where(split == 0, 1.0, 0.0))
        tl.store(part_i_ptr + out, tl.where(split == 0, 0, BIG_IDX))
    else:
        t = tl.load(temp_ptr + b)
        t = tl.where(t > 0.0, t, 1.0)
        base = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_lk
        offs = tl.arange(0, BLOCK_V)
        # lane-wise running state: no cross-thread reduction inside the loop (one at the end)
        m_l = tl.full((BLOCK_V,), NEG_INF, tl.float32)  # max of lane
        m2_l = tl.full((BLOCK_V,), NEG_INF, tl.float32)  # second max of lane (duplicates count)
        s_l = tl.zeros((BLOCK_V,), tl.float32)  # Σ exp(x − m_l) of lane
        i_l = tl.full((BLOCK_V,), BIG_IDX, tl.int32)  # lowest index of m_l in lane
        start = split * chunk
        stop = tl.minimum(start + chunk, V)
        for v0 in range(start, stop, BLOCK_V):
            idx = v0 + offs
            x = tl.load(base + idx, mask=idx < stop, other=NEG_INF).to(tl.float32) / t  # [BLOCK_V]
            up = x > m_l
            e = tl.where(x == NEG_INF, 0.0, tl.exp(-tl.abs(x - m_l)))  # exp(m_l − x) if up else exp(x − m_l)
            s_l = tl.where(up, s_l * e + 1.0, s_l + e)
            m2_l = tl.where(up, m_l, tl.maximum(m2_l, x))
            i_l = tl.where(up, idx, i_l)
            m_l = tl.maximum(m_l, x)
        m1 = tl.max(m_l, axis=0)
        i1 = tl.min(tl.where(m_l == m1, i_l, BIG_IDX), axis=0)
        others = tl.where(i_l == i1, NEG_INF, m_l)  # another lane holding m1 is a duplicate top-1
        m2 = tl.maximum(tl.max(others, axis=0), tl.max(m2_l, axis=0))
        se = tl.sum(tl.where(m_l == NEG_INF, 0.0, s_l * tl.exp(m_l - m1)), axis=0)
        tl.store(part_f_ptr + out * 3 + 0, m1)
        tl.store(part_f_ptr + out * 3 + 1, m2)
        tl.store(part_f_ptr + out * 3 + 2, se)
        tl.store(part_i_ptr + out, i1)


@triton.jit
def _merge_partials(part_f_ptr, part_i_ptr, row, S, BLOCK_S: tl.constexpr):
    """Merge the S partials of one row → (max x, argmax, second max x, Σ exp(x − max))."""
    so = tl.arange(0, BLOCK_S)
    sm = so < S
    base = row.to(tl.int64) * S + so
    pm1 = tl.load(part_f_ptr + base * 3 + 0, mask=sm, other=NEG_INF)  # [BLOCK_S]
    pm2 = tl.load(part_f_ptr + base * 3 + 1, mask=sm, other=NEG_INF)
    pse = tl.load(part_f_ptr + base * 3 + 2, mask=sm, other=0.0)
    pi = tl.load(part_i_ptr + base, mask=sm, other=BIG_IDX)
    m = tl.max(pm1, axis=0)
    idx = tl.min(tl.where(pm1 == m, pi, BIG_IDX), axis=0)
    others = tl.where(pi == idx, NEG_INF, pm1)  # another split's max equal to m is a duplicate top-1
    second = tl.maximum(tl.max(others, axis=0), tl.max(pm2, axis=0))
    w = tl.where(pm1 == NEG_INF, 0.0, tl.exp(pm1 - m))
    s = tl.sum(pse * w, axis=0)
    return m, idx, second, s


@triton.jit
def accept_finalize_kernel(
    logits_ptr,  # in [B, K+1, V]
    draft_ptr,  # in [B, K] int64/int32
    q_ptr,  # in [B, K, V] fp32 draft distributions (never read when HAS_Q is False)
    k_ptr,  # in [B] int64/int32
    temp_ptr,  # in [B] fp32
    seed_ptr,  # in [B] int64/int32 (low 32 bits used)
    pos_ptr,  # in [B] int64/int32 absolute position of d_1
    part_f_ptr,  # in [B*(K+1), S, 3] fp32 (from accept_stats_kernel)
    part_i_ptr,  # in [B*(K+1), S] int32
    V,
    KP1,
    S,
    stride_lb,
    stride_lk,
    stride_db,
    stride_qb,
    stride_qk,
    accepted_ptr,  # out [B] int64/int32
    next_ptr,  # out [B] int64/int32
    top1_ptr,  # out [B, K+1] fp32
    margin_ptr,  # out [B, K+1] fp32
    HAS_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    kb = tl.load(k_ptr + b).to(tl.int32)
    t_raw = tl.load(temp_ptr + b)
    sampled = t_raw > 0.0
    t = tl.where(sampled, t_raw, 1.0)
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    lrow = logits_ptr + b.to(tl.int64) * stride_lb
    accepted = kb * 0
    alive = kb >= 0  # still inside the accepted prefix
    m_c = tl.full((), 0.0, tl.float32)  # (max, Σexp, argmax) of the committed position
    s_c = tl.full((), 1.0, tl.float32)
    i_c = kb * 0
    for j in range(0, KP1):
        valid = j <= kb
        row = b * KP1 + j
        m, idx, second, s = _merge_partials(part_f_ptr, part_i_ptr, row, S, BLOCK_S)
        top1 = 1.0 / s
        top2 = tl.exp(second - m) / s
        tl.store(top1_ptr + row, tl.where(valid, top1, 0.0))
        tl.store(margin_ptr + row, tl.where(valid, top1 - top2, 0.0))
        here = alive & valid  # position j is the committed one unless d_{j+1} is accepted
        m_c = tl.where(here, m, m_c)
        s_c = tl.where(here, s, s_c)
        i_c = tl.where(here, idx, i_c)
        if j < kb:
            d = tl.load(draft_ptr + b.to(tl.int64) * stride_db + j)
            ok = d == idx.to(tl.int64)
            if HAS_Q:
                if sampled:
                    x_d = tl.load(lrow + j * stride_lk + d).to(tl.float32) / t
                    p_d = tl.exp(x_d - m) / s
                    q_d = tl.load(q_ptr + b.to(tl.int64) * stride_qb + j * stride_qk + d)
                    u = _rng.uniform(seed, pos0 + j, _rng.STREAM_ACCEPT, kb * 0)
                    ok = u * q_d < p_d
            accepted = tl.where(alive & ok, accepted + 1, accepted)
            alive = alive & ok
    tl.store(accepted_ptr + b, accepted.to(tl.int64))
    next_tok = i_c.to(tl.int64)
    if HAS_Q:
        if sampled:
            rejected = accepted < kb
            pos = pos0 + accepted
            xrow = lrow + accepted.to(tl.int64) * stride_lk
            qrow = q_ptr + b.to(tl.int64) * stride_qb + accepted.to(tl.int64) * stride_qk
            offs = tl.arange(0, BLOCK_V)
            best_r = tl.full((), -1.0, tl.float32)  # residual race (max score, lowest index)
            arg_r = tl.full((), 0, tl.int32)
            best_p = tl.full((), -1.0, tl.float32)  # plain-p race (bonus, or empty residual)
            arg_p = tl.full((), 0, tl.int32)
            any_pos = tl.full((), 0, tl.int32)
            for v0 in range(0, V, BLOCK_V):
                idx = v0 + offs
                mask = idx < V
                x = tl.load(xrow + idx, mask=mask, other=NEG_INF).to(tl.float32) / t
                p = tl.exp(x - m_c) / s_c  # [BLOCK_V] serving distribution at the committed position
                e = _rng.race_denominator(seed, pos, _rng.STREAM_RESAMPLE, idx)
                best_p, arg_p = _rng.race_chunk(p, mask, e, idx, best_p, arg_p)
                if rejected:
                    qv = tl.load(qrow + idx, mask=mask, other=0.0).to(tl.float32)
                    r = tl.maximum(p - qv, 0.0)
                    any_pos = tl.maximum(any_pos, tl.max(tl.where(mask & (r > 0.0), 1, 0), axis=0))
                    best_r, arg_r = _rng.race_chunk(r, mask, e, idx, best_r, arg_r)
            use_r = rejected & (any_pos > 0)
            next_tok = tl.where(use_r, arg_r, arg_p).to(tl.int64)
    tl.store(next_ptr + b, next_tok)
