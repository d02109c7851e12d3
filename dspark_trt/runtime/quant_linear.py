"""Quantized linear layers for the reference runtime, holding TensorRT-LLM checkpoint tensors as exported.

Owns the arithmetic of each TRT-LLM QuantAlgo the build produces, with the checkpoint's tensor names
(so `CausalLM.load_trtllm_state_dict` fills them by name), and the linear factory that picks one per
projection. Which path each takes on a torch build is decided once by probing the kernel
(`kernel_paths()`); docs/build.md records what this CPU build does:

  W8A16                int8 weight [out, in] + per-channel weights_scaling_factor [out]
                       → torch._weight_int8pack_mm (int8 weight, activations in the model dtype)
  W8A8_SQ_PER_CHANNEL  int8 weight + weights_scaling_factor [out] + activation_scaling_factor [1]
                       + prequant_scaling_factor [in] (SmoothQuant smoothing of the input)
                       → x·s quantized per tensor to int8, torch._int_mm (int8×int8→int32), rescaled
  FP8                  float8_e4m3fn weight + weights_scaling_factor [1] + activation_scaling_factor [1]
                       → x quantized per tensor to e4m3 and back ("fp8-emulated": e4m3 values, float matmul
                       against the once-dequantized e4m3 weight). torch._scaled_mm exists on this CPU build but is
                       a reference kernel (~720 ms for one 1×576×1536 product, ~300× slower than bf16), so it is
                       used only with DSPARK_FP8_SCALED_MM=1 (or on CUDA).

When a kernel is missing on the running torch build the layer dequantizes its weight once and runs
a row-invariant float product (`ops.tile_linear`; same quantization of weights and activations) and says so
in `.path`. W8A16 and SmoothQuant layers run on the native kernels wherever `ops.choose_kernel` sends their
product (`native_spec`: their tensors as runtime.native.linear's arguments; FP8 has no native form).
The fused MLP projection (mlp.gate | mlp.fc) is assembled by `load_fused_parts`: rows concatenated,
per-tensor weight scales turned into a per-row vector. Must not know about files or models.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Sequence

import torch
from torch import nn

from dspark_trt.errors import CheckpointError
from dspark_trt.runtime import ops
from dspark_trt.runtime.layers import FastLinear, LinearFactory, native_linear

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@functools.lru_cache(maxsize=None)
def kernel_paths() -> dict[str, bool]:
    """Which quantized kernels this torch build runs on CPU (probed once with tiny operands)."""
    ok: dict[str, bool] = {}
    x = torch.randn(3, 32)
    w8 = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    try:
        torch._weight_int8pack_mm(x, w8, torch.ones(16))
        ok["int8pack_mm"] = True
    except (RuntimeError, NotImplementedError, AttributeError):
        ok["int8pack_mm"] = False
    try:
        torch._int_mm(torch.randint(-127, 128, (3, 32), dtype=torch.int8), w8.t())
        ok["int_mm"] = True
    except (RuntimeError, NotImplementedError, AttributeError):
        ok["int_mm"] = False
    try:
        one = torch.tensor(1.0)
        torch._scaled_mm(x.to(FP8), w8.float().to(FP8).t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        ok["scaled_mm"] = True
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        ok["scaled_mm"] = False
    return ok


class _QuantLinear(nn.Module):
    """Common holder: weight [out, in] in the storage dtype, optional bias, output dtype."""

    path: str = "dequantized"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 weight_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=weight_dtype))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype))
        else:
            self.bias = None
        self._cache: dict[str, torch.Tensor] = {}

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module signature
        self._cache.clear()
        return super()._apply(fn, recurse)

    def _derived(self, name: str, make: Callable[[], object], *sources: torch.Tensor) -> object:
        """A value computed from buffers, cached until one of them is replaced or modified in place."""
        key = tuple((t.data_ptr(), t._version) for t in sources)
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = self._cache[name] = (key, make())
        return hit[1]

    def native_spec(self, x_dtype: torch.dtype) -> dict | None:
        """runtime.native.linear's arguments (but x and the kind) for activations of x_dtype, or None (then forward()
        runs in torch)."""
        return None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, path={self.path}"

    def load_fused_parts(self, parts: Sequence[dict[str, torch.Tensor]]) -> None:
        """Fill this module from [mlp.gate, mlp.fc] tensor dicts (rows concatenated in that order)."""
        keys = set(parts[0])
        if any(set(p) != keys for p in parts):
            raise CheckpointError(f"Fused MLP parts carry different tensors {[sorted(p) for p in parts]}; re-export "
                                  f"the checkpoint with dspark-trt build.")
        with torch.no_grad():
            for key in keys:
                self._fuse_tensor(key, [p[key] for p in parts])
        self._cache.clear()

    def _fuse_tensor(self, key: str, ts: list[torch.Tensor]) -> None:
        dst = getattr(self, key)
        rows = [t.shape[0] if t.dim() else 1 for t in ts]
        if key in ("weight", "bias") or (ts[0].dim() >= 1 and sum(rows) == dst.shape[0] and dst.shape[0] > 1):
            dst.copy_(torch.cat(ts, 0).to(dst.dtype))
            return
        if all(torch.equal(ts[0], t) for t in ts[1:]):
            dst.copy_(ts[0].to(dst.dtype).reshape(dst.shape))
            return
        raise CheckpointError(f"Cannot fuse per-tensor {key} values {[t.flatten()[:2].tolist() for t in ts]} of "
                              f"mlp.gate and mlp.fc; re-export the checkpoint with dspark-trt build.")

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(self.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32
        raise NotImplementedError


class W8A16Linear(_QuantLinear):
    """TRT-LLM W8A16: int8 weights, per-output-channel scale, activations stay in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype, torch.int8)
        self.register_buffer("weights_scaling_factor", torch.ones(out_features, dtype=torch.float32))
        self.path = "torch._weight_int8pack_mm" if kernel_paths()["int8pack_mm"] else "dequantized"

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weights_scaling_factor.float()[:, None]

    def native_spec(self, x_dtype: torch.dtype) -> dict | None:
        if self.dtype != x_dtype:
            return None
        s = self._derived("native_s", lambda: self.weights_scaling_factor.float().contiguous(),
                          self.weights_scaling_factor)
        return {"w": self.weight, "scale": s, "bias": self.bias}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        y = native_linear(self, x2)
        if y is not None:
            return y.reshape(*shape[:-1], self.out_features)
        if self.path != "dequantized":
            s = self._cache.get("s")
            if s is None or s.dtype != x2.dtype:
                s = self._cache["s"] = self.weights_scaling_factor.to(x2.dtype).contiguous()
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight, s)  # [M, out]
        else:
            w = self._cache.get("w")
            if w is None:
                w = self._cache["w"] = self.dequantized_weight().to(x2.dtype)
            y = ops.product(x2, w)
        return self._finish(y, shape)


class W8A8SQLinear(_QuantLinear):
    """TRT-LLM W8A8_SQ_PER_CHANNEL: SmoothQuant-smoothed input, static per-tensor int8 activations,
    per-channel int8 weights; int8×int8→int32 matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype, torch.int8)
        self.register_buffer("weights_scaling_factor", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("activation_scaling_factor", torch.ones(1, dtype=torch.float32))
        self.register_buffer("prequant_scaling_factor", torch.ones(in_features, dtype=torch.float32))
        self.path = "torch._int_mm" if kernel_paths()["int_mm"] else "dequantized"

    def _fuse_tensor(self, key: str, ts: list[torch.Tensor]) -> None:
        if key == "activation_scaling_factor" and not all(torch.equal(ts[0], t) for t in ts[1:]):
            # gate and fc read the same input; differing calibration maxima → the larger (no clipping).
            log.warning("mlp.gate/mlp.fc activation scales differ (%s); using the larger for the fused projection",
                        [float(t.flatten()[0]) for t in ts])
            self.activation_scaling_factor.copy_(torch.stack([t.float().reshape(()) for t in ts]).max().reshape(1))
            return
        super()._fuse_tensor(key, ts)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weights_scaling_factor.float()[:, None]

    def native_spec(self, x_dtype: torch.dtype) -> dict | None:
        if self.dtype != x_dtype:
            return None
        a, w, p = self.activation_scaling_factor, self.weights_scaling_factor, self.prequant_scaling_factor
        os_ = self._derived("native_os", lambda: (a.float() * w.float()).contiguous(), a, w)
        pre = self._derived("native_pre", lambda: p.float().contiguous(), p)
        act = self._derived("native_act", lambda: float(a.float().reshape(-1)[0]), a)
        spec = {"w": self.weight, "scale": os_, "sq": (pre, act)}
        if self.bias is not None:  # added in fp32 before rounding, as _finish does
            spec.update(bias=self._derived("native_b", lambda: self.bias.float().contiguous(), self.bias), bias_f32=True)
        return spec

    def quantize_input(self, x2: torch.Tensor) -> torch.Tensor:
        """[M, in] → [M, in] int8: smooth, divide by the static scale, round, saturate."""
        xs = x2.float() * self.prequant_scaling_factor.float()
        return torch.round(xs / self.activation_scaling_factor.float()).clamp_(-128, 127).to(torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = native_linear(self, x.reshape(-1, self.in_features))
        if y is not None:
            return y.reshape(*shape[:-1], self.out_features)
        xq = self.quantize_input(x.reshape(-1, self.in_features))  # [M, in] int8
        out_scale = self._cache.get("os")
        if out_scale is None:
            out_scale = self._cache["os"] = (self.activation_scaling_factor.float() * self.weights_scaling_factor.float())
        if self.path == "torch._scaled_mm":
            wt = self._cache.get("wt")
            if wt is None:
                wt = self._cache["wt"] = self.weight.t()  # [in, out] column-major view
            acc = torch._int_mm(xq, wt)  # [M, out] int32
            y = acc.float() * out_scale
        else:
            y = ops.product(xq.float(), self.weight.float()) * out_scale
        return self._finish(y, shape)


class FP8Linear(_QuantLinear):
    """TRT-LLM FP8 (per-tensor): e4m3 weights and static per-tensor e4m3 activations, fp32 accumulation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype, FP8)
        # [1] as exported; [out] after fusing mlp.gate | mlp.fc (each keeps its own per-tensor scale)
        self.register_buffer("weights_scaling_factor", torch.ones(1, dtype=torch.float32))
        self.register_buffer("activation_scaling_factor", torch.ones(1, dtype=torch.float32))
        use_mm = os.environ.get("DSPARK_FP8_SCALED_MM") == "1" and kernel_paths()["scaled_mm"]
        self.path = "torch._scaled_mm" if use_mm else "fp8-emulated"

    def _fuse_tensor(self, key: str, ts: list[torch.Tensor]) -> None:
        if key == "weights_scaling_factor":
            rows = self.out_features // len(ts)
            vec = torch.cat([t.float().reshape(1).expand(rows) for t in ts])
            self.weights_scaling_factor = vec.clone()  # becomes a per-row [out] vector
            return
        if key == "activation_scaling_factor" and not all(torch.equal(ts[0], t) for t in ts[1:]):
            log.warning("mlp.gate/mlp.fc FP8 activation scales differ (%s); using the larger",
                        [float(t.flatten()[0]) for t in ts])
            self.activation_scaling_factor.copy_(torch.stack([t.float().reshape(()) for t in ts]).max().reshape(1))
            return
        super()._fuse_tensor(key, ts)

    def dequantized_weight(self) -> torch.Tensor:
        s = self.weights_scaling_factor.float()
        return self.weight.float() * (s[:, None] if s.numel() > 1 else s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        a = self.activation_scaling_factor.float().reshape(())
        xq = (x2.float() / a).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # [M, in] e4m3
        s = self.weights_scaling_factor.float()
        if self.path == "torch._scaled_mm":
            wt = self._cache.get("wt")
            if wt is None:
                wt = self._cache["wt"] = self.weight.t()  # [in, out] column-major view
            if s.numel() == 1:
                y = torch._scaled_mm(xq, wt, scale_a=a, scale_b=s.reshape(()), out_dtype=torch.float32)
            else:
                one = torch.ones((), dtype=torch.float32)
                y = torch._scaled_mm(xq, wt, scale_a=a, scale_b=one, out_dtype=torch.float32) * s
        else:  # e4m3-rounded activations × dequantized e4m3 weights, in the model dtype (fp32 when float32)
            w = self._cache.get("w")
            if w is None or w.dtype != x2.dtype:
                w = self._cache["w"] = self.dequantized_weight().to(x2.dtype)
            y = ops.product((xq.float() * a).to(x2.dtype), w)
        return self._finish(y, shape)


QUANT_LINEARS: dict[str, type[_QuantLinear]] = {
    "W8A16": W8A16Linear,
    "W8A8_SQ_PER_CHANNEL": W8A8SQLinear,
    "FP8": FP8Linear,
}


def is_excluded(name: str, exclude_modules: Sequence[str] | None) -> bool:
    """TRT-LLM exclude_modules semantics: exact name, trailing-* prefix, or the last name component."""
    import fnmatch

    for pat in exclude_modules or ():
        if name == pat or fnmatch.fnmatchcase(name, pat) or name.split(".")[-1] == pat:
            return True
        if pat.endswith("*") and name.startswith(pat[:-1]):
            return True
    return False


def make_linear_factory(quant_algo: str | None, dtype: torch.dtype,
                        exclude_modules: Sequence[str] | None = ("lm_head",)) -> LinearFactory:
    """A runtime LinearFactory: quantized modules for quant_algo, plain nn.Linear for excluded names."""
    if quant_algo is not None and quant_algo not in QUANT_LINEARS:
        raise CheckpointError(f"Quantization {quant_algo!r} is not supported by the reference runtime (supported: "
                              f"{', '.join(QUANT_LINEARS)}); rebuild with --quant none|fp8|int8_sq|w8a16.")

    def make(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        if quant_algo is None or is_excluded(name, exclude_modules):  # row-invariant nn.Linear
            return nn.utils.skip_init(FastLinear, in_features, out_features, bias=bias, dtype=dtype)
        return QUANT_LINEARS[quant_algo](in_features, out_features, bias, dtype)

    return make


def linear_paths(model: nn.Module) -> dict[str, int]:
    """{path: count} over the model's quantized linears (for logs and the manifest)."""
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, _QuantLinear):
            out[m.path] = out.get(m.path, 0) + 1
    return out


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest per-row int8: w [out, in] → (int8 [out, in], fp32 scale [out] = row absmax / 127)."""
    w = w.float()
    s = (w.abs().amax(1) / 127).clamp(min=1e-12)  # [out]
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s
