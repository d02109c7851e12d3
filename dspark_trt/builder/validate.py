"""Stage 1, validate: the target and draft checkpoints can be built, together, into this output.

Owns: resolving the default pair, checking each directory (config.json readable, a supported
architecture, a tokenizer that loads, every *.safetensors file complete — a corrupt or truncated file
is named in the CheckpointError), the shared-vocabulary check (the drafters'
check_same_vocabulary), and the free-disk estimate. Must not load weights into a model.
"""
from __future__ import annotations

import json
import logging
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError, CheckpointError, UnsupportedArchitectureError
from dspark_trt.runtime.hf_loader import read_json

log = logging.getLogger(__name__)

DSPARK_ARCH = "DSparkDrafter"
DISK_FACTOR = 4.0  # checkpoint bytes × this must be free: fp32 calibration copy + exports + TP shards + slack


@dataclass(frozen=True)
class ValidatedPair:
    """What the later stages need to know about the inputs."""

    target: Path
    draft: Path
    target_arch: str
    draft_kind: str  # "lm" (a causal LM the runtime runs) | "dspark" (DSpark block drafter)
    draft_arch: str
    input_bytes: int


def resolve_inputs(opts: BuildOptions) -> tuple[Path, Path]:
    """(target dir, draft dir); the embedded default pair when a path is not given."""
    if opts.target:
        target = Path(opts.target).expanduser()
    else:
        from dspark_trt.runtime.default_model import default_target_dir

        target = Path(default_target_dir())
    if opts.draft:
        draft = Path(opts.draft).expanduser()
    else:
        from dspark_trt.runtime.drafters import default_drafter_dir

        draft = Path(default_drafter_dir())
    return target.resolve(), draft.resolve()


def read_config(d: Path, role: str) -> dict[str, Any]:
    if not d.is_dir():
        raise CheckpointError(f"The {role} checkpoint directory {d} does not exist; pass --{role} DIR with a "
                              f"Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer).")
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"The {role} checkpoint {d} has no config.json; point --{role} at a directory written "
                              f"by save_pretrained.")
    return read_json(path)  # JSON errors name the file (shared with the runtime's loader)


def check_safetensors(path: Path) -> int:
    """Validate a .safetensors header against the file size; return the file size. CheckpointError names it."""
    fix = "re-download or re-save the checkpoint (the file is corrupt or truncated)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated ({size} bytes, no safetensors header); {fix}.")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > size - 8 or n > 100 << 20:
                raise CheckpointError(f"{path} has a corrupt safetensors header (length {n}, file {size} bytes); {fix}.")
            header = json.loads(f.read(n))
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} has an unreadable safetensors header ({e}); {fix}.") from e
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: its header needs {8 + n + end} bytes, the file has {size}; {fix}.")
    return size


def check_weights(d: Path, role: str) -> int:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"The {role} checkpoint {d} has no *.safetensors weights; save it with "
                              f"save_pretrained(safe_serialization=True).")
    return sum(check_safetensors(f) for f in files)


def check_tokenizer(d: Path, role: str) -> None:
    if not ((d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()):
        raise CheckpointError(f"The {role} checkpoint {d} has no tokenizer (tokenizer.json / tokenizer_config.json); "
                              f"save the tokenizer into it with tokenizer.save_pretrained.")
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - tokenizers raise many types
        raise CheckpointError(f"The {role} tokenizer in {d} does not load ({type(e).__name__}: {e}); restore "
                              f"tokenizer.json / tokenizer_config.json.") from e


def check_architecture(cfg: dict[str, Any], d: Path, role: str) -> str:
    from dspark_trt.runtime.config import ModelConfig

    try:
        return ModelConfig.from_hf(cfg).architecture
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"The {role} checkpoint {d}: {e}") from e


def check_vocabulary(target: Path, draft: Path, draft_cfg: dict[str, Any], kind: str) -> None:
    from dspark_trt.runtime.drafters import VocabInfo, check_same_vocabulary

    if kind == "dspark":
        tv = draft_cfg.get("target_vocab") or {}
        if tv:
            check_same_vocabulary(VocabInfo.from_dict(tv), target)
        else:
            tcfg = read_config(target, "target")
            check_same_vocabulary(VocabInfo(size=int(draft_cfg.get("vocab_size", 0))),
                                  VocabInfo(size=int(tcfg.get("vocab_size", 0))))
        return
    check_same_vocabulary(draft, target)


def check_disk(out_dir: Path, input_bytes: int) -> None:
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = int(input_bytes * DISK_FACTOR) + (64 << 20)
    if free < need:
        raise BuildError(f"Not enough disk for the build under {out_dir}: {free / 2**30:.2f} GiB free, about "
                         f"{need / 2**30:.2f} GiB needed; free space or pass --output on a larger disk.")


def validate(opts: BuildOptions, out_dir: Path) -> ValidatedPair:
    """Run every check; raise the first problem as a DsparkError naming file + fix."""
    target, draft = resolve_inputs(opts)
    tcfg = read_config(target, "target")
    dcfg = read_config(draft, "draft")
    target_arch = check_architecture(tcfg, target, "target")
    size = check_weights(target, "target")
    check_tokenizer(target, "target")
    if DSPARK_ARCH in (dcfg.get("architectures") or []):
        kind, draft_arch = "dspark", DSPARK_ARCH
        from dspark_trt.runtime.drafters import DSparkConfig

        try:
            block = DSparkConfig.from_dict(dcfg).block_size
        except Exception as e:  # DrafterError with its own fix
            raise CheckpointError(f"The draft checkpoint {draft}: {e}") from e
        if opts.max_draft_len > block:
            raise BuildError(f"--max-draft-len {opts.max_draft_len} exceeds the DSpark drafter's block size {block} "
                             f"({draft}); pass --max-draft-len {block} or less (γ cannot exceed what the drafter proposes).")
    else:
        kind = "lm"
        draft_arch = check_architecture(dcfg, draft, "draft")
        check_tokenizer(draft, "draft")
    size += check_weights(draft, "draft")
    check_vocabulary(target, draft, dcfg, kind)
    check_disk(out_dir, size)
    log.info("validated target %s (%s) and %s draft %s", target, target_arch, kind, draft)
    return ValidatedPair(target, draft, target_arch, kind, draft_arch, size)
