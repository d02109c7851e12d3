"""Batched, vocabulary-split variant of the Markov block for large batches × large Vd·r (CUDA runtime path).

The one-launch kernel (kernel.py) gives each request its own program, so every request streams all of W2 at
every step (B × Vd × r reads per step). Here each step is two launches:
  A. `markov_tile_kernel`, grid (cdiv(Vd, BLOCK_V), cdiv(B, BLOCK_B)): W2 tile read once for BLOCK_B requests,
     bias = W1[x_{k-1}] · W2ᵀ by tl.dot (rounded to the weight dtype like F.linear), x = (U_k + bias) / T written
     to the q row, per (request, tile) partial (max, lowest argmax, Σexp).
  B. `markov_pick_kernel`, grid (B,): merge the tile partials, one pass over the row to normalise q and run the
     STREAM_DRAFT exponential race (sampled rows), write the token (through d2t), the next x_{k-1} and c_k.
Semantics are dspark_trt/kernels/block_draft/reference.py, like kernel.py (top_p = 1). Not a TensorRT plugin (the engine
path uses the one-launch kernel). Owns these two kernels and their launcher.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_trt.kernels import _rng
from dspark_trt.kernels.block_draft.kernel import write_q_and_race
from dspark_trt.kernels.block_draft.reference import MarkovBlock, check_shapes, empty_block

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
BIG_IDX: tl.constexpr = tl.constexpr(2147483647)
BLOCK_B = 16  # requests per tile program (tl.dot needs ≥ 16)
BLOCK_V_TILE = 64
PICK_BLOCK_V = 1024


@triton.jit
def markov_tile_kernel(
    u_ptr,  # in [B, γ, Vd] backbone logits
    prev_ptr,  # in [B] int64 x_{k-1} (target ids)
    w1_ptr,  # in [Vt, R]
    w2_ptr,  # in [Vd, R]
    temp_ptr,  # in [B] fp32
    B,
    V,
    R,
    GAMMA,
    NT,
    step,
    stride_ub,
    stride_uk,
    q_ptr,  # out [B, γ, Vd] fp32 (x of this step)
    part_f_ptr,  # out [B, NT, 2] fp32 (max x, Σ exp(x − max))
    part_i_ptr,  # out [B, NT] int32 lowest argmax
    IEEE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_v = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = rows < B
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = cols < V
    prev = tl.load(prev_ptr + rows, mask=bmask, other=0).to(tl.int64)
    z = tl.load(w1_ptr + prev[:, None] * R + offs_r[None, :], mask=bmask[:, None] & rmask[None, :],
                other=0.0)  # [BLOCK_B, BLOCK_R]
    w2t = tl.load(w2_ptr + cols[None, :] * R + offs_r[:, None], mask=rmask[:, None] & vmask[None, :],
                  other=0.0)  # [BLOCK_R, BLOCK_V]
    if IEEE:  # fp32 weights (and the CPU interpreter, whose bf16 tl.dot is wrong): exact fp32 products
        bias = tl.dot(z.to(tl.float32), w2t.to(tl.float32), input_precision="ieee")
    else:  # bf16/fp16 weights on GPU: tensor cores, products exact in fp32, fp32 accumulation
        bias = tl.dot(z, w2t)
    bias = bias.to(w2_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_B, BLOCK_V], F.linear rounding
    t = tl.load(temp_ptr + rows, mask=bmask, other=1.0)
    t = tl.where(t > 0.0, t, 1.0)
    m2d = bmask[:, None] & vmask[None, :]
    u = tl.load(u_ptr + rows[:, None].to(tl.int64) * stride_ub + step * stride_uk + cols[None, :], mask=m2d,
                other=0.0).to(tl.float32)
    x = tl.where(m2d, (u + bias) / t[:, None], NEG_INF)  # [BLOCK_B, BLOCK_V]
    tl.store(q_ptr + (rows[:, None].to(tl.int64) * GAMMA + step) * V + cols[None, :], x, mask=m2d)
    m = tl.max(x, axis=1)  # [BLOCK_B]
    am = tl.min(tl.where(x == m[:, None], cols[None, :], BIG_IDX), axis=1)
    se = tl.sum(tl.where(m2d, tl.exp(x - m[:, None]), 0.0), axis=1)
    out = rows.to(tl.int64) * NT + pid_v
    tl.store(part_f_ptr + out * 2 + 0, m, mask=bmask)
    tl.store(part_f_ptr + out * 2 + 1, se, mask=bmask)
    tl.store(part_i_ptr + out, am, mask=bmask)


@triton.jit
def markov_pick_kernel(
    part_f_ptr,  # in [B, NT, 2]
    part_i_ptr,  # in [B, NT]
    w1_ptr,  # in [Vt, R]
    d2t_ptr,  # in [Vd] (HAS_D2T)
    temp_ptr,  # in [B]
    seed_ptr,  # in [B]
    pos_ptr,  # in [B] absolute position of d_1
    cbias_ptr,  # in [B, γ] (HAS_CONF)
    wconf_ptr,  # in [R] (HAS_CONF)
    ctemp_ptr,  # in [γ] (HAS_CONF)
    V,
    R,
    GAMMA,
    NT,
    step,
    q_ptr,  # in/out [B, γ, Vd]: x → q
    prev_ptr,  # in/out [B] int64: x_{k-1} → x_k
    tok_ptr,  # out [B, γ] int64
    conf_ptr,  # out [B, γ] fp32 (HAS_CONF)
    HAS_D2T: tl.constexpr,
    HAS_CONF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    to = tl.arange(0, BLOCK_T)
    tmask = to < NT
    base = b.to(tl.int64) * NT + to
    pm = tl.load(part_f_ptr + base * 2 + 0, mask=tmask, other=NEG_INF)
    ps = tl.load(part_f_ptr + base * 2 + 1, mask=tmask, other=0.0)
    pi = tl.load(part_i_ptr + base, mask=tmask, other=BIG_IDX)
    m = tl.max(pm, axis=0)
    am = tl.min(tl.where(pm == m, pi, BIG_IDX), axis=0)
    s = tl.sum(tl.where(pm == NEG_INF, 0.0, ps * tl.exp(pm - m)), axis=0)
    t_raw = tl.load(temp_ptr + b)
    sampled = t_raw > 0.0
    seed = tl.load(seed_ptr + b)
    pos = tl.load(pos_ptr + b) + step
    qrow = q_ptr + (b.to(tl.int64) * GAMMA + step) * V
    offs = tl.arange(0, BLOCK_V)
    arg = write_q_and_race(qrow, V, m, s, am, sampled, seed, pos, offs, BLOCK_V)
    tok = tl.where(sampled, arg, am).to(tl.int64)
    if HAS_D2T:
        tok = tl.load(d2t_ptr + tok).to(tl.int64)
    tl.store(tok_ptr + b.to(tl.int64) * GAMMA + step, tok)
    if HAS_CONF:
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        prev = tl.load(prev_ptr + b).to(tl.int64)
        z = tl.load(w1_ptr + prev * R + offs_r, mask=rmask, other=0.0).to(tl.float32)
        wc = tl.load(wconf_ptr + offs_r, mask=rmask, other=0.0)
        logit = (tl.load(cbias_ptr + b.to(tl.int64) * GAMMA + step) + tl.sum(z * wc, axis=0)) / tl.load(
            ctemp_ptr + step)
        tl.store(conf_ptr + b.to(tl.int64) * GAMMA + step, 1.0 / (1.0 + tl.exp(-logit)))
    tl.store(prev_ptr + b, tok)


def markov_block_split(
    backbone_logits: torch.Tensor,  # [B, γ, Vd]
    anchor: torch.Tensor,  # [B] long
    w1: torch.Tensor,  # [Vt, r]
    w2: torch.Tensor,  # [Vd, r]
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64
    d2t: torch.Tensor | None = None,  # [Vd]
    conf_bias: torch.Tensor | None = None,  # [B, γ]
    w_conf: torch.Tensor | None = None,  # [r]
    conf_temp: torch.Tensor | None = None,  # [γ]
) -> MarkovBlock:
    """γ steps × 2 launches → MarkovBlock; same contract as launch.markov_block (r ≥ 1, top_p = 1)."""
    b, gamma, vd, r = check_shapes(backbone_logits, w1, w2)
    dev = backbone_logits.device
    u = backbone_logits if backbone_logits.stride(-1) == 1 else backbone_logits.contiguous()
    w1, w2 = w1.contiguous(), w2.to(w1.dtype).contiguous()
    has_conf = conf_bias is not None and w_conf is not None
    out = empty_block(b, gamma, vd, dev, has_conf)
    tokens, q, conf = out.tokens, out.q, out.conf
    if b == 0 or gamma == 0:
        return out
    f32 = dict(device=dev, dtype=torch.float32)
    temp = temperature.to(**f32).expand(b).contiguous()
    seeds = (seeds.to(device=dev, dtype=torch.int64).expand(b) & 0xFFFFFFFF).contiguous()
    pos = positions.to(device=dev, dtype=torch.int64).expand(b).contiguous()
    prev = anchor.to(device=dev, dtype=torch.int64).clone()  # [B] running x_{k-1}
    cb = conf_bias.to(**f32).contiguous() if has_conf else q
    wc = w_conf.to(**f32).contiguous() if has_conf else q
    ct = (torch.ones(gamma, **f32) if conf_temp is None else conf_temp.to(**f32).contiguous()) if has_conf else q
    d2t_arg = d2t.to(device=dev, dtype=torch.int64).contiguous() if d2t is not None else tokens
    block_r = max(16, triton.next_power_of_2(r))
    nt = triton.cdiv(vd, BLOCK_V_TILE)
    part_f = torch.empty(b, nt, 2, **f32)
    part_i = torch.empty(b, nt, dtype=torch.int32, device=dev)
    grid_a = (nt, triton.cdiv(b, BLOCK_B))
    for i in range(gamma):
        markov_tile_kernel[grid_a](
            u, prev, w1, w2, temp, b, vd, r, gamma, nt, i, u.stride(0), u.stride(1), q, part_f, part_i,
            IEEE=w1.dtype == torch.float32 or not u.is_cuda, BLOCK_B=BLOCK_B, BLOCK_R=block_r,
            BLOCK_V=BLOCK_V_TILE, num_warps=4)
        markov_pick_kernel[(b,)](
            part_f, part_i, w1, d2t_arg, temp, seeds, pos, cb, wc, ct, vd, r, gamma, nt, i, q, prev, tokens,
            conf if has_conf else q, HAS_D2T=d2t is not None, HAS_CONF=has_conf,
            BLOCK_T=triton.next_power_of_2(nt), BLOCK_R=block_r, BLOCK_V=PICK_BLOCK_V, num_warps=4)
    return MarkovBlock(tokens, q, conf)


def compile_split(rank: int = 256, u_dtype: str = "fp32", w_dtype: str = "bf16", arch: int = 90) -> tuple[str, str]:
    """AOT-compile both split kernels for sm_`arch` (a CI check that they build for the GPU); → entry names."""
    from dspark_trt.kernels.aot import compile_kernel

    block_r = max(16, triton.next_power_of_2(rank))
    i32 = "i32"
    tile_sig = {"u_ptr": f"*{u_dtype}", "prev_ptr": "*i64", "w1_ptr": f"*{w_dtype}", "w2_ptr": f"*{w_dtype}",
                "temp_ptr": "*fp32", "B": i32, "V": i32, "R": i32, "GAMMA": i32, "NT": i32, "step": i32,
                "stride_ub": i32, "stride_uk": i32, "q_ptr": "*fp32", "part_f_ptr": "*fp32", "part_i_ptr": "*i32",
                "IEEE": "constexpr", "BLOCK_B": "constexpr", "BLOCK_R": "constexpr", "BLOCK_V": "constexpr"}
    a = compile_kernel(markov_tile_kernel, tile_sig, {"IEEE": w_dtype == "fp32", "BLOCK_B": BLOCK_B,
                                                      "BLOCK_R": block_r, "BLOCK_V": BLOCK_V_TILE}, 4, arch)
    pick_sig = {"part_f_ptr": "*fp32", "part_i_ptr": "*i32", "w1_ptr": f"*{w_dtype}", "d2t_ptr": "*i64",
                "temp_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64", "cbias_ptr": "*fp32",
                "wconf_ptr": "*fp32", "ctemp_ptr": "*fp32", "V": i32, "R": i32, "GAMMA": i32, "NT": i32,
                "step": i32, "q_ptr": "*fp32", "prev_ptr": "*i64", "tok_ptr": "*i64", "conf_ptr": "*fp32",
                "HAS_D2T": "constexpr", "HAS_CONF": "constexpr", "BLOCK_T": "constexpr", "BLOCK_R": "constexpr",
                "BLOCK_V": "constexpr"}
    b = compile_kernel(markov_pick_kernel, pick_sig, {"HAS_D2T": True, "HAS_CONF": True, "BLOCK_T": 1024,
                                                      "BLOCK_R": block_r, "BLOCK_V": PICK_BLOCK_V}, 4, arch)
    return a.name, b.name
