"""The TensorRT-LLM ≥ 1.4 path of a DSpark pair: the LLM-API configuration (PyTorch runtime, no engines) that
`dspark-trt build` writes next to the 1.2.x engine plan, into build/NAME/engines/llmapi/.

Owns `dspark_decoding_config` (the `speculative_config` mapping: DSparkDecodingConfig fields from the drafter's config
and the build's policy, with our survival cost table), `COST_TABLE_SCHEMA` (its JSON schema), `write_llmapi`
(extra_llm_api_options.yaml, dspark_decoding_config.json, cost_table.schema.json, trtllm_serve.sh and the drafter in
the Hugging Face layout that runtime reads: drafter/config.json + drafter/model.safetensors).

What was verified: DecodingBaseConfig (tensorrt_llm/llmapi/llm_args.py, 1.x) dispatches `speculative_config` on
`decoding_type` in from_dict and names the drafter `speculative_model` (alias `speculative_model_dir`) with
`max_draft_len`; `trtllm-serve serve MODEL --backend pytorch --extra_llm_api_options YAML` reads those LLM-API
options. DSparkDecodingConfig itself (≥ 1.3) is NOT in the stored source index: its decoding_type "DSpark" and the
field names below follow the DSpark integration's published field list and are unverified against a 1.4 install.
Must not import tensorrt_llm (nothing here runs it).
"""
from __future__ import annotations

import json
import logging
import shlex
import shutil
from pathlib import Path
from typing import Any

from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

__all__ = ["COST_TABLE_SCHEMA", "DECODING_TYPE", "LLMAPI_FIELDS", "cost_table_fields", "dspark_decoding_config",
           "trtllm_serve_command", "write_llmapi"]

DECODING_TYPE = "DSpark"
# every key dspark_decoding_config writes (tests compare against this list)
LLMAPI_FIELDS: tuple[str, ...] = (
    "decoding_type", "speculative_model", "max_draft_len", "mask_token_id", "target_layer_ids", "block_size",
    "markov_rank", "markov_head_type", "confidence_scheduling", "confidence_min_k", "confidence_max_k",
    "confidence_low", "confidence_high", "token_counts", "step_time_ms", "fixed_overhead_ms", "batch_sizes",
    "batch_overhead_ms")
COST_TABLE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "DSpark confidence-scheduling cost table",
    "description": "Target step time by verify-batch token count, and the drafter pass's cost by drafted rows "
                   "(spec_decode.scheduler.CostTable: step_time_ms = 1000 · seconds(token_counts); "
                   "fixed_overhead_ms = the drafter pass's fixed cost; batch_overhead_ms[i] = its cost at "
                   "batch_sizes[i] rows).",
    "type": "object",
    "required": ["token_counts", "step_time_ms", "fixed_overhead_ms", "batch_sizes", "batch_overhead_ms"],
    "properties": {
        "token_counts": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        "step_time_ms": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 1},
        "fixed_overhead_ms": {"type": "number", "minimum": 0},
        "batch_sizes": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        "batch_overhead_ms": {"type": "array", "items": {"type": "number", "minimum": 0}, "minItems": 1},
    },
    "additionalProperties": False,
}


def cost_table_fields(opts: BuildOptions) -> dict[str, Any]:
    """The survival cost table (--cost-table JSON, else CostTable.linear's relative defaults read as ms) →
    token_counts / step_time_ms / fixed_overhead_ms / batch_sizes / batch_overhead_ms."""
    from dspark_trt.spec_decode.scheduler import CostTable  # noqa: PLC0415 - torch only when building

    table = CostTable.from_json(opts.cost_table) if opts.cost_table else CostTable.linear(
        max_tokens=opts.max_batch_size * (opts.gamma + 1))
    sizes = sorted({1, *(2 ** i for i in range(1, opts.max_batch_size.bit_length())), opts.max_batch_size})
    return {"token_counts": list(table.tokens), "step_time_ms": [round(1000 * s, 6) for s in table.seconds],
            "fixed_overhead_ms": round(1000 * table.draft_t0, 6), "batch_sizes": sizes,
            "batch_overhead_ms": [round(1000 * table.draft_seconds(n), 6) for n in sizes]}


def dspark_decoding_config(opts: BuildOptions, drafter_cfg: dict[str, Any], speculative_model: str) -> dict[str, Any]:
    """The speculative_config mapping for DSparkDecodingConfig (LLM API, PyTorch runtime)."""
    missing = [k for k in ("target_layer_ids", "block_size", "mask_token_id") if drafter_cfg.get(k) is None]
    if missing:
        raise BuildError(f"the DSpark drafter config lacks {', '.join(missing)}; the LLM-API DSpark config needs "
                         "them. Fix: use a drafter checkpoint written by `dspark-trt train-drafter`.")
    block = int(drafter_cfg["block_size"])
    if opts.gamma > block:
        raise BuildError(f"--max-draft-len {opts.gamma} exceeds the drafter's block_size {block}; pass "
                         f"--max-draft-len ≤ {block}.")
    cfg: dict[str, Any] = {
        "decoding_type": DECODING_TYPE,
        "speculative_model": speculative_model,
        "max_draft_len": opts.gamma,
        "mask_token_id": int(drafter_cfg["mask_token_id"]),
        "target_layer_ids": [int(t) for t in drafter_cfg["target_layer_ids"]],
        "block_size": block,
        "markov_rank": int(drafter_cfg.get("markov_rank") or 0),
        "markov_head_type": str(drafter_cfg.get("markov_head_type") or "none"),
        "confidence_scheduling": opts.policy in ("confidence", "survival")
        and bool(drafter_cfg.get("enable_confidence_head", False)),
        "confidence_min_k": opts.min_k, "confidence_max_k": opts.effective_max_k,
        "confidence_low": 0.3, "confidence_high": 0.7,  # spec_decode.scheduler.PolicyConfig defaults
        **cost_table_fields(opts),
    }
    assert tuple(cfg) == LLMAPI_FIELDS
    return cfg


def trtllm_serve_command(target: str, options_yaml: str, opts: BuildOptions, port: int = 8000) -> list[str]:
    """`trtllm-serve serve` over the Hugging Face target with the DSpark speculative_config."""
    return ["trtllm-serve", "serve", target, "--backend", "pytorch", "--max_batch_size", str(opts.max_batch_size),
            "--max_seq_len", str(opts.max_seq_len), "--tp_size", str(opts.tp_size), "--host", "0.0.0.0",
            "--port", str(port), "--extra_llm_api_options", options_yaml]


def _yaml(data: dict[str, Any], indent: int = 0) -> list[str]:
    """A small YAML writer for the options file (mappings, scalars, flat lists): no PyYAML needed to build."""
    out: list[str] = []
    pad = " " * indent
    for k, v in data.items():
        if isinstance(v, dict):
            out += [f"{pad}{k}:"] + _yaml(v, indent + 2)
        elif isinstance(v, (list, tuple)):
            out.append(f"{pad}{k}: [{', '.join(json.dumps(x) for x in v)}]")
        else:
            out.append(f"{pad}{k}: {json.dumps(v)}")
    return out


def write_llmapi(dest: Path, opts: BuildOptions, build_dir: Path, drafter_dir: Path) -> dict[str, Any]:
    """engines/llmapi/: the drafter (HF layout), the options YAML, the config JSON + cost-table schema and
    trtllm_serve.sh. Returns manifest facts."""
    drafter_dir = Path(drafter_dir)
    cfg_file = drafter_dir / "config.json"
    weights = sorted(drafter_dir.glob("*.safetensors"))
    if not cfg_file.is_file() or not weights:
        raise BuildError(f"{drafter_dir} lacks config.json or *.safetensors; the LLM API reads the drafter in the "
                         "Hugging Face layout. Fix: pass the drafter directory `dspark-trt train-drafter` wrote.")
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "drafter").mkdir(parents=True)
    for f in [cfg_file, *weights]:
        shutil.copy2(f, dest / "drafter" / f.name)
    drafter_cfg = json.loads(cfg_file.read_text())
    spec = dspark_decoding_config(opts, drafter_cfg, str((dest / "drafter").resolve()))
    options = {"speculative_config": spec, "max_batch_size": opts.max_batch_size, "max_seq_len": opts.max_seq_len,
               "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.85}}
    (dest / "extra_llm_api_options.yaml").write_text(
        "# TensorRT-LLM >= 1.4 LLM-API options for this DSpark pair (written by `dspark-trt build`; docs/gpu.md)\n"
        + "\n".join(_yaml(options)) + "\n")
    (dest / "dspark_decoding_config.json").write_text(json.dumps(spec, indent=2) + "\n")
    (dest / "cost_table.schema.json").write_text(json.dumps(COST_TABLE_SCHEMA, indent=2) + "\n")
    target = _hf_target(build_dir)
    cmd = trtllm_serve_command(target, str((dest / "extra_llm_api_options.yaml").resolve()), opts)
    script = dest / "trtllm_serve.sh"
    script.write_text("#!/usr/bin/env bash\n# TensorRT-LLM >= 1.4 (PyTorch runtime): serve the target with the DSpark "
                      "drafter; nothing to compile.\nset -euo pipefail\n" + " ".join(shlex.quote(c) for c in cmd) + "\n")
    script.chmod(0o755)
    log.info("LLM-API DSpark config written to %s (TensorRT-LLM >= 1.4)", dest)
    return {"path": "engines/llmapi", "decoding_type": DECODING_TYPE, "speculative_model": "engines/llmapi/drafter",
            "target": target, "files": sorted(p.name for p in dest.iterdir()),
            "unverified": "DSparkDecodingConfig is not in the stored TensorRT-LLM sources; field names unverified"}


def _hf_target(build_dir: Path) -> str:
    """The Hugging Face target the PyTorch runtime loads: the build's input target directory (manifest inputs)."""
    try:
        data = json.loads((Path(build_dir) / "manifest.json").read_text())
        return str(data["inputs"]["target"]["path"])
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        raise BuildError(f"cannot read the target path from {build_dir}/manifest.json ({exc}); rerun the build") from exc
