"""Quantized linears: real int8/fp8 kernels where this torch build has them, equal to the dequantized math."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.runtime.quant_linear import (FP8, FP8Linear, W8A8SQLinear, W8A16Linear, kernel_paths,
                                             make_linear_factory)

torch.manual_seed(0)


def _int8(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(out, inp)
    s = w.abs().amax(1) / 127
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def test_kernel_probe_matches_paths() -> None:
    k = kernel_paths()
    assert W8A16Linear(8, 4, False, torch.float32).path == ("torch._weight_int8pack_mm" if k["int8pack_mm"] else "dequantized")
    assert W8A8SQLinear(8, 4, False, torch.float32).path == ("torch._int_mm" if k["int_mm"] else "dequantized")
    assert FP8Linear(8, 4, False, torch.float32).path == "fp8-emulated"  # CPU _scaled_mm is a reference kernel


def test_fp8_scaled_mm_path_agrees_with_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel_paths()["scaled_mm"]:
        pytest.skip("torch._scaled_mm missing on this build")
    monkeypatch.setenv("DSPARK_FP8_SCALED_MM", "1")
    a = FP8Linear(32, 16, False, torch.float32)
    monkeypatch.delenv("DSPARK_FP8_SCALED_MM")
    b = FP8Linear(32, 16, False, torch.float32)
    assert a.path == "torch._scaled_mm" and b.path == "fp8-emulated"
    w = torch.randn(16, 32)
    for m in (a, b):
        m.weight.copy_((w / (w.abs().max() / 448)).to(FP8))
        m.weights_scaling_factor.fill_(float(w.abs().max() / 448))
        m.activation_scaling_factor.fill_(0.01)
    x = torch.randn(4, 32)
    torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-4)


def test_w8a16_matches_dequantized() -> None:
    m = W8A16Linear(32, 16, True, torch.float32)
    w, s = _int8(16, 32)
    m.weight.copy_(w)
    m.weights_scaling_factor.copy_(s)
    m.bias.normal_()
    x = torch.randn(2, 5, 32)
    ref = x @ (w.float() * s[:, None]).T + m.bias
    torch.testing.assert_close(m(x), ref, rtol=1e-4, atol=1e-4)


def test_sq_is_integer_exact() -> None:
    m = W8A8SQLinear(32, 16, False, torch.float32)
    w, s = _int8(16, 32)
    m.weight.copy_(w)
    m.weights_scaling_factor.copy_(s)
    m.prequant_scaling_factor.copy_(torch.rand(32) + 0.5)
    m.activation_scaling_factor.fill_(0.02)
    x = torch.randn(7, 32)
    xq = torch.round(x * m.prequant_scaling_factor / 0.02).clamp(-128, 127)
    ref = (xq @ w.float().T) * 0.02 * s  # exact int products, then scales
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


def test_fp8_and_fused_parts() -> None:
    m = FP8Linear(32, 16, False, torch.float32)
    parts = []
    for _ in range(2):
        w = torch.randn(8, 32)
        ws = w.abs().max() / 448
        parts.append({"weight": (w / ws).to(FP8), "weights_scaling_factor": ws.reshape(1),
                      "activation_scaling_factor": torch.tensor([0.01])})
    m.load_fused_parts(parts)
    assert m.weights_scaling_factor.shape == (16,)
    x = torch.randn(3, 32)
    xq = (x / 0.01).clamp(-448, 448).to(FP8).float()
    wd = torch.cat([p["weight"].float() * p["weights_scaling_factor"] for p in parts])
    torch.testing.assert_close(m(x), (xq @ wd.T) * 0.01, rtol=1e-4, atol=1e-4)
    parts[1]["activation_scaling_factor"] = torch.tensor([0.02])  # differing act scales → the larger one
    m.load_fused_parts(parts)
    assert float(m.activation_scaling_factor) == pytest.approx(0.02)


def test_factory_excludes_lm_head() -> None:
    f = make_linear_factory("W8A16", torch.float32, ["lm_head"])
    assert isinstance(f("lm_head", 8, 4, False), torch.nn.Linear)
    assert isinstance(f("transformer.layers.0.attention.qkv", 8, 4, False), W8A16Linear)
    assert isinstance(make_linear_factory(None, torch.float32)("x", 8, 4, False), torch.nn.Linear)
