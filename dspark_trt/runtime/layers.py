"""The runtime's basic pieces, below the model and both of its forwards (runtime.model's torch layer loop and
runtime.native_forward's native one).

Owns: `ModelOutput` (what a forward returns), `rms_norm` / `RMSNorm` (HF Llama numerics), `LinearFactory` (how a
model builds its projections), `FastLinear` (the row-invariant `nn.Linear`) and `native_linear` (a projection module
on the native kernels, where `ops.choose_kernel` sends its product). Knows nothing about models, caches or drafters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.runtime import native, ops

# (qualified module name, in_features, out_features, bias) -> module mapping [..., in] -> [..., out]
LinearFactory = Callable[[str, int, int, bool], nn.Module]


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T | 1, V] float32
    hidden: torch.Tensor | None  # [B, T, len(taps) * d] model dtype, or None when no taps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm numerics: normalise in fp32, round to the input dtype, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Weight holder; the math lives in `rms_norm` so the hot path skips module dispatch."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def native_linear(module: nn.Module, x2: torch.Tensor) -> torch.Tensor | None:
    """module's product of x2 [M, in] on the native kernels → [M, out] (its epilogues included, module dtype), or None
    where `ops.choose_kernel` answers torch or the module has no native form (`native_spec`) for these activations."""
    spec = module.native_spec(x2.dtype)  # type: ignore[operator]
    if spec is None:
        return None
    kern = ops.choose_kernel(x2, weight=spec["w"], sq="sq" in spec)
    return native.linear(x2, kind=kern.kind, **spec) if kern.native else None


class FastLinear(nn.Linear):
    """nn.Linear whose CPU products are row-invariant (a row's result does not depend on the other rows).

    On the CPU it runs the native row-invariant kernel where `ops.choose_kernel` says so, else `ops.tile_linear`
    (one torch.mv per row; a long prompt's rows as one product of their own). The bias is added after rounding the
    product on every CPU path, as F.linear-then-add would. Other devices use F.linear.
    """

    def native_spec(self, x_dtype: torch.dtype) -> dict | None:
        """native.linear's arguments (but x and the kind) for activations of x_dtype."""
        return {"w": self.weight, "bias": self.bias}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        w = self.weight
        x2 = x.reshape(-1, x.shape[-1])  # [rows, in]
        y = native_linear(self, x2)
        if y is None:
            if x.device.type != "cpu":
                return F.linear(x, w, self.bias)
            y = ops.tile_linear(x2, w)  # [rows, out]
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], w.shape[0])
