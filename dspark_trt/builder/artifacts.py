"""Load what `dspark-trt build` produced, in process: `load_built_pair(build_dir) -> BuiltPair`.

Owns: reading build/NAME/manifest.json (the BuildOptions), the target's exported TRT-LLM checkpoint into the
runtime CausalLM (runtime.trtllm_checkpoint), the draft's exported checkpoint into a Drafter (an LMDrafter
over a CausalLM, or a DSparkDrafter rebuilt from the "DSparkDrafter" checkpoint with quantized linears
swapped in), and the tokenizer copied into build/NAME/tokenizer. Must not run any build stage.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError, CheckpointError

log = logging.getLogger(__name__)


@dataclass
class BuiltPair:
    target: nn.Module  # runtime.model.CausalLM
    drafter: Any  # spec_decode.protocols.Drafter
    tokenizer: Any  # transformers tokenizer
    options: BuildOptions
    manifest: dict[str, Any]


def read_manifest(build_dir: Path) -> dict[str, Any]:
    path = Path(build_dir) / "manifest.json"
    if not path.is_file():
        raise BuildError(f"{build_dir} is not a finished build (no manifest.json); run `dspark-trt build --output "
                         f"{build_dir}` first.")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BuildError(f"{path} is unreadable ({e}); rerun `dspark-trt build --output {build_dir}`.") from e


def load_dspark_export(ckpt: Path, target: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
    """A DSparkDrafter from an exported "DSparkDrafter" TRT-LLM-form checkpoint (quantized linears included)."""
    from safetensors.torch import load_file

    from dspark_trt.runtime.drafters import DSparkConfig, DSparkDrafter, DSparkModel, target_weights
    from dspark_trt.runtime.quant_linear import QUANT_LINEARS

    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("architecture") != "DSparkDrafter":
        raise CheckpointError(f"{ckpt} holds a {cfg.get('architecture')} checkpoint, not a DSparkDrafter.")
    dcfg = DSparkConfig.from_dict(cfg["dspark"]["drafter_config"])
    try:
        raw = load_file(str(ckpt / "rank0.safetensors"))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"Cannot read {ckpt / 'rank0.safetensors'} ({e}); rebuild with `dspark-trt build`.") from e
    state = {k.removeprefix("dspark."): v for k, v in raw.items()}
    model = DSparkModel(dcfg).to(dtype)  # before swapping: .to(dtype) would also cast fp8 buffers
    algo = (cfg.get("quantization") or {}).get("quant_algo")
    for name in cfg["dspark"].get("quantized_modules") or []:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, leaf)
        q = QUANT_LINEARS[algo](lin.in_features, lin.out_features, lin.bias is not None, dtype)
        setattr(parent, leaf, q)
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise CheckpointError(f"{ckpt} does not match its DSparkDrafter config (missing {missing[:4]}, unexpected "
                              f"{extra[:4]}); rebuild with `dspark-trt build`.")
    with torch.no_grad():
        for k, t in state.items():
            dst = own[k]
            if dst.shape != t.shape:
                raise CheckpointError(f"{ckpt}: tensor {k} has shape {tuple(t.shape)}, the drafter config implies "
                                      f"{tuple(dst.shape)}; rebuild with `dspark-trt build`.")
            dst.copy_(t.to(dst.dtype))
    model = model.to(device).eval()
    embed, head = target_weights(target)
    model.attach_target(embed, head)
    return DSparkDrafter(model)


def _lm_drafter(ckpt: Path, opts: BuildOptions, dtype: torch.dtype, device: torch.device | str) -> Any:
    from dspark_trt.runtime.drafters import LMDrafter
    from dspark_trt.runtime.trtllm_checkpoint import load_trtllm_checkpoint

    cfg = json.loads((ckpt / "config.json").read_text())
    hf = (cfg.get("dspark") or {}).get("hf_config") or {}
    lm = load_trtllm_checkpoint(ckpt, dtype=dtype, device=device)
    return LMDrafter(lm, gamma=opts.gamma, pard=bool(hf.get("pard", False)), mask_token_id=hf.get("mask_token_id"))


def load_built_pair(build_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> BuiltPair:
    """Target CausalLM + Drafter + tokenizer + BuildOptions of a finished build (runs in the reference runtime)."""
    from transformers import AutoTokenizer

    from dspark_trt.runtime.trtllm_checkpoint import STR_DTYPES, load_trtllm_checkpoint

    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    opts = BuildOptions.from_dict(manifest.get("options") or manifest.get("spec") or {})  # older manifests: "spec"
    tckpt, dckpt = build_dir / "target" / "checkpoint", build_dir / "draft" / "checkpoint"
    for p in (tckpt, dckpt, build_dir / "tokenizer"):
        if not p.is_dir():
            raise BuildError(f"{p} is missing: the build in {build_dir} is incomplete; rerun `dspark-trt build --output "
                             f"{build_dir}`.")
    dt = dtype or STR_DTYPES[opts.dtype]
    target = load_trtllm_checkpoint(tckpt, dtype=dt, device=device)
    dcfg = json.loads((dckpt / "config.json").read_text())
    if dcfg.get("architecture") == "DSparkDrafter":
        drafter = load_dspark_export(dckpt, target, dt, device)
    else:
        drafter = _lm_drafter(dckpt, opts, dt, device)
    tok = AutoTokenizer.from_pretrained(str(build_dir / "tokenizer"))
    log.info("loaded built pair from %s (quant %s, γ=%d)", build_dir, opts.quant, opts.gamma)
    return BuiltPair(target, drafter, tok, opts, manifest)
