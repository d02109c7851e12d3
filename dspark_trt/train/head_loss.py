"""The training forward's last step without the [N, γ, Vd] tensors: the draft's log-probs at the teacher's top-k ids.

Owns `draft_logprobs`, a custom autograd function over row chunks: z = U + M with U = h·headᵀ (the target's
draft-vocab head, frozen) and M = W1[x]·W2ᵀ (the Markov bias), both products in the training dtype (bf16 under
autocast, as autocast runs them) and summed in fp32 — the logits `DSparkModel.forward_train` returns — then
lp = z[ids] − logsumexp(z) and argmax z. Forward keeps only h, W1[x] and logsumexp per row; backward recomputes
each chunk's z (dz = scatter(g) − softmax(z)·Σg) and returns dh, d W1[x], dW2. The loss needs nothing else of z
(train.loss: CE and L1 read the top-k log-probs, the tail mass is 1 − their sum), so the ~10 passes over a 117 MB
fp32 tensor per step (casts, add, log_softmax, its backward, a zero-filled gather gradient) become one L2-sized
chunk at a time. Measured on the default recipe (8 × 32 anchors, γ = 7, Vd = 16,384): docs/drafter.md.
"""
from __future__ import annotations

import torch

__all__ = ["draft_logprobs"]

CHUNK_ROWS = 128  # rows of z [C, Vd] per chunk: 8 MB in fp32 at Vd = 16,384


def _z(h: torch.Tensor, head: torch.Tensor, m: torch.Tensor | None, w2: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits [C, Vd] fp32: products in head's dtype, each rounded there, summed in fp32."""
    acc = _acc_dtype(head)
    z = (h.to(head.dtype) @ head.t()).to(acc)
    if m is not None and w2 is not None:
        z = z + (m.to(head.dtype) @ w2.to(head.dtype).t()).to(acc)
    return z


def _acc_dtype(head: torch.Tensor) -> torch.dtype:
    """fp32 (fp64 for fp64 products: gradcheck)."""
    return torch.promote_types(head.dtype, torch.float32)


class _DraftLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, head: torch.Tensor, m: torch.Tensor | None, w2: torch.Tensor | None,  # noqa: ANN001
                ids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        R = h.shape[0]
        acc = _acc_dtype(head)
        lp = torch.empty(R, ids.shape[1], dtype=acc, device=h.device)  # [R, k]
        am = torch.empty(R, dtype=torch.long, device=h.device)  # [R]
        lse = torch.empty(R, dtype=acc, device=h.device)  # [R]
        with torch.autocast(h.device.type, enabled=False):
            for c0 in range(0, R, chunk):
                c1 = min(R, c0 + chunk)
                z = _z(h[c0:c1], head, None if m is None else m[c0:c1], w2)  # [C, Vd]
                lse[c0:c1] = torch.logsumexp(z, dim=-1)
                lp[c0:c1] = z.gather(1, ids[c0:c1]) - lse[c0:c1, None]
                am[c0:c1] = z.argmax(-1)
        ctx.save_for_backward(h, head, m, w2, ids, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(am)
        return lp, am

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, _g_am: torch.Tensor | None):  # noqa: ANN001, ANN205
        h, head, m, w2, ids, lse = ctx.saved_tensors
        need_h, _, need_m, need_w2 = ctx.needs_input_grad[:4]
        dh = torch.empty_like(h) if need_h else None
        dm = torch.empty_like(m) if (need_m and m is not None) else None
        acc = _acc_dtype(head)
        dw2 = torch.zeros(w2.shape, dtype=acc, device=w2.device) if (need_w2 and w2 is not None) else None
        g_lp = g_lp.to(acc)
        w2c = None if w2 is None else w2.to(head.dtype)
        with torch.autocast(h.device.type, enabled=False):
            for c0 in range(0, h.shape[0], ctx.chunk):
                c1 = min(h.shape[0], c0 + ctx.chunk)
                mc = None if m is None else m[c0:c1]
                z = _z(h[c0:c1], head, mc, w2)  # [C, Vd], the forward's values
                g = g_lp[c0:c1]  # [C, k]
                dz = torch.exp(z - lse[c0:c1, None]).mul_(-g.sum(-1, keepdim=True))  # −softmax · Σg
                dz.scatter_add_(1, ids[c0:c1], g)  # + g at each top-k id
                dzc = dz.to(head.dtype)  # the gradient as autocast's bf16 products see it
                if dh is not None:
                    dh[c0:c1] = (dzc @ head).to(h.dtype)
                if dm is not None and mc is not None:
                    dm[c0:c1] = (dzc @ w2c).to(m.dtype)
                if dw2 is not None and mc is not None:
                    dw2 += (dzc.t() @ mc.to(head.dtype)).to(acc)
        return dh, None, dm, None if dw2 is None else dw2.to(w2.dtype), None, None


def draft_logprobs(h: torch.Tensor, head: torch.Tensor, m: torch.Tensor | None, w2: torch.Tensor | None,
                   ids: torch.Tensor, chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, d], head [Vd, d] (frozen; its dtype is the products' dtype), m = W1[x] [R, r] and w2 [Vd, r] (None: no
    Markov head), ids [R, k] draft ids (≥ 0) → (log_softmax(z) at ids [R, k] fp32, argmax z [R] long), z = U + M as
    DSparkModel.forward_train computes it; differentiable in h, m and w2."""
    return _DraftLogProbs.apply(h.contiguous(), head, None if m is None else m.contiguous(), w2, ids.contiguous(),
                                chunk)
