"""STS calibration: lowers ECE on a synthetic over-confident head and recovers the temperature; AUC/ECE basics."""
from __future__ import annotations

import torch

from dspark_trt.train.calibrate import auc, ece, sts


def test_sts_fixes_overconfidence() -> None:
    g = torch.Generator().manual_seed(0)
    true_logit = torch.randn(4000, 5, generator=g) * 1.5 + 1.0  # [N, γ]
    y = torch.bernoulli(torch.sigmoid(true_logit), generator=g)
    rep = sts(3.0 * true_logit, y)  # head 3× over-confident
    assert rep.mean_ece_after < 0.5 * rep.mean_ece_before
    assert 2.0 < rep.temperatures[0] < 4.5
    assert all(0.5 < a <= 1.0 for a in rep.auc)


def test_ece_and_auc_basics() -> None:
    p = torch.tensor([0.9, 0.9, 0.1, 0.1])
    assert ece(p, torch.tensor([1.0, 1.0, 0.0, 0.0])) < 0.11
    assert ece(p, torch.tensor([0.0, 0.0, 1.0, 1.0])) > 0.8
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
