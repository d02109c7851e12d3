"""Sequential temperature scaling (STS) of the confidence head, ECE and AUC.

Owns: given raw confidence logits z [N, γ] and per-position acceptance labels y [N, γ] (1 = the draft
token at position k is accepted given positions < k were), fit T_1..T_γ left to right, each by grid
search minimising the ECE of the survival a_k = Π_{i≤k} σ(z_i / T_i) against the realised prefix
survival s_k = Π_{i≤k} y_i (rows where the prefix was already rejected still count: their s_k is 0).
Pure torch; no model code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GRID = torch.exp(torch.linspace(-2.5, 2.5, 121))  # temperatures ≈ 0.08 … 12


def ece(prob: torch.Tensor, label: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error of probabilities [N] against 0/1 labels [N] (equal-width bins)."""
    prob, label = prob.flatten().double(), label.flatten().double()
    if prob.numel() == 0:
        return 0.0
    idx = (prob * bins).long().clamp(max=bins - 1)
    tot = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(prob))
    sp = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, prob)
    sl = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, label)
    return float(((sp - sl).abs()).sum() / prob.numel())


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """ROC AUC (rank statistic, ties averaged); 0.5 when one class is missing."""
    s, y = score.flatten().double(), label.flatten().bool()
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return 0.5
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    uniq, inv = torch.unique(s, return_inverse=True)  # average ties
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
    cnt = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(ranks))
    ranks = (sums / cnt)[inv]
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


@dataclass(frozen=True)
class CalibrationReport:
    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]  # per position, survival a_k vs s_k, T = 1
    ece_after: tuple[float, ...]
    auc: tuple[float, ...]  # per position: conditional c_k vs y_k (on rows that reached k)
    auc_survival: float  # pooled a_k vs s_k over all positions

    @property
    def mean_ece_before(self) -> float:
        return sum(self.ece_before) / len(self.ece_before)

    @property
    def mean_ece_after(self) -> float:
        return sum(self.ece_after) / len(self.ece_after)


def survival(z: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """z [N, γ], temps [γ] → a [N, γ] = cumprod σ(z / T)."""
    return torch.sigmoid(z.double() / temps.double()).cumprod(-1)


def sts(z: torch.Tensor, y: torch.Tensor, bins: int = 15) -> CalibrationReport:
    """Fit per-position temperatures left to right (see module docstring)."""
    z, y = z.double(), y.double()
    G = z.shape[1]
    s = y.cumprod(-1)  # realised prefix survival [N, γ]
    ones = torch.ones(G, dtype=torch.float64)
    before = survival(z, ones)
    temps = ones.clone()
    prefix = torch.ones(z.shape[0], dtype=torch.float64)
    for k in range(G):
        best_t, best_e = 1.0, float("inf")
        for t in GRID.tolist():
            e = ece(prefix * torch.sigmoid(z[:, k] / t), s[:, k], bins)
            if e < best_e - 1e-12:
                best_t, best_e = t, e
        temps[k] = best_t
        prefix = prefix * torch.sigmoid(z[:, k] / best_t)
    after = survival(z, temps)
    reach = torch.cat([torch.ones_like(s[:, :1]), s[:, :-1]], dim=1).bool()  # rows that reached position k
    aucs = tuple(auc(z[reach[:, k], k], y[reach[:, k], k]) for k in range(G))
    return CalibrationReport(temperatures=tuple(float(t) for t in temps),
                             ece_before=tuple(ece(before[:, k], s[:, k], bins) for k in range(G)),
                             ece_after=tuple(ece(after[:, k], s[:, k], bins) for k in range(G)),
                             auc=aucs, auc_survival=auc(after.flatten(), s.flatten()))
