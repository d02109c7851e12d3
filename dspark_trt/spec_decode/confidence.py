"""Confidence signals that drive the K policies.

Owns the confidence formula of the confidence policy (target top-1 probability, top-1 − top-2 margin, EMA of the acceptance
rate), survival probabilities a_j = Π_{i≤j} c_i from a drafter's per-position confidences, and the draft-side
early stop (cut the block where the cumulative confidence falls under a threshold). Pure arithmetic on
tensors and floats: knows nothing of models, caches or serving.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dspark_trt.errors import InvalidArgumentError

__all__ = ["ConfidenceWeights", "round_signals", "ema_update", "confidence_score", "survival", "early_stop_k",
           "fallback_survival"]


@dataclass(frozen=True)
class ConfidenceWeights:
    """conf = w_top1·avg_top1 + w_margin·min(margin_scale·avg(top1 − top2), 1) + w_accept·EMA(acceptance)."""

    w_top1: float = 0.4
    w_margin: float = 0.3
    w_accept: float = 0.3
    margin_scale: float = 5.0
    ema_weight: float = 0.2  # weight of the newest round's acceptance rate in the EMA
    ema_init: float = 0.5  # EMA before any round was verified

    def __post_init__(self) -> None:
        for name in ("w_top1", "w_margin", "w_accept", "margin_scale"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if not 0.0 <= self.ema_weight <= 1.0:
            raise InvalidArgumentError(f"ema_weight must be in [0, 1], got {self.ema_weight}")
        if not 0.0 <= self.ema_init <= 1.0:
            raise InvalidArgumentError(f"ema_init must be in [0, 1], got {self.ema_init}")


def round_signals(top1: Sequence[float], margin: Sequence[float], k: int) -> tuple[float, float]:
    """top1 [K+1], margin [K+1] of one row (floats: executors hand them over as lists, one conversion per round
    rather than tensor ops per row), k its verify length → (avg top-1, avg margin) over positions 0..k (every
    position the target verified in this round, the bonus/recovery position included)."""
    n = k + 1
    return math.fsum(top1[:n]) / n, math.fsum(margin[:n]) / n


def ema_update(prev: float, new: float, weight: float = 0.2) -> float:
    """Exponential moving average with `weight` on the newest value."""
    return weight * new + (1.0 - weight) * prev


def confidence_score(avg_top1: float, avg_margin: float, ema_acceptance: float,
                     w: ConfidenceWeights = ConfidenceWeights()) -> float:
    """The confidence policy's scalar confidence C in [0, 1] (for inputs in [0, 1])."""
    return (w.w_top1 * avg_top1 + w.w_margin * min(avg_margin * w.margin_scale, 1.0)
            + w.w_accept * ema_acceptance)


def survival(conf: torch.Tensor) -> torch.Tensor:
    """conf [B, γ] per-position conditional acceptance c_k → survival a [B, γ], a_j = Π_{i≤j} c_i
    (the probability that d_1..d_j are all accepted)."""
    return conf.float().clamp(0.0, 1.0).cumprod(dim=-1)


def fallback_survival(alpha: float, gamma: int) -> torch.Tensor:
    """Survival when the drafter has no confidence head: a_j = α^j with α the request's acceptance EMA. [γ]"""
    a = min(max(alpha, 0.0), 1.0)
    return torch.tensor([a ** (j + 1) for j in range(gamma)], dtype=torch.float32)


def early_stop_k(conf: torch.Tensor, threshold: float) -> torch.Tensor:
    """conf [B, γ] → [B] long: the number of leading draft positions whose cumulative confidence Π c_i stays
    ≥ threshold (the block is cut at the first position where it falls below). threshold ≤ 0 keeps all γ."""
    if threshold <= 0:
        return torch.full((conf.shape[0],), conf.shape[1], dtype=torch.long)
    ok = survival(conf) >= threshold  # [B, γ]
    return ok.to(torch.long).cumprod(dim=1).sum(dim=1)
