"""Loading and saving drafters: `load_drafter(path, target, dtype)` picks the drafter kind from config.json.

Owns: the checkpoint format of DSpark drafters (config.json + model.safetensors, no target weights
inside; bf16 on disk), validation with DrafterError messages, the vocabulary check against the target,
the target-fingerprint check, and `default_drafter_dir()` (the drafter shipped in dspark_trt/assets/).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dspark_trt.errors import DrafterError
from dspark_trt.runtime.drafters.config import ARCHITECTURE, DSparkConfig
from dspark_trt.runtime.drafters.dspark import DSparkDrafter, DSparkModel
from dspark_trt.runtime.drafters.lm import LMDrafter
from dspark_trt.runtime.drafters.vocab import VocabInfo, check_same_vocabulary, target_fingerprint, vocab_info

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
DEFAULT_DRAFTER = "dspark-smollm2-135m"


def default_drafter_dir() -> Path:
    """The DSpark drafter shipped for the default target (SmolLM2-135M-Instruct)."""
    path = Path(__file__).resolve().parents[2] / "assets" / DEFAULT_DRAFTER
    if not (path / "config.json").is_file():
        raise DrafterError(f"The shipped default drafter is missing at {path}. Fix: reinstall dspark_trt "
                           "(package data dspark_trt/assets/) or train one with `dspark-trt train-drafter`.")
    return path


def target_weights(target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [V, d], lm_head [V, d]) of a runtime CausalLM or a Hugging Face causal LM."""
    if hasattr(target, "lm_head_weight") and hasattr(target, "embed_tokens"):
        embed, head = target.embed_tokens.weight, target.lm_head_weight
        tied = bool(getattr(target.config, "tie_word_embeddings", False))
    else:
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        tied = bool(getattr(target.config, "tie_word_embeddings", False))
    if not torch.is_floating_point(head) or head.shape != embed.shape:
        if not tied:
            raise DrafterError("The target's lm_head is quantized and not tied to its embeddings, so a DSpark "
                               "drafter cannot share it. Fix: keep lm_head unquantized in the target build.")
        head = embed
    return embed, head


def _target_vocab_size(target: Any) -> int:
    return int(target.config.vocab_size)


def save_dspark(model: DSparkModel, directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors (drafter weights only, in `dtype`; buffers d2t kept exact)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(dtype) if torch.is_floating_point(v) else v.detach()).contiguous().cpu()
             for k, v in model.state_dict().items()}
    model.cfg.replace(torch_dtype=str(dtype).removeprefix("torch.")).save(directory)
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt", "architecture": ARCHITECTURE})
    return directory


def load_dspark_model(directory: Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DSparkModel:
    """DSparkModel from a checkpoint dir (no target attached yet)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = DSparkConfig.load(directory)
    path = directory / WEIGHTS
    if not path.is_file():
        raise DrafterError(f"No {WEIGHTS} in drafter directory {directory}. Fix: copy the weights next to config.json.")
    try:
        state = load_file(str(path))
    except Exception as exc:
        raise DrafterError(f"Cannot read {path} ({exc}); the file is truncated or corrupt. Fix: restore it.") from exc
    model = DSparkModel(cfg)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise DrafterError(f"Drafter weights in {path} do not match its config.json (missing {missing[:5]}, "
                           f"unexpected {extra[:5]}). Fix: use the config.json written with these weights.")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise DrafterError(f"Drafter tensor {k} has shape {tuple(v.shape)}, config implies {tuple(own[k].shape)}. "
                               "Fix: use the config.json written with these weights.")
    model.load_state_dict({k: (v.to(dtype) if torch.is_floating_point(v) else v) for k, v in state.items()})
    return model.to(device=device, dtype=dtype)


def _check_dspark_target(cfg: DSparkConfig, target: Any, embed: torch.Tensor, target_dir: Path | None) -> None:
    check_same_vocabulary(VocabInfo(size=cfg.vocab_size), VocabInfo(size=_target_vocab_size(target)))
    if target_dir is not None and cfg.target_vocab:
        check_same_vocabulary(VocabInfo.from_dict(cfg.target_vocab), vocab_info(target_dir))
    n_layers = int(getattr(target.config, "num_layers", getattr(target.config, "num_hidden_layers", 0)))
    if n_layers and max(cfg.target_layer_ids) >= n_layers:
        raise DrafterError(f"The drafter taps target layers {list(cfg.target_layer_ids)} but the target has "
                           f"{n_layers} layers. Fix: use a drafter trained for this target.")
    if cfg.target_fingerprint and cfg.target_fingerprint != target_fingerprint(embed):
        log.warning("Drafter was trained for a different target checkpoint (fingerprint %s ≠ %s): output stays "
                    "lossless but acceptance may be low.", cfg.target_fingerprint, target_fingerprint(embed))


def load_drafter(path: Path, target: Any, dtype: torch.dtype = torch.bfloat16,
                 target_dir: Path | None = None, gamma: int | None = None) -> DSparkDrafter | LMDrafter:
    """A Drafter for `target` (runtime CausalLM, or HF model for DSpark) from checkpoint dir `path`.

    DSpark drafter when config.architectures contains "DSparkDrafter"; otherwise an LM drafter (PARD
    one-pass when config has mask_token_id and pard: true). target_dir (the target's HF dir) enables the
    full tokenizer comparison; without it vocab sizes and special ids are compared.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"Drafter directory {path} has no config.json. Fix: pass a drafter checkpoint directory.")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"Cannot parse {cfg_path}: {exc}. Fix: restore the file.") from exc
    device = target_weights(target)[0].device
    if ARCHITECTURE in (raw.get("architectures") or []):
        model = load_dspark_model(path, dtype=dtype, device=device)
        embed, head = target_weights(target)
        _check_dspark_target(model.cfg, target, embed, target_dir)
        model.attach_target(embed, head)
        return DSparkDrafter(model)
    # plain causal LM
    if target_dir is not None:
        check_same_vocabulary(path, target_dir)
    else:
        check_same_vocabulary(VocabInfo.from_config(raw), VocabInfo.from_config(target.config))
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint

    lm = load_hf_checkpoint(path, dtype=dtype)
    pard = bool(raw.get("pard", False))
    g = gamma or int(raw.get("block_size", raw.get("pard_gamma", 7)))
    return LMDrafter(lm.to(device), gamma=g, pard=pard, mask_token_id=raw.get("mask_token_id"))
