"""Stage 3, export: TensorRT-LLM checkpoints (config.json + rank{N}.safetensors) for target and draft.

Owns:
- Llama-family models (Llama, Mistral → decoder "llama"; Qwen2 → "qwen"): ModelOpt's
  export_tensorrt_llm_checkpoint (quantized or not, float16/bfloat16, inference_tensor_parallel = TP),
  then `patch_config`: ModelOpt 0.47 + transformers 5 drop rope_theta (it moved into rope_parameters),
  so rotary_base / rotary_scaling / tie_word_embeddings / attn_bias / mlp_bias (and qwen_type for Qwen2)
  are written from the HF config, plus a `dspark` section (HF config, generation config, tool versions, the version catch).
- --dtype float32 (unquantized only): our own writer (`write_unquantized`), because ModelOpt 0.47 writes
  float16 when asked for float32; same tensor names and config keys as ModelOpt's (tested).
- The DSpark drafter (not a TRT-LLM architecture): `export_dspark`, architecture "DSparkDrafter",
  tensors named "dspark." + the DSparkModel state-dict name; ModelOpt-quantized linears as TRT-LLM
  quantized tensors (weight int8/fp8, weights_scaling_factor, activation_scaling_factor,
  prequant_scaling_factor). Always tp 1 (TRT-LLM's draft/target example allows a different draft TP).
Must not import tensorrt_llm.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.tp import shard_state
from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DECODER_TYPE: dict[str, str] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen"}
TRTLLM_PINNED_MODELOPT = "0.37"  # tensorrt-llm 1.2.1 requires nvidia-modelopt~=0.37.0
VERSION_CATCH = ("Exported with nvidia-modelopt {mo}; TensorRT-LLM 1.2.1 pins nvidia-modelopt~=0.37.0 and "
                 "transformers==4.57.3. ModelOpt 0.37 has no INT8_WEIGHT_ONLY_CFG and labels every int8 export "
                 "W8A8_SQ_PER_CHANNEL; whether trtllm-build 1.2.1 accepts this checkpoint as written is unverified "
                 "(no TensorRT-LLM here). Extra tensors it may warn about: k_cache_scaling_factor, "
                 "v_cache_scaling_factor.")


def _read_json(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text()) if p.is_file() else {}


def rope_fields(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rotary_base, rotary_scaling) from a transformers 4 or 5 HF config dict."""
    rp = dict(hf.get("rope_parameters") or {})
    base = float(rp.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.update(rp)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return base, None
    scaling.setdefault("type", kind)
    return base, scaling


def patch_config(ckpt: Path, hf_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Add what ModelOpt 0.47 leaves out of config.json (see module docstring); returns the new config."""
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    hf = _read_json(hf_dir / "config.json")
    base, scaling = rope_fields(hf)
    cfg["rotary_base"] = base
    cfg["rotary_scaling"] = scaling
    cfg["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if cfg.get("architecture") == "Qwen2ForCausalLM":
        # tensorrt_llm/models/qwen/config.py: QWenConfig reads qwen_type (default path would be Qwen1) and
        # attn_bias (q/k/v bias) — ModelOpt 0.47 writes neither (and writes "bias": false).
        cfg["qwen_type"] = hf.get("model_type", "qwen2")
        cfg["attn_bias"] = True
    else:
        cfg["attn_bias"] = bool(hf.get("attention_bias", False))
    cfg["mlp_bias"] = bool(hf.get("mlp_bias", False))
    cfg["dspark"] = {"hf_config": hf, "generation_config": _read_json(hf_dir / "generation_config.json") or None,
                     **extra}
    path.write_text(json.dumps(cfg, indent=4) + "\n")
    return cfg


def export_modelopt(model: nn.Module, arch: str, hf_dir: Path, out: Path, opts: BuildOptions,
                    extra: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt export of a (quantized) HF Llama-family model; returns the patched config."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    if arch not in DECODER_TYPE:
        raise BuildError(f"No ModelOpt TensorRT-LLM exporter mapping for {arch}; supported: {', '.join(DECODER_TYPE)}.")
    if opts.dtype == "float32":
        raise BuildError("ModelOpt's TensorRT-LLM exporter writes float16 when asked for float32; use --dtype "
                         "bfloat16|float16 with --quant, or --quant none for a float32 checkpoint.")
    out.mkdir(parents=True, exist_ok=True)
    from dspark_trt.builder.quantize import _quietly

    with torch.inference_mode():
        _quietly(lambda: export_tensorrt_llm_checkpoint(model, decoder_type=DECODER_TYPE[arch],
                                                        dtype=DTYPES[opts.dtype], export_dir=str(out),
                                                        inference_tensor_parallel=opts.tp_size))
    stray = out / "quant_cfg.json"  # ModelOpt writes it for tp > 1; TRT-LLM reads it only for MIXED_PRECISION
    if stray.is_file():
        stray.unlink()
    return patch_config(out, hf_dir, extra)


def trtllm_config_from_hf(hf: dict[str, Any], dtype: str, tp_size: int, arch: str) -> dict[str, Any]:
    """A TRT-LLM PretrainedConfig dict (the keys ModelOpt writes) for an unquantized HF Llama-family config."""
    heads = int(hf["num_attention_heads"])
    return {
        "producer": {"name": "dspark_trt", "version": "0.1.0"},
        "architecture": arch, "dtype": dtype, "logits_dtype": "float32" if dtype == "float32" else dtype,
        "num_hidden_layers": int(hf["num_hidden_layers"]), "num_attention_heads": heads,
        "num_key_value_heads": int(hf.get("num_key_value_heads") or heads), "hidden_size": int(hf["hidden_size"]),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)), "vocab_size": int(hf["vocab_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)), "hidden_act": hf.get("hidden_act", "silu"),
        "use_parallel_embedding": True, "embedding_sharding_dim": 0,
        "head_size": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "intermediate_size": int(hf["intermediate_size"]), "position_embedding_type": "rope_gpt_neox",
        "share_embedding_table": False, "residual_mlp": False,
        "bias": arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)), "rotary_pct": 1.0,
        "rank": 0, "decoder": DECODER_TYPE.get(arch, "llama"), "rmsnorm": True, "lm_head_bias": False,
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }


def write_unquantized(hf_dir: Path, arch: str, out: Path, opts: BuildOptions, extra: dict[str, Any]) -> dict[str, Any]:
    """Our own exact writer for unquantized checkpoints (any dtype; used for float32)."""
    from safetensors.torch import save_file

    from dspark_trt.runtime.hf_loader import _read_tensors, _weight_files, hf_to_trtllm_names, load_config

    mcfg = load_config(hf_dir)
    hf: dict[str, torch.Tensor] = {}
    for f in _weight_files(hf_dir):
        hf.update(_read_tensors(f))
    state = hf_to_trtllm_names(hf, mcfg, str(hf_dir))
    dt = DTYPES[opts.dtype]
    if mcfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["transformer.vocab_embedding.weight"]
    state = {k: v.to(dt).contiguous() for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    cfg = trtllm_config_from_hf(_read_json(hf_dir / "config.json"), opts.dtype, opts.tp_size, arch)
    out.mkdir(parents=True, exist_ok=True)
    for r, st in enumerate(shard_state(state, cfg, opts.tp_size)):
        save_file({k: v.contiguous() for k, v in st.items()}, str(out / f"rank{r}.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    return patch_config(out, hf_dir, extra)


def quantized_linear_tensors(module: nn.Module, quant: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """TRT-LLM tensors of one ModelOpt-quantized linear (same helpers ModelOpt's own exporter uses)."""
    from modelopt.torch.export.quant_utils import (get_activation_scaling_factor, get_prequant_scaling_factor,
                                                   get_weight_scaling_factor, to_quantized_weight)

    fmt = {"fp8": "fp8", "int8_sq": "int8_sq", "w8a16": "int8_wo"}[quant]
    w = module.weight.detach().float()
    ws = get_weight_scaling_factor(module)
    out = {"weight": to_quantized_weight(w, ws, fmt), "weights_scaling_factor": ws.float().reshape(-1)}
    if quant in ("fp8", "int8_sq"):
        out["activation_scaling_factor"] = get_activation_scaling_factor(module).float().reshape(1)
    if quant == "int8_sq":
        pre = get_prequant_scaling_factor(module)
        if pre is not None:
            out["prequant_scaling_factor"] = pre.to(dtype).reshape(-1)
    if getattr(module, "bias", None) is not None:
        out["bias"] = module.bias.detach().to(dtype)
    return out


def export_dspark(model: nn.Module, out: Path, opts: BuildOptions, quantized: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """The DSpark drafter in TRT-LLM checkpoint form (see module docstring); returns its config."""
    from safetensors.torch import save_file

    dt = DTYPES[opts.dtype]
    cfg_d = model.cfg.to_dict()
    state: dict[str, torch.Tensor] = {}
    qnames: list[str] = []
    for name, mod in model.named_modules():
        if quantized and type(mod).__name__.startswith("Quant") and hasattr(mod, "weight_quantizer") \
                and getattr(mod.weight_quantizer, "is_enabled", False):
            for k, t in quantized_linear_tensors(mod, opts.quant, dt).items():
                state[f"dspark.{name}.{k}"] = t.contiguous()
            qnames.append(name)
    qset = set(qnames)
    for k, t in model.state_dict().items():
        mod_name, _, leaf = k.rpartition(".")
        if mod_name in qset or "_quantizer" in k or "_pre_quant_scale" in k or "_amax" in k:
            continue
        state[f"dspark.{k}"] = (t.detach().to(dt) if torch.is_floating_point(t) else t.detach()).contiguous()
    cfg = {
        "producer": {"name": "dspark_trt", "version": "0.1.0"},
        "architecture": "DSparkDrafter", "dtype": opts.dtype, "logits_dtype": "float32",
        "vocab_size": cfg_d["vocab_size"], "hidden_size": cfg_d["hidden_size"],
        "num_hidden_layers": cfg_d["num_hidden_layers"], "num_attention_heads": cfg_d["num_attention_heads"],
        "num_key_value_heads": cfg_d["num_key_value_heads"], "head_size": cfg_d["head_dim"],
        "intermediate_size": cfg_d["intermediate_size"], "hidden_act": "silu", "norm_epsilon": cfg_d["rms_norm_eps"],
        "position_embedding_type": "rope_gpt_neox", "rotary_base": cfg_d["rope_theta"], "rotary_scaling": None,
        "max_position_embeddings": cfg_d["max_position_embeddings"],
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": opts.quant_algo if quantized else None, "kv_cache_quant_algo": None,
                         "exclude_modules": [n for n, m in model.named_modules()
                                             if isinstance(m, nn.Linear) and n not in qset] if quantized else None},
        "dspark": {"drafter_config": cfg_d, "quantized_modules": qnames, **extra},
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "rank0.safetensors"), metadata={"format": "pt", "architecture": "DSparkDrafter"})
    (out / "config.json").write_text(json.dumps(cfg, indent=4, default=str) + "\n")
    return cfg
