"""Building blocks of the DSpark drafter backbone: RMSNorm, rotary embeddings, and a decoder layer whose
attention keys/values are [Wk·ctx; Wk·h] (target context features, then the block's own hidden states).

Owns the attention arithmetic only; masks are built by the caller (dspark.py): a boolean mask
[B, Q, C+Q] where True = may attend. Knows nothing about caches, slots or training.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


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

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d], pos [B, T] → k, v [B, Hkv, T, hd] (k rotated)."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.theta, k.dtype)
        return apply_rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, C, d] (already fc+RMSNorm'd target features), pos [B, C] → k, v [B, Hkv, C, hd]."""
        return self._kv(ctx, pos)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """h [B, Q, d] block states, pos [B, Q], k_ctx/v_ctx [B, Hkv, C, hd], mask [B, Q, C+Q] bool → [B, Q, d]."""
        B, Q, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(B, Q, self.heads, self.head_dim).transpose(1, 2)  # [B, H, Q, hd]
        cos, sin = rope_cos_sin(pos, self.head_dim, self.theta, q.dtype)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self._kv(x, pos)  # [B, Hkv, Q, hd]
        k = torch.cat([k_ctx.to(q.dtype), k_blk], dim=2)  # [B, Hkv, C+Q, hd]
        v = torch.cat([v_ctx.to(q.dtype), v_blk], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, H, Q, hd]
        h = h + self.o_proj(attn.transpose(1, 2).reshape(B, Q, -1))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
