"""The DSpark distillation loss: 0.1·CE + 0.9·Σ_k w_k‖p_d − p_t‖₁ + 1.0·BCE(c_k, c*_k) (LossWeights: the paper's).

Owns: turning the target's stored top-k log-probs into (a) CE labels (the target's top-1, mapped to the
draft vocabulary), (b) an L1 distance that is exact on the top-k support and a tight lower bound for the
tail, (c) the confidence label c*_k = 1 − ½‖p_d − p_t‖₁ (detached; per-position conditional acceptance),
and position weights w_k = exp(−(k−1)/decay). Pure torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_trt.errors import InvalidArgumentError


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    bce: float = 1.0
    decay: float = 4.0  # w_k = exp(−(k−1)/decay)

    def __post_init__(self) -> None:
        if min(self.ce, self.l1, self.bce) < 0 or self.ce + self.l1 <= 0 or self.decay <= 0:
            raise InvalidArgumentError(f"loss weights need ce, l1, bce ≥ 0 with ce + l1 > 0 and decay > 0, got "
                                       f"ce {self.ce}, l1 {self.l1}, bce {self.bce}, decay {self.decay}. Fix: e.g. "
                                       "--loss-ce 0.1 --loss-l1 0.9 (the paper's), or --loss-ce 1 --loss-l1 0.2")


@dataclass
class LossOut:
    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    bce: torch.Tensor
    acc: torch.Tensor  # [γ] greedy top-1 agreement per block position (teacher-forced), float


def dspark_loss(logits: torch.Tensor, conf_logit: torch.Tensor | None, topk_ids: torch.Tensor,
                topk_logp: torch.Tensor, t2d: torch.Tensor, valid: torch.Tensor,
                w: LossWeights = LossWeights(), with_acc: bool = True) -> LossOut:
    """logits [N, γ, Vd] float32 (U + Markov bias), conf_logit [N, γ] | None, topk_ids [N, γ, k] target ids,
    topk_logp [N, γ, k], t2d [V] long (draft id or −1), valid [N, γ] bool or float weights → LossOut.

    Only two passes touch the full [N, γ, Vd] tensor (log_softmax and one gather): CE and L1 need the
    draft's log-probs at the teacher's top-k ids only (the top-1 is the CE label; the tail mass is
    1 − Σ top-k). The rest works on [N, γ, k]."""
    logp_d = torch.log_softmax(logits, dim=-1)  # [N, γ, Vd]
    lp_on = logp_d.gather(-1, t2d[topk_ids].clamp(min=0))  # [N, γ, k]
    return dspark_loss_topk(lp_on, logits.argmax(-1) if with_acc else None, conf_logit, topk_ids, topk_logp, t2d,
                            valid, w)


def dspark_loss_topk(lp_on: torch.Tensor, argmax: torch.Tensor | None, conf_logit: torch.Tensor | None,
                     topk_ids: torch.Tensor, topk_logp: torch.Tensor, t2d: torch.Tensor, valid: torch.Tensor,
                     w: LossWeights = LossWeights()) -> LossOut:
    """dspark_loss from what it reads of the logits: lp_on [N, γ, k] the draft's log-probs at the teacher's top-k
    (draft ids t2d[topk_ids] clamped to ≥ 0; train.head_loss computes them without the full logits) and argmax
    [N, γ] draft ids (None: no accuracy)."""
    N, G, _ = lp_on.shape
    p_t = topk_logp.float().exp()  # [N, γ, k]
    dids = t2d[topk_ids]  # [N, γ, k] draft ids or −1
    in_d = dids >= 0
    pd_on = torch.where(in_d, lp_on.exp(), torch.zeros_like(p_t))  # [N, γ, k]
    tail_t = (1.0 - p_t.sum(-1)).clamp(min=0.0)  # target mass outside top-k
    tail_d = (1.0 - pd_on.sum(-1)).clamp(min=0.0)  # draft mass outside top-k
    l1 = (pd_on - p_t).abs().sum(-1) + (tail_d - tail_t).abs()  # [N, γ], in [0, 2]
    on = valid > 0  # valid: bool, or float weights (the on-policy reach)
    ce_ok = in_d[..., 0] & on  # CE label = the teacher's top-1, when it is in the draft vocabulary
    vf = valid.float()
    pos_w = torch.exp(-torch.arange(G, device=lp_on.device, dtype=torch.float32) / w.decay)  # [γ]
    denom = vf.sum().clamp(min=1.0)
    ce = -(lp_on[..., 0] * ce_ok.float()).sum() / ce_ok.float().sum().clamp(min=1.0)
    l1_term = (l1 * pos_w * vf).sum() / denom
    bce = lp_on.new_zeros(())
    if conf_logit is not None:
        target = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        bce = (F.binary_cross_entropy_with_logits(conf_logit, target, reduction="none") * vf).sum() / denom
    total = w.ce * ce + w.l1 * l1_term + w.bce * bce
    acc = torch.zeros(G)
    if argmax is not None:
        with torch.no_grad():
            label = torch.where(in_d[..., 0], dids[..., 0], torch.full_like(dids[..., 0], -100))
            hit = (argmax == label) & on
            acc = hit.float().sum(0) / on.float().sum(0).clamp(min=1.0)
    return LossOut(total, ce.detach(), l1_term.detach(), bce.detach(), acc)


def make_t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """d2t [Vd] → t2d [V]: draft id of each target id, −1 outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d
