"""Run an exported TensorRT-LLM checkpoint (config.json + rank{N}.safetensors) in the reference runtime.

Owns: reading a TRT-LLM checkpoint directory, turning its config.json into the runtime's ModelConfig,
reassembling tensor-parallel ranks into the unsharded tensors (`reassemble_ranks`, exact inverse of the
TRT-LLM/ModelOpt split: qkv per rank = [q_r | k_r | v_r]; column-parallel rows; row-parallel columns;
per-tensor scales replicated), choosing quantized linears from quantization.quant_algo, and loading
everything into `runtime.model.CausalLM`. KV-cache scales (k/v/kv_cache_scaling_factor) are kept on
the model as `kv_cache_scales`; the runtime's KV cache stays in the model dtype (docs/build.md).
Must not know about Hugging Face checkpoints (hf_loader) or the build stages.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from dspark_trt.errors import CheckpointError
from dspark_trt.runtime.config import ModelConfig
from dspark_trt.runtime.model import CausalLM
from dspark_trt.runtime.quant_linear import make_linear_factory

log = logging.getLogger(__name__)

STR_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_SCALE_KEYS = ("kv_cache_scaling_factor", "k_cache_scaling_factor", "v_cache_scaling_factor")
_COLUMN = re.compile(r"(mlp\.fc|mlp\.gate|lm_head|vocab_embedding)(\.|$)")
_ROW = re.compile(r"(attention\.dense|mlp\.proj)\.")


def read_checkpoint_config(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no config.json: it is not a TensorRT-LLM checkpoint; build one with "
                              f"`dspark-trt build`.")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); rebuild the checkpoint with `dspark-trt build`.") from e
    if "architecture" not in cfg:
        raise CheckpointError(f"{path} lacks `architecture`; it is not a TensorRT-LLM checkpoint config.")
    return cfg


def model_config_from_trtllm(cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a TRT-LLM PretrainedConfig dict; exact when the build stored the HF config."""
    hf = (cfg.get("dspark") or {}).get("hf_config")
    if hf:
        return ModelConfig.from_hf(hf, (cfg.get("dspark") or {}).get("generation_config"))
    rope: dict[str, Any] = {"rope_theta": float(cfg.get("rotary_base", 10000.0))}
    if cfg.get("rotary_scaling"):
        rope.update(cfg["rotary_scaling"])
    hf_like = {
        "architectures": [cfg["architecture"]], "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        "head_dim": cfg.get("head_size"), "rms_norm_eps": cfg.get("norm_epsilon", 1e-5),
        "hidden_act": cfg.get("hidden_act", "silu"), "rope_parameters": rope,
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", cfg.get("share_embedding_table", False))),
        "attention_bias": bool(cfg.get("attn_bias", cfg.get("bias", False))), "mlp_bias": bool(cfg.get("mlp_bias", False)),
    }
    return ModelConfig.from_hf(hf_like)


def _split_qkv(t: torch.Tensor, q: int, kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return t[:q], t[q:q + kv], t[q + kv:q + 2 * kv]


def reassemble_ranks(ranks: Sequence[dict[str, torch.Tensor]], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of TRT-LLM tensor-parallel sharding: rank state dicts → the unsharded state dict."""
    tp = len(ranks)
    if tp == 1:
        return dict(ranks[0])
    names = list(ranks[0])
    for r, st in enumerate(ranks[1:], 1):
        if set(st) != set(names):
            raise CheckpointError(f"rank{r}.safetensors holds different tensors than rank0 "
                                  f"({sorted(set(st) ^ set(names))[:4]}); rebuild the checkpoint.")
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    d = int(cfg.get("head_size") or cfg["hidden_size"] // heads)
    if heads % tp or kv_heads % tp:
        raise CheckpointError(f"Cannot reassemble tp={tp}: {heads} heads / {kv_heads} kv heads do not divide evenly.")
    q_r, kv_r = heads // tp * d, kv_heads // tp * d
    out: dict[str, torch.Tensor] = {}
    for name in names:
        parts = [st[name] for st in ranks]
        p0 = parts[0]
        per_tensor = p0.dim() == 0 or p0.numel() == 1
        if ".attention.qkv." in name and not per_tensor and not name.endswith("prequant_scaling_factor"):
            split = [_split_qkv(p, q_r, kv_r) for p in parts]
            out[name] = torch.cat([torch.cat([s[i] for s in split], 0) for i in range(3)], 0)
        elif "vocab_embedding" in name and not cfg.get("use_parallel_embedding", False):
            out[name] = p0
        elif "vocab_embedding" in name:
            out[name] = torch.cat(parts, int(cfg.get("embedding_sharding_dim", 0)))
        elif _COLUMN.search(name) and not per_tensor and not name.endswith("prequant_scaling_factor"):
            out[name] = torch.cat(parts, 0)
        elif _ROW.search(name) and name.endswith(".weight"):
            out[name] = torch.cat(parts, 1)
        elif _ROW.search(name) and name.endswith("prequant_scaling_factor"):
            out[name] = torch.cat(parts, 0)
        else:  # replicated: norms, per-tensor scales, row-parallel per-channel weight scales, biases of dense/proj
            for r, p in enumerate(parts[1:], 1):
                if p.shape != p0.shape or not torch.equal(p, p0):
                    raise CheckpointError(f"Replicated tensor {name} differs between rank0 and rank{r}; the "
                                          f"checkpoint is inconsistent: rebuild it.")
            out[name] = p0
    return out


def read_rank_files(ckpt: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    states = []
    for r in range(world_size):
        f = Path(ckpt) / f"rank{r}.safetensors"
        if not f.is_file():
            raise CheckpointError(f"{ckpt} declares world_size {world_size} but {f.name} is missing; rebuild the "
                                  f"checkpoint with `dspark-trt build`.")
        try:
            states.append(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors error types vary
            raise CheckpointError(f"Cannot read {f} ({type(e).__name__}: {e}); the file is corrupt or truncated: "
                                  f"rebuild the checkpoint.") from e
    return states


def load_checkpoint_state(ckpt: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, unsharded TRT-LLM state dict) of a checkpoint directory (all ranks reassembled)."""
    ckpt = Path(ckpt)
    cfg = read_checkpoint_config(ckpt)
    mapping = cfg.get("mapping") or {}
    world = int(mapping.get("world_size", 1))
    if int(mapping.get("pp_size", 1)) != 1:
        raise CheckpointError(f"{ckpt} is pipeline-parallel (pp_size {mapping.get('pp_size')}); the reference runtime "
                              f"loads tensor-parallel checkpoints only: rebuild with pp_size 1.")
    return cfg, reassemble_ranks(read_rank_files(ckpt, world), cfg)


def load_trtllm_checkpoint(ckpt: str | Path, dtype: torch.dtype | None = None,
                           device: torch.device | str = "cpu") -> CausalLM:
    """A Llama-family TRT-LLM checkpoint → CausalLM (quantized linears per quantization.quant_algo)."""
    cfg, state = load_checkpoint_state(ckpt)
    mcfg = model_config_from_trtllm(cfg)
    dtype = dtype or STR_DTYPES.get(str(cfg.get("dtype")), torch.float32)
    quant = cfg.get("quantization") or {}
    algo = quant.get("quant_algo")
    factory = make_linear_factory(algo, dtype, quant.get("exclude_modules") or ["lm_head"])
    kv_scales = {k: state.pop(k) for k in [k for k in state if k.rsplit(".", 1)[-1] in KV_SCALE_KEYS]}
    model = CausalLM(mcfg, dtype=dtype, linear_factory=factory)
    model.load_trtllm_state_dict(state, source=f"TensorRT-LLM checkpoint {ckpt}")
    model.kv_cache_scales = kv_scales  # type: ignore[attr-defined]
    model.kv_cache_quant_algo = quant.get("kv_cache_quant_algo")  # type: ignore[attr-defined]
    model.quant_algo = algo  # type: ignore[attr-defined]
    model.eval()
    log.info("loaded TRT-LLM checkpoint %s (%s, quant %s, kv %s, tp %s) as %s", ckpt, cfg["architecture"], algo,
             quant.get("kv_cache_quant_algo"), (cfg.get("mapping") or {}).get("tp_size", 1), dtype)
    return model.to(device)
