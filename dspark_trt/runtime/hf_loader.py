"""Load Hugging Face Llama-family checkpoints into the runtime's `CausalLM` (TRT-LLM layout).

Owns: reading config.json / generation_config.json, the safetensors (single file or sharded index)
or pytorch_model.bin weights, renaming HF tensors to TensorRT-LLM names (fused qkv, mlp.fc/gate/proj),
and turning every missing, truncated or unsupported input into a CheckpointError that names the
file and the fix. Must not know about TRT-LLM exported checkpoints (build/) or drafters.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from dspark_trt.errors import CheckpointError
from dspark_trt.runtime.config import ModelConfig
from dspark_trt.runtime.layers import LinearFactory
from dspark_trt.runtime.model import CausalLM

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "self_attn.o_proj": "attention.dense",
    "mlp.gate_proj": "mlp.fc",  # TRT-LLM: fc = the SiLU input
    "mlp.up_proj": "mlp.gate",
    "mlp.down_proj": "mlp.proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_layernorm",
}
_TOP_MAP = {
    "model.embed_tokens.weight": "transformer.vocab_embedding.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from path; CheckpointError naming the file when missing or unreadable."""
    if not path.is_file():
        raise CheckpointError(f"Missing {path.name} in {path.parent}: point to a Hugging Face checkpoint directory "
                              f"(one written by save_pretrained) that contains it.")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download or re-save the checkpoint.") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object; re-save the checkpoint.")
    return data


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a HF checkpoint dir (UnsupportedArchitectureError for non-Llama-family models)."""
    d = _checkpoint_dir(path)
    cfg = read_json(d / "config.json")
    gen = read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else None
    return ModelConfig.from_hf(cfg, gen)


def _checkpoint_dir(path: str | Path) -> Path:
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"Checkpoint directory {d} does not exist; pass the path of a Hugging Face "
                              f"checkpoint directory (config.json + *.safetensors).")
    return d


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{index} has an empty weight_map; re-save the checkpoint.")
        files = [d / s for s in shards]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"Missing weight shard {f.name} listed in {index}; re-download the checkpoint.")
        return files
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (d / name).is_file():
            return [d / name]
    raise CheckpointError(f"No weights in {d}: expected model.safetensors, model.safetensors.index.json or "
                          f"pytorch_model.bin; re-save the model with save_pretrained.")


def _read_tensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        if f.suffix == ".bin":
            return torch.load(f, map_location="cpu", weights_only=True)
        from safetensors.torch import load_file

        return load_file(str(f))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"Cannot read weights file {f} ({type(e).__name__}: {e}); the file is corrupt or "
                              f"truncated: re-download or re-save the checkpoint.") from e


def hf_to_trtllm_names(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Rename HF Llama/Qwen2 tensors to TRT-LLM names; q/k/v are concatenated into attention.qkv."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        if name in _TOP_MAP:
            out[_TOP_MAP[name]] = t
            continue
        m = _LAYER.match(name)
        if not m:
            if "rotary_emb" in name:
                continue
            out[name] = t  # surfaces as "unexpected" in the strict load
            continue
        i, rest = int(m.group(1)), m.group(2)
        mod, _, kind = rest.rpartition(".")
        if mod in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((i, kind), {})[mod[-6]] = t
        elif mod in _LAYER_MAP:
            out[f"transformer.layers.{i}.{_LAYER_MAP[mod]}.{kind}"] = t
        else:
            out[name] = t
    for (i, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"Layer {i} of {source} has only {sorted(parts)} of the q/k/v projection {kind}s; "
                                  f"the checkpoint is incomplete: re-download or re-save it.")
        out[f"transformer.layers.{i}.attention.qkv.{kind}"] = torch.cat((parts["q"], parts["k"], parts["v"]), dim=0)
    return out


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                       linear_factory: LinearFactory | None = None) -> CausalLM:
    """A HF checkpoint directory → CausalLM in `dtype` (weights renamed to TRT-LLM layout)."""
    d = _checkpoint_dir(path)
    cfg = load_config(d)
    hf: dict[str, torch.Tensor] = {}
    for f in _weight_files(d):
        hf.update(_read_tensors(f))
    model = CausalLM(cfg, dtype=dtype, linear_factory=linear_factory)
    model.load_trtllm_state_dict(hf_to_trtllm_names(hf, cfg, str(d)), source=f"checkpoint {d}")
    model.eval()
    log.info("loaded %s (%s, %d layers, %.1fM params) as %s", d, cfg.architecture, cfg.num_layers,
             model.num_parameters() / 1e6, dtype)
    return model


def load_tokenizer(path: str | Path):  # noqa: ANN201 - transformers.PreTrainedTokenizerBase
    """The checkpoint's HF tokenizer (CheckpointError naming the directory when it has none)."""
    d = _checkpoint_dir(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"Cannot load a tokenizer from {d} ({type(e).__name__}: {e}); the directory needs "
                              f"tokenizer.json / tokenizer_config.json (save the tokenizer with save_pretrained).") from e
