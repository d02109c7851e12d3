"""Building blocks of the DSpark drafter backbone: RMSNorm, rotary embeddings, and a decoder layer whose
attention keys/values are [Wk·ctx; Wk·h] (target context features, then the block's own hidden states).

Owns the attention arithmetic only; masks are built by the caller (dspark.py): a boolean mask
[B, Q, C+Q] where True = may attend. Without autograd on the CPU (inference: propose / extend_context) the
projections run on runtime.native's row-invariant kernels wherever `ops.choose_kernel` sends them (`native_product`;
q|k|v and up|gate fused, residual and SwiGLU in the epilogue) — the same math as the nn.Linear path training uses,
rounded by another kernel. Knows nothing about caches, slots or training.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.runtime import native, ops


def native_product(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, swiglu: bool = False,
                   out_f32: bool = False) -> torch.Tensor | None:
    """x [..., in] · wᵀ [..., out] on the native kernels (swiglu: first half · SiLU(second half); + residual; fp32
    output), or None where `ops.choose_kernel` answers torch (autograd recording, another device or dtype, not
    built) or w is not in x's dtype (the product is unscaled)."""
    kern = ops.choose_kernel(x, weight=w, autograd=True)
    if not kern.native or w.dtype != x.dtype:
        return None
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    r2 = None if residual is None else residual.reshape(x2.shape[0], -1).contiguous()
    y = native.linear(x2, w, kern.kind, residual=r2, swiglu=swiglu, out_f32=out_f32)
    return y.view(*x.shape[:-1], y.shape[-1])


def fused_weight(owner: nn.Module, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """cat(parts) along rows, cached on owner until one of the parts is replaced or modified in place."""
    key = tuple((t.data_ptr(), t._version) for t in parts)
    cache: dict = owner.__dict__.setdefault("_fused_weights", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        with torch.inference_mode(False):  # a normal tensor (it carries a version counter for the packing cache)
            hit = cache[name] = (key, torch.cat([t.detach() for t in parts], dim=0))
    return hit[1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """HF Llama numerics (fp32 statistics, rounded to x's dtype, then · weight, rounded): the native kernels'
        fused prologue computes the same."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [B, T] long → cos, sin [B, 1, T, head_dim] (HF Llama 'rotate_half' convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    ang = pos.float()[..., None] * inv  # [B, T, hd/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]  # [B, 1, T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] rotated by cos/sin [B, 1, T, hd]."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


class DSparkLayer(nn.Module):
    """Pre-norm Llama-style layer; attention over [context KV (from ctx features); block KV]."""

    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.input_layernorm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] → cos, sin [B, 1, T, hd] (callers running several layers compute them once)."""
        return rope_cos_sin(pos, self.head_dim, self.theta, dtype)

    def _plain(self) -> bool:
        """Every projection is a plain nn.Linear (a quantized or instrumented replacement — ModelOpt's QuantLinear
        during calibration, the build's quantized linears — runs its own forward, never the native kernels)."""
        mods = (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.up_proj, self.gate_proj, self.down_proj)
        return all(type(m) is nn.Linear for m in mods)

    def _np(self, x: torch.Tensor, w: torch.Tensor, **kw: object) -> torch.Tensor | None:
        """native_product, but only while every projection is plain (`_plain`)."""
        return native_product(x, w, **kw) if self._plain() else None  # type: ignore[arg-type]

    def _kv(self, x: torch.Tensor, pos: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d], pos [B, T] → k, v [B, Hkv, T, hd] (k rotated)."""
        B, T, _ = x.shape
        cos, sin = rope if rope is not None else self.rope(pos, x.dtype)
        kv = self._np(x, fused_weight(self, "kv", [self.k_proj.weight, self.v_proj.weight]))  # [B, T, 2·Hkv·hd]
        if kv is not None:
            k, v = kv.view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
            return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, C, d] (already fc+RMSNorm'd target features), pos [B, C] → k, v [B, Hkv, C, hd]."""
        return self._kv(ctx, pos, rope)

    def _attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                v_blk: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, Q, hd] over keys [context; block] ([B, Hkv, C+Q, hd]) → [B, H, Q, hd]."""
        k = torch.cat([k_ctx.to(q.dtype), k_blk], dim=2)  # [B, Hkv, C+Q, hd]
        v = torch.cat([v_ctx.to(q.dtype), v_blk], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1 and torch.is_grad_enabled():  # training: the repeated heads autograd has always used
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # inference: grouped-query SDPA reads each KV head in place (the same bits, no [B, H, C+Q, hd] copies)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                              enable_gqa=k.shape[1] != q.shape[1])

    def native_ready(self) -> bool:
        """Whether forward_native applies: plain nn.Linear projections and a head_dim the native attention takes."""
        return self._plain() and self.head_dim in (16, 32, 64, 128, 256)

    def forward_native(self, h: torch.Tensor, pos: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                       slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
        """Inference on the native kernels, one call per step: h [B·Q, d] block states (rows of B blocks of Q),
        pos [B·Q] long, ck / cv [S, Hkv, max_seq, hd] this layer's context KV, slots / starts / lengths [B] (starts =
        context length, lengths = Q), cos / sin [P, hd] → [B·Q, d]. The block's k, v are written past the context
        (positions starts..starts+Q−1: scratch the next context extension overwrites); each query sees its row's
        context and the whole block, in an attention of its own row (batch-invariant). RMSNorms fused into the
        products that read them."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv = native.linear(h, fused_weight(self, "qkv", [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                            norm=ln1.weight, eps=ln1.eps)  # [B·Q, (H + 2·Hkv)·hd]
        q = native.rope_kv(qkv, cos, sin, pos, ck, cv, slots, self.heads, self.kv_heads)  # [B·Q, H·hd]
        o = native.attend(q, ck, cv, slots, starts, lengths, self.heads, None, self.head_dim ** -0.5,
                          bidirectional=True)  # [B·Q, H·hd]
        h = native.linear(o, self.o_proj.weight, residual=h)
        a = native.linear(h, fused_weight(self, "up_gate", [self.up_proj.weight, self.gate_proj.weight]),
                          norm=ln2.weight, eps=ln2.eps, swiglu=True)  # [B·Q, inter]
        return native.linear(a, self.down_proj.weight, residual=h)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                mask: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                ctx_lens: Sequence[int] | None = None) -> torch.Tensor:
        """h [B, Q, d] block states, pos [B, Q], k_ctx/v_ctx [B, Hkv, C, hd], mask [B, Q, C+Q] bool (None: every
        key visible) → [B, Q, d]. ctx_lens (inference, instead of a mask): row b sees its first ctx_lens[b] context
        keys and the whole block, in an attention call of its own, so its bits never depend on the other rows."""
        B, Q, _ = h.shape
        x = self.input_layernorm(h)
        cos, sin = rope if rope is not None else self.rope(pos, x.dtype)
        qkv = self._np(x, fused_weight(self, "qkv", [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        if qkv is not None:  # [B, Q, (H + 2·Hkv)·hd]
            nq = self.heads * self.head_dim
            q = qkv[..., :nq].reshape(B, Q, self.heads, self.head_dim).transpose(1, 2)  # [B, H, Q, hd]
            k_blk, v_blk = qkv[..., nq:].reshape(B, Q, 2, self.kv_heads, self.head_dim).unbind(2)
            k_blk, v_blk = apply_rope(k_blk.transpose(1, 2), cos, sin), v_blk.transpose(1, 2)  # [B, Hkv, Q, hd]
        else:
            q = self.q_proj(x).view(B, Q, self.heads, self.head_dim).transpose(1, 2)  # [B, H, Q, hd]
            k_blk, v_blk = self._kv(x, pos, (cos, sin))  # [B, Hkv, Q, hd]
        q = apply_rope(q, cos, sin)
        if ctx_lens is not None:
            attn = torch.cat([self._attend(q[r:r + 1], k_ctx[r:r + 1, :, :n], v_ctx[r:r + 1, :, :n], k_blk[r:r + 1],
                                           v_blk[r:r + 1], None) for r, n in enumerate(ctx_lens)])  # [B, H, Q, hd]
        else:
            attn = self._attend(q, k_ctx, v_ctx, k_blk, v_blk, mask)
        o = attn.transpose(1, 2).reshape(B, Q, -1)  # [B, Q, H·hd]
        fast = self._np(o, self.o_proj.weight, residual=h)
        if fast is None:
            h = h + self.o_proj(o)
            x = self.post_attention_layernorm(h)
            return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        h = fast
        x = self.post_attention_layernorm(h)
        a = self._np(x, fused_weight(self, "up_gate", [self.up_proj.weight, self.gate_proj.weight]), swiglu=True)
        return self._np(a, self.down_proj.weight, residual=h)
