"""The DSpark drafter's greedy inference pass on the native kernels, bound once (`DraftPlan`).

Owns: every product of a drafter pass — fc and the fused context k|v of the queued-context flush, each layer's
q|k|v, o, up|gate and down, the draft-vocab head (int8 rows or the param dtype), the Markov W2 — bound to its packed
weight and fixed kernel arguments, the confidence head's weights in fp32, and `propose_greedy`, the pass of
all-greedy rows with one C++ call per product and no per-call dispatch (runtime.native_forward.NativePlan's idea for
the target). Same calls, same arguments, same op order as DSparkModel's unbound path (`backbone_native`,
`base_logits`, `confidence_parts`, dispatch's native greedy Markov block), so the same bits
(tests/runtime/test_draft_sampling.py); `valid()` tells the owner when a tensor it was built from has changed, or the
engine. Knows nothing about slots, caches' allocation or scheduling: DSparkDrafter holds, rebuilds and uses it.
"""
from __future__ import annotations

from typing import Any

import torch

from dspark_trt.runtime import native, ops
from dspark_trt.runtime.drafters.layers import fused_weight
from dspark_trt.runtime.quant_linear import int8_rows


class DraftPlan:
    """A DSparkModel's inference products bound to the native kernels for activations of its param dtype. Build
    with `DraftPlan.bind(model)` (None where any product or the layers are not native-ready)."""

    def __init__(self, model: Any, args: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.__dict__.update(args)
        self._tensors = tensors
        self._key = self.key(model)
        self._stamp = sum(t._version for t in tensors)

    @classmethod
    def bind(cls, model: Any) -> "DraftPlan | None":
        """The plan of `model` (a DSparkModel with its target attached), or None where its unbound path must run:
        a layer or fc that is not a plain nn.Linear, a product torch would run, no Markov head, a confidence head
        without the Markov input."""
        cfg, dt = model.cfg, model.param_dtype
        if not (cfg.has_markov and cfg.enable_confidence_head and cfg.confidence_head_with_markov):
            return None
        if not all(layer.native_ready() for layer in model.layers) or type(model.fc) is not torch.nn.Linear \
                or model.fc.bias is not None:
            return None
        embed, head = model._need_target()

        def bind(w: torch.Tensor, swiglu: bool = False) -> tuple[Any, ...] | None:
            kern = ops.choose_kernel(dt, weight=w)
            if not kern.native:
                return None
            pk, rowsum = native.packed(w, kern.kind, swiglu)
            return pk, rowsum, kern.kind, w.shape[0], swiglu

        lin: dict[str, Any] = {"fc": bind(model.fc.weight), "ctx_kv": bind(fused_weight(
            model, "ctx_kv", [t for layer in model.layers for t in (layer.k_proj.weight, layer.v_proj.weight)]))}
        layers = []
        for layer in model.layers:
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            parts = (bind(fused_weight(layer, "qkv", [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])),
                     bind(layer.o_proj.weight),
                     bind(fused_weight(layer, "up_gate", [layer.up_proj.weight, layer.gate_proj.weight]), True),
                     bind(layer.down_proj.weight))
            if any(p is None for p in parts):
                return None
            layers.append((ln1.weight, float(ln1.eps), ln2.weight, float(ln2.eps), *parts, layer.heads,
                           layer.kv_heads, layer.head_dim ** -0.5))
        head_args = None
        if model.int8_head and ops.choose_kernel(dt, weight=torch.int8).kind == native.Pack.I8Q:
            key = (head.data_ptr(), head._version)
            if model._head_q is None or model._head_q[0] != key:
                model._head_q = (key, *int8_rows(head))  # int8 [Vd, d], scale [Vd]
            w8, scale = model._head_q[1], model._head_q[2]
            pk, rowsum = native.packed(w8, native.Pack.I8Q)
            head_args = (pk, rowsum, native.Pack.I8Q, w8.shape[0], False, scale)
        else:
            bound = bind(head)
            head_args = None if bound is None else (*bound, None)  # (pk, rowsum, kind, Vd, swiglu=False, scale)
        w1, w2 = model.markov_w1.weight, model.markov_w2.weight
        markov = bind(w2) if w1.dtype == w2.dtype else None
        if lin["fc"] is None or lin["ctx_kv"] is None or head_args is None or markov is None:
            return None
        w = model.confidence.weight.detach().float()  # [1, d + r]
        d = cfg.hidden_size
        reduced = cfg.head_vocab != cfg.vocab_size
        args = dict(lin, layers=layers, head=head_args, markov=markov[:4], w1=w1.detach().contiguous(),
                    d2t=model.d2t.long().contiguous() if reduced else None, embed=embed, mask=model.mask_embedding,
                    dtype=dt, norm=(model.norm.weight, float(model.norm.eps)),
                    ctx_norm=(model.ctx_norm.weight, float(model.ctx_norm.eps)),
                    conf_w=w[0, :d].clone(), conf_b=model.confidence.bias.detach().float()[0].clone(),
                    conf_wx=w[0, d:].clone(), temps=model.conf_temperature.float().clone())
        tensors = [*model.parameters(), *model.buffers(), embed, head]
        return cls(model, args, tensors)

    @staticmethod
    def key(model: Any) -> tuple[Any, ...]:
        """What a plan of `model` depends on beyond its packed copies: the engine, the head's precision, the
        confidence temperatures' tensor (replaced by set_temperatures) and every tensor's in-place version."""
        return (native.engine(), bool(model.int8_head), id(model.conf_temperature), id(model._head),
                sum(t._version for t in model.parameters()))

    def valid(self, model: Any) -> bool:
        """Still what `model` and the engine say (a tensor changed in place or replaced, another engine: rebind)."""
        return self.key(model) == self._key and sum(t._version for t in self._tensors) == self._stamp

    def _linear(self, x: torch.Tensor, args: tuple[Any, ...], residual: torch.Tensor | None = None,
                norm: tuple[torch.Tensor, float] | None = None, scale: torch.Tensor | None = None,
                out_f32: bool = False) -> torch.Tensor:
        w_norm, eps = norm if norm is not None else (None, 0.0)
        return native.ext().linear(x, *args, scale, None, False, residual, w_norm, eps, None, 0.0, out_f32)

    def context_kv(self, feats: torch.Tensor) -> torch.Tensor:
        """Queued features [N, F] → [N, L·2·Hkv·hd]: fc, then ctx_norm fused into the k|v product of every layer."""
        return self._linear(self._linear(feats, self.fc), self.ctx_kv, norm=self.ctx_norm)

    def propose_greedy(self, anchors: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                       slots: torch.Tensor, lens: torch.Tensor, G: int, gamma: int,
                       rope: tuple[torch.Tensor, torch.Tensor],
                       final_norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """All-greedy rows: anchors [B], per-layer context caches, slots / lens [B] → (target ids [B, γ], c [B, γ])
        of the full block of G (the prefix γ returned)."""
        ext = native.ext()
        B = anchors.shape[0]
        pos = (lens[:, None] + torch.arange(G)).reshape(-1)  # [B·G]
        cos, sin = rope
        a = self.embed[anchors].to(self.dtype)[:, None, :]  # [B, 1, d]
        h = torch.cat([a, self.mask.expand(B, G - 1, -1)], dim=1).reshape(B * G, -1).contiguous()  # [B·G, d]
        starts, counts = lens.long().contiguous(), torch.full((B,), G, dtype=torch.long)
        for (ln1, eps1, ln2, eps2, qkv, o_p, up_gate, down, heads, kv_heads, scale), ck, cv in zip(self.layers, ks, vs):
            x = self._linear(h, qkv, norm=(ln1, eps1))  # [B·G, (H + 2·Hkv)·hd]
            q = ext.rope_kv(x, cos, sin, pos, ck, cv, slots, heads, kv_heads)  # [B·G, H·hd]
            o = ext.attend(q, ck, cv, slots, starts, counts, heads, 0, scale, True, None)  # [B·G, H·hd]
            h = self._linear(o, o_p, residual=h)
            h = self._linear(self._linear(h, up_gate, norm=(ln2, eps2)), down, residual=h)
        hid = final_norm(h).view(B, G, -1)  # [B, G, d]
        pk, rowsum, kind, n, sw, hscale = self.head
        # the head over the γ rows asked for only: its products are row-invariant, so these are the full block's bits
        hg = hid[:, :gamma].reshape(B * gamma, -1)  # [B·γ, d]
        u = ext.linear(hg if hg.is_contiguous() else hg.contiguous(), pk, rowsum, kind, n, sw, hscale, None, False,
                       None, None, 0.0, None, 0.0, True).view(B, gamma, -1)  # [B, γ, Vd] f32
        conf_bias = ((hid.float() * self.conf_w).sum(-1) + self.conf_b)[:, :gamma]  # [B, γ]
        out = ext.markov_greedy(u.contiguous(), anchors.long().contiguous(), self.w1, *self.markov, self.d2t)
        toks = out[1]  # [B, γ] target ids
        prev = torch.cat([anchors.long()[:, None], toks[:, :-1]], dim=1)  # [B, γ] x_{k-1}
        s = (self.w1[prev].float() * self.conf_wx).sum(-1)  # [B, γ]
        return toks, torch.sigmoid((conf_bias + s) / self.temps[:gamma])
