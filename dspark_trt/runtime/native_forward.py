"""A decoder's forward on the native kernels (runtime.native): decode, verify and prefill in one code path.

Owns: `NativePlan` — every projection of a decoder bound once to its packed weight and fixed kernel arguments (so a
step makes one C++ call per projection and no per-call Python dispatch), with the attention geometry it runs, and
`valid()` telling its owner when a tensor it was built from has changed — and `forward_native`, the layer loop:
fused RMSNorm + qkv product, RoPE + KV write, per-query attention, dense product + residual, fused RMSNorm +
gate|up product + SwiGLU, down product + residual, taps, final norm + lm_head in fp32. A row's numbers depend on
nothing but that row (docs/runtime.md, "Batch invariance"). Knows nothing about the model class, scheduling,
drafters or files: runtime.model.CausalLM builds, holds and drops its plan and decides when this path runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.runtime import native, ops
from dspark_trt.runtime.kv_cache import KVCache
from dspark_trt.runtime.layers import ModelOutput, rms_norm


class _Lin:
    """One projection: its packed weight and the fixed arguments of native.linear, or (for modules the native
    kernels do not cover, e.g. FP8) the module's own forward with the same epilogues in torch."""

    __slots__ = ("module", "args", "sq", "eps")

    def __init__(self, module: nn.Module, x_dtype: torch.dtype, swiglu: bool, eps: float) -> None:
        self.module, self.eps = module, eps
        spec_fn = getattr(module, "native_spec", None)
        spec = spec_fn(x_dtype) if spec_fn is not None else None
        self.args: tuple[Any, ...] | None = None
        self.sq: tuple[torch.Tensor | None, float] = (None, 0.0)
        if spec is None:
            return
        w, sq = spec["w"], spec.get("sq")
        kern = ops.choose_kernel(x_dtype, weight=w, sq=sq is not None)
        if not kern.native:
            return
        packed, rowsum = native.packed(w, kern.kind, swiglu)
        self.args = (packed, rowsum, kern.kind, w.shape[0], swiglu, spec.get("scale"), spec.get("bias"),
                     bool(spec.get("bias_f32", False)))
        if sq is not None:
            self.sq = (sq[0], float(sq[1]))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: torch.Tensor | None = None,
                 out_f32: bool = False) -> torch.Tensor:  # x [M, in] → [M, out]
        if self.args is not None:
            return native.ext().linear(x, *self.args, residual, norm, self.eps, self.sq[0], self.sq[1], out_f32)
        h = rms_norm(x, norm, self.eps) if norm is not None else x
        return self._epilogue(self.module(h), residual, out_f32)

    def _epilogue(self, y: torch.Tensor, residual: torch.Tensor | None, out_f32: bool) -> torch.Tensor:
        if residual is not None:
            y = residual + y
        return y.float() if out_f32 else y


class _SwiGLULin(_Lin):
    """The fused gate|up projection: SiLU of the second half times the first half (fused in the kernel)."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: torch.Tensor | None = None,
                 out_f32: bool = False) -> torch.Tensor:
        if self.args is not None:
            return super().__call__(x, residual, norm, out_f32)
        h = rms_norm(x, norm, self.eps) if norm is not None else x
        y = self.module(h)  # [M, 2I]
        half = y.shape[-1] // 2
        return self._epilogue(y[:, :half] * F.silu(y[:, half:]), residual, out_f32)


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's tensors and projection modules, as its owner holds them."""

    input_norm: torch.Tensor  # [d]
    qkv: nn.Module  # [d] → [(H + 2·Hkv)·D]
    dense: nn.Module  # [H·D] → [d]
    post_norm: torch.Tensor  # [d]
    gate_up: nn.Module  # [d] → [2I]: up | SiLU input
    down: nn.Module  # [I] → [d]


@dataclass(frozen=True)
class Geometry:
    """What the layer loop needs besides the weights."""

    heads: int
    kv_heads: int
    scale: float  # attention scale, head_dim^-0.5
    window: int  # sliding window, 0 = none
    eps: float  # RMSNorm epsilon


class NativePlan:
    """Every projection of a decoder bound to the native kernels for activations of `dtype`, valid while none of
    `tensors` (all the owner's parameters and buffers) changes."""

    def __init__(self, layers: Sequence[LayerParts], final_norm: torch.Tensor, head: nn.Module, geometry: Geometry,
                 dtype: torch.dtype, tensors: Iterable[torch.Tensor]) -> None:
        eps = geometry.eps
        self.geometry = geometry
        self.layers = [(p.input_norm, _Lin(p.qkv, dtype, False, eps), _Lin(p.dense, dtype, False, eps), p.post_norm,
                        _SwiGLULin(p.gate_up, dtype, True, eps), _Lin(p.down, dtype, False, eps)) for p in layers]
        self.head = _Lin(head, dtype, False, eps)
        self.ln_f = final_norm
        self._tensors = list({id(t): t for t in tensors}.values())
        self._stamp = self.stamp()

    def stamp(self) -> int:
        """Sum of the tensors' in-place version counters (changes when any of them is modified)."""
        return sum(t._version for t in self._tensors)

    def valid(self) -> bool:
        return self.stamp() == self._stamp


def _unpack(y: torch.Tensor, real: torch.Tensor | None, pad: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Packed rows y [M', ...] → [rows, ...]: y at `real`, zeros at `pad` (real None: y as it is)."""
    if real is None or pad is None:
        return y
    out = y.new_empty((rows,) + tuple(y.shape[1:]))
    return out.index_copy_(0, real, y).index_fill_(0, pad, 0)


def forward_native(plan: NativePlan, x: torch.Tensor, cache: KVCache, slots: torch.Tensor, start: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], taps: Sequence[int], logits: str,
                   last_index: torch.Tensor | None, lengths: list[int]) -> ModelOutput:
    """The decoder's forward (CausalLM.forward's contract) on the native kernels: x [B·T, d] the embedded tokens of
    B right-padded rows, slots [B], start [B] each slot's length before this step (cache.check_room), rope the
    cos / sin tables [≥ max(start) + T, D], lengths [B] real tokens per row.

    Ragged rows (a verify whose rows check different K, a prefill of prompts of different lengths) are packed: the
    products, RoPE, the KV writes and the attention run on the M' = Σ lengths real tokens only (rope_kv on one-token
    rows: each token its own slot and position; attention with each row's offset into the packed queries). Every
    real row's numbers are those of the padded pass (row-invariant products, the same per-query attention);
    padding rows come back as zeros (taps, logits) and write nothing to the cache."""
    ext = native.ext()
    g = plan.geometry
    B = slots.numel()
    T = x.shape[0] // B
    pos = (start[:, None] + torch.arange(T)).reshape(-1)  # [B·T]
    cos, sin = rope
    lens = torch.tensor(lengths, dtype=torch.long)  # [B]
    real = pad = offsets = None  # [M'] rows of the padded layout that hold real tokens, and the others (None: no
    # padding); offsets [B]: each row's first row among the packed ones (attention's packed layout)
    rp_pos, rp_slots = pos, slots
    if B > 1 and min(lengths) < T:
        is_real = (torch.arange(T)[None, :] < lens[:, None]).reshape(-1)  # [B·T]
        real, pad = is_real.nonzero().squeeze(1), (~is_real).nonzero().squeeze(1)  # [M'], [B·T − M']
        x, rp_pos, rp_slots = x.index_select(0, real), pos.index_select(0, real), slots.repeat_interleave(lens)
        offsets = torch.cumsum(lens, 0) - lens  # [B]
    tapset = set(taps)
    tapped: dict[int, torch.Tensor] = {}
    ks, vs = cache.layer_views()
    for i, (ln1, qkv, dense, ln2, fc, proj) in enumerate(plan.layers):
        ck, cv = ks[i], vs[i]  # [S, Hkv, seq_alloc, D]
        h = qkv(x, norm=ln1)  # [M', (H + 2Hkv) D]
        q = ext.rope_kv(h if h.is_contiguous() else h.contiguous(), cos, sin, rp_pos, ck, cv, rp_slots, g.heads,
                        g.kv_heads)  # [M', H·D]
        o = ext.attend(q, ck, cv, slots, start, lens, g.heads, g.window, g.scale, False, offsets)  # [M', H·D]
        x = dense(o, residual=x)  # [M', d]
        x = proj(fc(x, norm=ln2), residual=x)  # [M', d]
        if i in tapset:
            tapped[i] = x
    cache.advance(slots, T)
    hidden = None
    if taps:
        hidden = _unpack(torch.cat([tapped[t] for t in taps], dim=-1), real, pad, B * T).view(B, T, -1)  # [B, T, taps·d]
    if logits == "none":
        return ModelOutput(None, hidden)
    if logits == "last":
        last = last_index if last_index is not None else torch.full((B,), T - 1, dtype=torch.long)
        rows = torch.arange(B) * T + last  # [B] in the padded layout
        if real is not None:
            rows = (torch.cumsum(lens, 0) - lens) + last  # [B] in the packed one
        out = plan.head(x.index_select(0, rows), norm=plan.ln_f, out_f32=True)  # [B, V] float32
        return ModelOutput(out.view(B, 1, -1), hidden)
    out = plan.head(x, norm=plan.ln_f, out_f32=True)  # [M', V] float32
    return ModelOutput(_unpack(out, real, pad, B * T).view(B, T, -1), hidden)
