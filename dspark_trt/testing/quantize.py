"""Round-to-nearest quantized copies of a runtime model, for tests and benchmarks of the quantized kernels.

Owns `rtn_quantize` only (no calibration data set, no SmoothQuant smoothing); real quantized checkpoints come from
the ModelOpt export of dspark_trt.builder and load through runtime.trtllm_checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_trt.errors import CheckpointError
from dspark_trt.runtime import ops
from dspark_trt.runtime.model import CausalLM, iter_linears
from dspark_trt.runtime.quant_linear import FP8, FP8_MAX, QUANT_LINEARS, int8_rows, make_linear_factory


def rtn_quantize(model: CausalLM, quant_algo: str, calib_ids: torch.Tensor | None = None) -> CausalLM:
    """A copy of a runtime CausalLM with every projection but lm_head quantized round-to-nearest (weights per output
    channel, FP8 per tensor; activation scales from max|x| over calib_ids [B, T], default 64 fixed tokens).

    For tests and benchmarks of the quantized kernels (no calibration data set, no SmoothQuant smoothing: prequant
    scales are 1); real checkpoints come from the ModelOpt export of dspark_trt.builder.
    """
    if quant_algo not in QUANT_LINEARS:
        raise CheckpointError(f"rtn_quantize: unknown quantization {quant_algo!r} (one of {', '.join(QUANT_LINEARS)}).")
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in iter_linears(model):
        def hook(_m: nn.Module, args: tuple, _out: object, name: str = name) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().max()))
        hooks.append(mod.register_forward_hook(hook))
    ids = calib_ids if calib_ids is not None else (torch.arange(64) * 7919 % model.config.vocab_size).view(1, -1)
    try:
        with ops.kernel_path("torch"):  # the torch path calls the projection modules (the hooks see their inputs)
            model(ids, model.new_cache(ids.shape[0], ids.shape[1]), list(range(ids.shape[0])), logits="none")
    finally:
        for h in hooks:
            h.remove()
    state = model.trtllm_state_dict()  # mlp.fc / mlp.gate unfused
    for name, _mod in iter_linears(model):
        if name == "lm_head":
            continue
        parts = [name[:-len("fused_fc")] + p for p in ("gate", "fc")] if name.endswith("fused_fc") else [name]
        a = max(amax.get(name, 1.0), 1e-6)
        for part in parts:
            w = state[part + ".weight"].float()
            if quant_algo == "FP8":
                s = (w.abs().max() / FP8_MAX).clamp(min=1e-12).reshape(1)
                state[part + ".weight"] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
                state[part + ".activation_scaling_factor"] = torch.tensor([a / FP8_MAX])
            else:
                state[part + ".weight"], s = int8_rows(w)
                if quant_algo == "W8A8_SQ_PER_CHANNEL":
                    state[part + ".activation_scaling_factor"] = torch.tensor([a / 127])
                    state[part + ".prequant_scaling_factor"] = torch.ones(w.shape[1])
            state[part + ".weights_scaling_factor"] = s
    q = CausalLM(model.config, dtype=model.dtype, linear_factory=make_linear_factory(quant_algo, model.dtype))
    q.load_trtllm_state_dict(state, source=f"rtn_quantize({quant_algo})")
    return q
