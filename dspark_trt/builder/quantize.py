"""Stage 2, quantize: NVIDIA ModelOpt post-training quantization of the target and draft on CPU.

Owns: the ModelOpt recipe of each --quant / --kv-quant mode (FP8_DEFAULT_CFG, INT8_SMOOTHQUANT_CFG,
INT8_WEIGHT_ONLY_CFG, + FP8_KV_CFG), the calibration forward loops (Hugging Face causal LMs on the
shipped calibration text; the DSpark drafter on target features of that text), and the quality report
(teacher-forced greedy agreement and perplexity vs the unquantized model on held-out text). Must not
write checkpoints (export.py does) or import tensorrt_llm.
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable

import torch
from torch import nn

from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

CALIB_BATCH = 4


def modelopt_config(quant: str, kv_quant: str) -> dict[str, Any]:
    """The ModelOpt quantization config for our mode names (a deep copy, safe to edit)."""
    import modelopt.torch.quantization as mtq

    base = {"fp8": mtq.FP8_DEFAULT_CFG, "int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "w8a16": mtq.INT8_WEIGHT_ONLY_CFG}
    if quant == "none":
        cfg: dict[str, Any] = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    elif quant in base:
        cfg = copy.deepcopy(base[quant])
    else:
        raise BuildError(f"Unknown quantization mode {quant!r}; use none, fp8, int8_sq or w8a16.")
    if kv_quant == "fp8":
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(list(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg


def _quietly(fn: Callable[[], Any]) -> Any:
    """Run a ModelOpt call with its chatty stdout prints turned into debug logs."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = fn()
    for line in buf.getvalue().splitlines():
        if line.strip():
            log.debug("modelopt: %s", line)
    return out


def quantize_hf(model: nn.Module, quant: str, kv_quant: str, calib: torch.Tensor,
                progress: Callable[[int], None] | None = None) -> nn.Module:
    """ModelOpt-quantize a HF causal LM in place on calibration sequences calib [N, T] long."""
    import modelopt.torch.quantization as mtq

    cfg = modelopt_config(quant, kv_quant)

    def loop(m: nn.Module) -> None:
        with torch.no_grad():
            for i in range(0, calib.shape[0], CALIB_BATCH):
                m(calib[i:i + CALIB_BATCH])
                if progress:
                    progress(min(CALIB_BATCH, calib.shape[0] - i))

    return _quietly(lambda: mtq.quantize(model, cfg, loop))


def quantize_dspark(model: nn.Module, quant: str, kv_quant: str, forward_loop: Callable[[nn.Module], None]) -> nn.Module:
    """ModelOpt-quantize a DSparkModel's linear layers; the feature fc, Markov and confidence heads stay unquantized.

    forward_loop drives the drafter over calibration contexts (target features → propose) so activation
    ranges are real. kv_quant does not apply: the drafter keeps no KV cache in TRT-LLM form.
    """
    import modelopt.torch.quantization as mtq

    cfg = modelopt_config(quant, "none")
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [
        {"quantizer_name": "*markov_w2*", "enable": False}, {"quantizer_name": "*confidence*", "enable": False},
        {"quantizer_name": "fc.*", "enable": False}]  # fc.weight's dtype is the drafter's param dtype
    return _quietly(lambda: mtq.quantize(model, cfg, forward_loop))


@torch.no_grad()
def logits_hf(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """[N, T, V] float32 logits of a HF causal LM (one sequence at a time keeps memory small)."""
    return torch.cat([model(seqs[i:i + 1]).logits.float() for i in range(seqs.shape[0])], 0)


def quality(ref_logits: torch.Tensor, q_logits: torch.Tensor, seqs: torch.Tensor) -> dict[str, float]:
    """Teacher-forced greedy agreement and perplexity (next-token) of q vs ref; logits [N, T, V], seqs [N, T]."""
    agree = (ref_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item()
    tgt = seqs[:, 1:]

    def ppl(lg: torch.Tensor) -> float:
        nll = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), tgt.reshape(-1))
        return float(math.exp(nll.item()))

    p_ref, p_q = ppl(ref_logits), ppl(q_logits)
    return {"greedy_agreement": round(agree, 4), "ppl_reference": round(p_ref, 4), "ppl_quantized": round(p_q, 4),
            "ppl_change_pct": round(100.0 * (p_q - p_ref) / p_ref, 3), "tokens": int(seqs.numel())}


def quantizer_summary(model: nn.Module) -> dict[str, int]:
    """{enabled quantizer kind: count} from a ModelOpt-quantized model (for the manifest)."""
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "TensorQuantizer" and getattr(m, "is_enabled", False):
            kind = name.rsplit(".", 1)[-1]
            out[kind] = out.get(kind, 0) + 1
    return out
