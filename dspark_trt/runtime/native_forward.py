"""The CausalLM forward on the native kernels (runtime.native): decode, verify and prefill in one code path.

Owns: `NativePlan` — every projection of a model bound once to its packed weight and fixed kernel arguments (so a
step makes one C++ call per projection and no per-call Python dispatch), rebuilt when a weight changes — and
`forward_native`, the layer loop: fused RMSNorm + qkv product, RoPE + KV write, per-query attention, dense product
+ residual, fused RMSNorm + gate|up product + SwiGLU, down product + residual, taps, final norm + lm_head in fp32.
A row's numbers depend on nothing but that row (docs/runtime.md, "Batch invariance"). Knows nothing about
scheduling, drafters or files; `runtime.model.CausalLM.forward` decides when this path runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.runtime import native

if TYPE_CHECKING:  # pragma: no cover
    from dspark_trt.runtime.kv_cache import KVCache
    from dspark_trt.runtime.model import CausalLM, ModelOutput


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
        w = spec["w"]
        sq = spec.get("sq")
        kind = spec.get("kind")
        kind = kind if kind is not None else native.kind_for(w, x_dtype, sq is not None)
        if kind is None:
            return
        packed, rowsum = native.packed(w, kind, swiglu)
        self.args = (packed, rowsum, kind, w.shape[0], swiglu, spec.get("scale"), spec.get("bias"),
                     bool(spec.get("bias_f32", False)))
        if sq is not None:
            self.sq = (sq[0], float(sq[1]))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: torch.Tensor | None = None,
                 out_f32: bool = False) -> torch.Tensor:  # x [M, in] → [M, out]
        if self.args is not None:
            return native.ext().linear(x, *self.args, residual, norm, self.eps, self.sq[0], self.sq[1], out_f32)
        from dspark_trt.runtime.model import rms_norm

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
        from dspark_trt.runtime.model import rms_norm

        h = rms_norm(x, norm, self.eps) if norm is not None else x
        y = self.module(h)  # [M, 2I]
        half = y.shape[-1] // 2
        return self._epilogue(y[:, :half] * F.silu(y[:, half:]), residual, out_f32)


class NativePlan:
    """Per-model binding of every projection to the native kernels, valid while no model tensor changes."""

    def __init__(self, model: "CausalLM") -> None:
        dt, eps = model.dtype, model.config.rms_norm_eps
        self.layers = []
        for layer in model.transformer.layers:
            self.layers.append((layer.input_layernorm.weight, _Lin(layer.attention.qkv, dt, False, eps),
                                _Lin(layer.attention.dense, dt, False, eps), layer.post_layernorm.weight,
                                _SwiGLULin(layer.mlp.fused_fc, dt, True, eps), _Lin(layer.mlp.proj, dt, False, eps)))
        self.head = _Lin(model.lm_head, dt, False, eps)
        self.ln_f = model.transformer.ln_f.weight
        self._tensors = list({id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())
        self._stamp = self.stamp()

    def stamp(self) -> int:
        """Sum of the model tensors' in-place version counters (changes when any of them is modified)."""
        return sum(t._version for t in self._tensors)

    def valid(self) -> bool:
        return self.stamp() == self._stamp


def plan_for(model: "CausalLM") -> NativePlan:
    plan = model.__dict__.get("_native_plan")
    if plan is None or not plan.valid():
        plan = model.__dict__["_native_plan"] = NativePlan(model)
    return plan


def forward_native(model: "CausalLM", input_ids: torch.Tensor, cache: "KVCache", slots: torch.Tensor,
                   taps: Sequence[int], logits: str, last_index: torch.Tensor | None,
                   lengths: list[int]) -> "ModelOutput":
    """CausalLM.forward on the native kernels (same contract; see CausalLM.forward)."""
    from dspark_trt.runtime.model import ModelOutput

    ext = native.ext()
    plan = plan_for(model)
    B, T = input_ids.shape
    start = cache.check_room(slots, T)  # [B]
    H, Hkv = model._H, model._Hkv
    pos = (start[:, None] + torch.arange(T)).reshape(-1)  # [B·T]
    cos, sin = model.rope_tables(int(start.max()) + T)
    lens = torch.tensor(lengths, dtype=torch.long)  # [B]
    window = int(model.config.sliding_window or 0)
    scale = model._scale
    tapset = set(taps)
    tapped: dict[int, torch.Tensor] = {}
    ks, vs = cache.layer_views()
    x = F.embedding(input_ids.reshape(-1), model.transformer.vocab_embedding.weight)  # [B·T, d]
    for i, (ln1, qkv, dense, ln2, fc, proj) in enumerate(plan.layers):
        ck, cv = ks[i], vs[i]  # [S, Hkv, seq_alloc, D]
        h = qkv(x, norm=ln1)  # [B·T, (H + 2Hkv) D]
        q = ext.rope_kv(h if h.is_contiguous() else h.contiguous(), cos, sin, pos, ck, cv, slots, H, Hkv)  # [B·T, H·D]
        o = ext.attend(q, ck, cv, slots, start, lens, H, window, scale, False)  # [B·T, H·D]
        x = dense(o, residual=x)  # [B·T, d]
        x = proj(fc(x, norm=ln2), residual=x)  # [B·T, d]
        if i in tapset:
            tapped[i] = x
    cache.advance(slots, T)
    hidden = torch.cat([tapped[t] for t in taps], dim=-1).view(B, T, -1) if taps else None  # [B, T, len(taps)·d]
    if logits == "none":
        return ModelOutput(None, hidden)
    n = T
    if logits == "last":
        rows = torch.arange(B) * T + (last_index if last_index is not None else T - 1)
        x, n = x.index_select(0, rows), 1  # [B, d]
    out = plan.head(x, norm=plan.ln_f, out_f32=True)  # [B·n, V] float32
    return ModelOutput(out.view(B, n, -1), hidden)
