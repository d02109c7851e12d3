"""Stage 5, model repository: fill the Triton templates of dspark_trt/model_repo/ into build/NAME/model_repo.

Owns the `${KEY}` substitution (keys per docs/CONTRACTS.md: BUILD_DIR, MAX_BATCH_SIZE, GAMMA, POLICY, MIN_K,
MAX_K, MAX_SEQ_LEN, MAX_QUEUE) over every config.pbtxt; other files are copied verbatim. An unknown key,
or any `${` left after filling, is a BuildError naming the file. Must not know what the models do.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

TEMPLATE_KEYS: tuple[str, ...] = ("BUILD_DIR", "MAX_BATCH_SIZE", "GAMMA", "POLICY", "MIN_K", "MAX_K", "MAX_SEQ_LEN",
                                  "MAX_QUEUE")
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repo"  # package data: dspark_trt/model_repo/
_KEY = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
FILLED_SUFFIXES = (".pbtxt",)


def template_values(opts: BuildOptions, build_dir: Path) -> dict[str, str]:
    return {"BUILD_DIR": str(Path(build_dir).resolve()), "MAX_BATCH_SIZE": str(opts.max_batch_size),
            "GAMMA": str(opts.gamma), "POLICY": opts.policy, "MIN_K": str(opts.min_k),
            "MAX_K": str(opts.effective_max_k), "MAX_SEQ_LEN": str(opts.max_seq_len), "MAX_QUEUE": str(opts.max_queue)}


def template_files(template: Path = TEMPLATE_DIR) -> list[Path]:
    """Every template file and directory, sorted; bytecode caches (pip byte-compiles 1/model.py) skipped."""
    if not template.is_dir():
        return []
    return [p for p in sorted(template.rglob("*")) if "__pycache__" not in p.parts and p.suffix != ".pyc"]


def fill_text(text: str, values: dict[str, str], where: str) -> str:
    """Substitute ${KEY}; BuildError on an unknown key or a `${` left over."""
    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            raise BuildError(f"Unknown template key ${{{key}}} in {where}; known keys: {', '.join(sorted(values))}. "
                             f"Fix the template (in dspark_trt/model_repo/) or add the key to TEMPLATE_KEYS.")
        return values[key]

    out = _KEY.sub(sub, text)
    if "${" in out:
        line = next(i for i, ln in enumerate(out.splitlines(), 1) if "${" in ln)
        raise BuildError(f"Malformed template placeholder left in {where} line {line} (a `${{` not of the form "
                         f"${{KEY}}); fix the template.")
    return out


def fill_model_repo(opts: BuildOptions, build_dir: Path, template: Path = TEMPLATE_DIR) -> dict[str, object]:
    """Copy + fill template → build_dir/model_repo (replaced atomically); returns manifest facts."""
    if not template.is_dir():
        raise BuildError(f"The model repository templates are missing at {template}; reinstall dspark_trt "
                         f"(the templates ship as package data in dspark_trt/model_repo/).")
    values = template_values(opts, build_dir)
    dest = Path(build_dir) / "model_repo"
    tmp = Path(build_dir) / ".model_repo.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    filled: list[str] = []
    try:
        for src in template_files(template):
            rel = src.relative_to(template)
            dst = tmp / rel
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.suffix in FILLED_SUFFIXES:
                dst.write_text(fill_text(src.read_text(), values, str(src)))
                filled.append(str(rel))
            else:
                shutil.copy2(src, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    log.info("model repository written to %s (%d templates filled)", dest, len(filled))
    return {"path": "model_repo", "filled": filled, "values": values}
