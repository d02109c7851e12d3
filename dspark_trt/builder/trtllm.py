"""Stage 4, engines: the ONLY module that imports tensorrt_llm (lazily, inside functions).

Owns: the BuildConfig / PluginConfig we ask of TensorRT-LLM 1.2.x for the target (speculative_decoding_mode
draft_tokens_external, max_draft_len = γ, paged KV cache, paged context FMHA, generation logits gathered)
and for an LM draft; the equivalent `trtllm-build` command lines; and, when tensorrt_llm 1.2.x is importable,
building the engines through the Python API (PretrainedConfig.from_json_file → MODEL_MAP[arch].from_checkpoint
per rank → tensorrt_llm.builder.build → Engine.save), one process per rank under `mpirun -n TP` (mpi4py).
Our TensorRT plugins (`dspark_trt.kernels.trt.register_all`) are registered first. Without
TensorRT-LLM the stage writes engines/build_engines.sh + engines/{target,draft}.build_config.json and
engines/NOT_BUILT.txt saying why; the pipeline then continues on the reference runtime.
DSpark pairs get the tapped target instead (role "target_taps", builder/trtllm_taps.py): no speculative mode, context
logits gathered, the drafter's tap layers marked as engine outputs; it is built through the Python API only
(`python3 -m dspark_trt.builder.trtllm ... --tap_layers`), since the tap list travels on the PretrainedConfig.
Every flag and key here is checked against TensorRT-LLM 1.2.1 names in tests/builder/trtllm_1_2_1_names.json.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.trtllm_taps import tap_output_names
from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

SUPPORTED_LINE = "1.2"
# tensorrt_llm.models.modeling_utils.SpeculativeDecodingMode is an IntFlag (NONE = 1, DRAFT_TOKENS_EXTERNAL = 2);
# TRT-LLM serialises it as its integer value and KVCacheType as its name in engine/build config JSON.
SPEC_MODE_VALUE: dict[str | None, int] = {None: 1, "draft_tokens_external": 2}
PLUGIN_REGISTRATION_MODULE = "dspark_trt.kernels.trt"  # register_all(arch) -> names
TOKENS_PER_BLOCK = 32


def trtllm_version() -> str | None:
    """Installed tensorrt_llm version, or None when it cannot be imported (TensorRT missing, no GPU...)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None
    try:
        mod = importlib.import_module("tensorrt_llm")
    except Exception as e:  # noqa: BLE001 - a broken install raises anything
        log.info("tensorrt_llm is installed but does not import (%s: %s)", type(e).__name__, e)
        return None
    return str(getattr(mod, "__version__", "unknown"))


def plugin_config(opts: BuildOptions, role: str, quant_algo: str | None) -> dict[str, Any]:
    """PluginConfig fields (TensorRT-LLM 1.2.1 names) for one engine."""
    pc: dict[str, Any] = {
        "dtype": opts.dtype,
        "gpt_attention_plugin": "auto",
        "gemm_plugin": "fp8" if quant_algo == "FP8" else ("auto" if quant_algo is None else None),
        "context_fmha": True,
        "use_paged_context_fmha": True,  # required for draft/target KV reuse (examples/draft_target_model)
        "paged_kv_cache": True,
        "tokens_per_block": TOKENS_PER_BLOCK,
        "remove_input_padding": True,
    }
    if opts.kv_quant == "fp8" and role in ("target", "target_taps"):
        pc["use_fp8_context_fmha"] = True
    if opts.tp_size > 1:
        pc["nccl_plugin"] = "auto"
    return pc


def build_config(opts: BuildOptions, role: str, quant_algo: str | None) -> dict[str, Any]:
    """BuildConfig fields (TensorRT-LLM 1.2.1 names) for the target or the LM draft engine."""
    target = role == "target"  # the draft/target recipe's target (external draft tokens)
    taps = role == "target_taps"  # the DSpark tapped target: blocks verified as context requests
    return {
        "max_input_len": opts.max_input_len + (opts.max_draft_len if taps else 0),  # sequence + d_1..d_K as context
        "max_seq_len": opts.max_seq_len,
        "max_batch_size": opts.max_batch_size,
        "max_beam_width": 1,
        "max_num_tokens": opts.max_batch_size * (opts.max_draft_len + 1) + opts.max_input_len,
        "kv_cache_type": "paged",
        "gather_context_logits": taps,
        "gather_generation_logits": target,
        "max_draft_len": opts.max_draft_len if target else 0,
        "speculative_decoding_mode": "draft_tokens_external" if target else None,
        "strongly_typed": True,
        "plugin_config": plugin_config(opts, role, quant_algo),
    }


def build_config_json(opts: BuildOptions, role: str, quant_algo: str | None) -> dict[str, Any]:
    """build_config() as TensorRT-LLM's BuildConfig.from_dict / `trtllm-build --build_config` read it."""
    bc = build_config(opts, role, quant_algo)
    bc["speculative_decoding_mode"] = SPEC_MODE_VALUE[bc["speculative_decoding_mode"]]
    bc["kv_cache_type"] = bc["kv_cache_type"].upper()
    return bc


def _flag_value(v: Any) -> str:
    if v is True:
        return "enable"
    if v is False or v is None:
        return "disable"
    return str(v)


def tap_facts(taps: Sequence[int]) -> dict[str, Any]:
    """Manifest facts of the tapped target: the layers and their engine output names."""
    return {"target_engine": "tapped", "tap_layers": [int(t) for t in taps], "tap_outputs": list(tap_output_names(taps)),
            "verify": "context request over sequence + draft, context logits (no speculative_decoding_mode)"}


def tapped_build_command(ckpt: Path, engine_dir: Path, build_config_file: Path, opts: BuildOptions,
                         taps: Sequence[int]) -> list[str]:
    """The Python-API build of the tapped target (this module's __main__), under mpirun for tp > 1."""
    argv = ["python3", "-m", "dspark_trt.builder.trtllm", "--checkpoint_dir", str(ckpt), "--output_dir", str(engine_dir),
            "--build_config", str(build_config_file), "--tap_layers", ",".join(str(int(t)) for t in taps)]
    return (["mpirun", "-n", str(opts.tp_size), "--allow-run-as-root"] + argv) if opts.tp_size > 1 else argv


def trtllm_build_command(ckpt: Path, engine_dir: Path, opts: BuildOptions, role: str, quant_algo: str | None) -> list[str]:
    """`trtllm-build` argv equivalent to build_config() (flag names as in tensorrt_llm/commands/build.py)."""
    bc = build_config(opts, role, quant_algo)
    argv = ["trtllm-build", "--checkpoint_dir", str(ckpt), "--output_dir", str(engine_dir),
            "--max_batch_size", str(bc["max_batch_size"]), "--max_input_len", str(bc["max_input_len"]),
            "--max_seq_len", str(bc["max_seq_len"]), "--max_num_tokens", str(bc["max_num_tokens"]),
            "--max_beam_width", "1", "--kv_cache_type", "paged"]
    if bc["speculative_decoding_mode"]:
        argv += ["--speculative_decoding_mode", bc["speculative_decoding_mode"], "--max_draft_len", str(bc["max_draft_len"])]
    if bc["gather_generation_logits"]:
        argv += ["--gather_generation_logits"]
    if bc["gather_context_logits"]:
        argv += ["--gather_context_logits"]
    pc = bc["plugin_config"]
    for key in ("gpt_attention_plugin", "gemm_plugin", "context_fmha", "use_paged_context_fmha", "tokens_per_block",
                "remove_input_padding", "use_fp8_context_fmha", "nccl_plugin"):
        if key in pc and key != "paged_kv_cache":
            argv += [f"--{key}", _flag_value(pc[key])]
    argv += ["--workers", str(opts.tp_size)]
    return argv


def write_engine_plan(engines: Path, opts: BuildOptions, target_ckpt: Path, draft_ckpt: Path, draft_kind: str,
                      target_algo: str | None, draft_algo: str | None, reason: str,
                      taps: Sequence[int] = ()) -> dict[str, Any]:
    """engines/build_engines.sh + {target,draft}.build_config.json + NOT_BUILT.txt; returns manifest facts."""
    engines.mkdir(parents=True, exist_ok=True)
    root = engines.parent

    def rel(p: Path) -> str:
        p = Path(p)
        return "$BUILD_DIR/" + str(p.relative_to(root)) if p.is_relative_to(root) else str(p)

    lines = ["#!/usr/bin/env bash",
             "# TensorRT-LLM 1.2.x engines for this build (run on a GPU host with tensorrt-llm 1.2.x installed).",
             f"# Written by `dspark-trt build` because engines were not built here: {reason}",
             "set -euo pipefail", 'BUILD_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"', ""]
    facts: dict[str, Any] = {"built": False, "reason": reason, "script": "engines/build_engines.sh",
                             "build_configs": ["engines/target.build_config.json"]}
    if draft_kind == "dspark":
        (engines / "target.build_config.json").write_text(
            json.dumps(build_config_json(opts, "target_taps", target_algo), indent=2) + "\n")
        cmd = tapped_build_command(Path(rel(target_ckpt)), Path("$BUILD_DIR/engines/target"),
                                   Path("$BUILD_DIR/engines/target.build_config.json"), opts, taps)
        lines += ["# target: the tapped target (DSpark): the drafter's tap layers as engine outputs "
                  f"{', '.join(tap_output_names(taps))};",
                  "# blocks are verified as context requests (context logits), built through the TensorRT-LLM Python API",
                  " ".join(shlex.quote(c) if "$" not in c else f'"{c}"' for c in cmd), ""]
        facts.update(tap_facts(taps))
    else:
        (engines / "target.build_config.json").write_text(json.dumps(build_config_json(opts, "target", target_algo), indent=2) + "\n")
        cmd = trtllm_build_command(Path("CKPT"), Path("OUT"), opts, "target", target_algo)
        cmd[2], cmd[4] = rel(target_ckpt), "$BUILD_DIR/engines/target"
        lines += ["# target: verifies up to γ = max_draft_len external draft tokens per step",
                  " ".join(shlex.quote(c) if not c.startswith("$") else f'"{c}"' for c in cmd), ""]
    if draft_kind == "lm":
        (engines / "draft.build_config.json").write_text(json.dumps(build_config_json(opts, "draft", draft_algo), indent=2) + "\n")
        cmd = trtllm_build_command(Path("CKPT"), Path("OUT"), opts, "draft", draft_algo)
        cmd[2], cmd[4] = rel(draft_ckpt), "$BUILD_DIR/engines/draft"
        lines += ["# draft: a plain LM engine", " ".join(shlex.quote(c) if not c.startswith("$") else f'"{c}"'
                                                            for c in cmd), ""]
        facts["build_configs"].append("engines/draft.build_config.json")
    else:
        lines += ["# draft: the DSpark drafter (architecture DSparkDrafter) is not in TensorRT-LLM's MODEL_MAP, so",
                  "# trtllm-build cannot compile it; on the GPU host it runs in the reference runtime on CUDA, fed the",
                  "# tapped target's outputs (docs/gpu.md). TensorRT-LLM >= 1.4: engines/llmapi/ (no engines needed)."]
        facts["draft_engine"] = "not buildable: DSparkDrafter has no TensorRT-LLM model class"
    script = engines / "build_engines.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    (engines / "NOT_BUILT.txt").write_text(f"TensorRT engines were NOT built: {reason}\n"
                                           "The exported checkpoints run in the reference PyTorch runtime; build the engines "
                                           "on a GPU host with `bash engines/build_engines.sh`.\n")
    return facts


def register_plugins() -> tuple[str, ...]:
    """Register our TensorRT plugins (lazy import of dspark_trt.kernels.trt)."""
    mod = importlib.import_module(PLUGIN_REGISTRATION_MODULE)
    return tuple(mod.register_all())


def _build_rank(ckpt: Path, out: Path, bc_dict: dict[str, Any], rank: int, taps: Sequence[int] = ()) -> None:
    """Build and save one rank's engine through the TensorRT-LLM 1.2.x Python API (taps: the tapped target class,
    builder/trtllm_taps.py, with config.dspark_tap_layers). bc_dict: build_config() or build_config_json()."""
    import copy

    from tensorrt_llm.builder import BuildConfig, build
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig
    from tensorrt_llm.models.modeling_utils import SpeculativeDecodingMode
    from tensorrt_llm.plugin import PluginConfig

    d = copy.deepcopy(bc_dict)
    mode = d.pop("speculative_decoding_mode")
    d["speculative_decoding_mode"] = (SpeculativeDecodingMode.DRAFT_TOKENS_EXTERNAL
                                      if mode in ("draft_tokens_external", SPEC_MODE_VALUE["draft_tokens_external"])
                                      else SpeculativeDecodingMode.NONE)
    d["kv_cache_type"] = str(d.get("kv_cache_type", "paged")).lower()
    pc = PluginConfig(**d.pop("plugin_config"))
    bc = BuildConfig.from_dict(d, plugin_config=pc)
    cfg = PretrainedConfig.from_json_file(str(ckpt / "config.json"))
    cfg.set_rank(rank)
    if taps:
        from dspark_trt.builder.trtllm_taps import tapped_model_class

        cfg.dspark_tap_layers = [int(t) for t in taps]
        model_cls = tapped_model_class(cfg.architecture)
    else:
        model_cls = MODEL_MAP[cfg.architecture]
    model = model_cls.from_checkpoint(str(ckpt), rank=rank, config=cfg)
    engine = build(model, bc)
    engine.save(str(out))


def build_engine(ckpt: Path, out: Path, opts: BuildOptions, role: str, quant_algo: str | None,
                 taps: Sequence[int] = ()) -> dict[str, Any]:
    """Build one engine (all ranks); in process for tp 1, else `mpirun -n TP` of this module."""
    bc = build_config(opts, role, quant_algo)
    out.mkdir(parents=True, exist_ok=True)
    if opts.tp_size == 1:
        _build_rank(ckpt, out, bc, 0, taps)
    else:
        cfg_file = out / "build_config.json"
        cfg_file.write_text(json.dumps(bc))
        cmd = ["mpirun", "-n", str(opts.tp_size), "--allow-run-as-root", sys.executable, "-m", "dspark_trt.builder.trtllm",
               "--checkpoint_dir", str(ckpt), "--output_dir", str(out), "--build_config", str(cfg_file)]
        if taps:
            cmd += ["--tap_layers", ",".join(str(int(t)) for t in taps)]
        log.info("building %s engine: %s", role, " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise BuildError(f"mpirun engine build of the {role} failed (exit {res.returncode}): {res.stderr[-2000:]}; "
                             f"check that mpi4py and tensorrt-llm 1.2.x work under mpirun.")
    return {"engine_dir": str(out), "ranks": opts.tp_size}


def build_engines(engines: Path, opts: BuildOptions, target_ckpt: Path, draft_ckpt: Path, draft_kind: str,
                  target_algo: str | None, draft_algo: str | None, taps: Sequence[int] = ()) -> dict[str, Any]:
    """Build with TensorRT-LLM when a 1.2.x is importable, else write the plan. Returns manifest facts."""
    version = trtllm_version() if opts.build_engines else None
    if version is None:
        reason = ("--no-engines was given" if not opts.build_engines else
                  "tensorrt_llm is not importable here (TensorRT-LLM 1.2.x needs an NVIDIA GPU host with TensorRT 10.14)")
        log.warning("engines NOT built: %s; wrote engines/build_engines.sh; continuing with the reference runtime", reason)
        return write_engine_plan(engines, opts, target_ckpt, draft_ckpt, draft_kind, target_algo, draft_algo, reason,
                                 taps)
    if not version.startswith(SUPPORTED_LINE):
        reason = f"tensorrt_llm {version} is installed but the engine path needs {SUPPORTED_LINE}.x (1.3 removed trtllm-build)"
        log.warning("engines NOT built: %s", reason)
        return write_engine_plan(engines, opts, target_ckpt, draft_ckpt, draft_kind, target_algo, draft_algo, reason,
                                 taps)
    plugins = register_plugins()
    facts: dict[str, Any] = {"built": True, "tensorrt_llm": version, "plugins": list(plugins)}
    if draft_kind == "dspark":
        facts["target"] = build_engine(target_ckpt, engines / "target", opts, "target_taps", target_algo, taps)
        facts.update(tap_facts(taps))
    else:
        facts["target"] = build_engine(target_ckpt, engines / "target", opts, "target", target_algo)
    if draft_kind == "lm":
        facts["draft"] = build_engine(draft_ckpt, engines / "draft", opts, "draft", draft_algo)
    else:
        facts["draft_engine"] = "not buildable: DSparkDrafter has no TensorRT-LLM model class"
    return facts


def _mpi_main(argv: list[str] | None = None) -> int:
    """Entry point of one MPI rank: build this rank's engine."""
    p = argparse.ArgumentParser(description="build one TensorRT-LLM engine rank (run under mpirun)")
    p.add_argument("--checkpoint_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--build_config", required=True)
    p.add_argument("--tap_layers", default="", help="comma-separated layers: build the tapped target (DSpark)")
    a = p.parse_args(argv)
    taps = tuple(int(t) for t in a.tap_layers.split(",") if t.strip())
    bc = json.loads(Path(a.build_config).read_text())
    register_plugins()
    if "OMPI_COMM_WORLD_SIZE" not in os.environ:  # a plain `python3 -m` run: one rank
        _build_rank(Path(a.checkpoint_dir), Path(a.output_dir), bc, 0, taps)
        return 0
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    _build_rank(Path(a.checkpoint_dir), Path(a.output_dir), bc, rank, taps)
    MPI.COMM_WORLD.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_main())
