"""Stage 5, model repository: fill the Triton templates of dspark_trt/model_repo/ into build/NAME/model_repo and,
for GPU hosts (`--serving trtllm|both`), dspark_trt/model_repo/ overlaid with dspark_trt/model_repo_trtllm/ into
build/NAME/model_repo_trtllm: an overlay model with a config.pbtxt (target, draft: tensorrtllm) replaces the base
model whole, other overlay files replace single files (dspark/1/model.py: the engine-driving adapter); every other
model (ensembles, preprocessing, the dspark config, ...) is model_repo/'s (docs/gpu.md). model_repo_trtllm/_variants/
holds alternative model directories, never copied as such: a DSpark pair's `target` is _variants/target_executor
(the tapped target through TensorRT-LLM's executor bindings, serve/gpu_host/executor_model.py — the stock
tensorrtllm backend drops additional engine outputs), with the tap outputs and parameters appended.

Owns the `${KEY}` substitution (keys per docs/CONTRACTS.md: BUILD_DIR, MAX_BATCH_SIZE, GAMMA, POLICY, MIN_K,
MAX_K, MAX_SEQ_LEN, MAX_QUEUE) over every config.pbtxt; other files are copied verbatim. An unknown key,
or any `${` left after filling, is a BuildError naming the file. Must not know what the models do.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping, Sequence

from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

TEMPLATE_KEYS: tuple[str, ...] = ("BUILD_DIR", "MAX_BATCH_SIZE", "GAMMA", "POLICY", "MIN_K", "MAX_K", "MAX_SEQ_LEN",
                                  "MAX_QUEUE")
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repo"  # package data: dspark_trt/model_repo/
TRTLLM_TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repo_trtllm"  # package data: the GPU-host overlay
REFERENCE_REPO, TRTLLM_REPO = "model_repo", "model_repo_trtllm"
VARIANTS = "_variants"  # under an overlay: alternative model directories, used only through `variants`
DSPARK_TARGET_VARIANT = "target_executor"
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


def template_hashes(hash_file: Callable[[Path], str]) -> dict[str, str]:
    """{"model_repo/REL" | "model_repo_trtllm/REL": hash} of every template file (the model_repo stage's key)."""
    return {f"{root.name}/{p.relative_to(root)}": hash_file(p) for root in (TEMPLATE_DIR, TRTLLM_TEMPLATE_DIR)
            for p in template_files(root) if p.is_file()}


def _sources(template: Path, overlay: Path | None, drop: Sequence[str],
             variants: Mapping[str, str] | None = None) -> dict[Path, Path]:
    """{relative path: source} of one repository: the template's files, then the overlay's — an overlay model with
    a config.pbtxt replaces the template's model whole, other overlay files replace or add single files; models
    named in drop left out; variants {model: variant} replace that model whole by overlay/_variants/<variant>/."""
    variants = dict(variants or {})
    roots = [template] + ([overlay] if overlay is not None else [])
    for root in roots:
        if not root.is_dir():
            raise BuildError(f"The model repository templates are missing at {root}; reinstall dspark_trt "
                             f"(the templates ship as package data in dspark_trt/{root.name}/).")
    whole = {p.parent.name for p in overlay.glob("*/config.pbtxt")} if overlay is not None else set()
    out: dict[Path, Path] = {}
    for root in roots:
        for src in template_files(root):
            rel = src.relative_to(root)
            if rel.parts[0] in drop or rel.parts[0] == VARIANTS or rel.parts[0] in variants or (
                    root == template and rel.parts[0] in whole):
                continue
            out[rel] = src
    for model, variant in variants.items():
        vdir = (overlay or template) / VARIANTS / variant
        if not (vdir / "config.pbtxt").is_file():
            raise BuildError(f"The model repository variant {variant!r} for {model!r} is missing at {vdir}; reinstall "
                             "dspark_trt (the templates ship as package data).")
        out[Path(model)] = vdir
        for src in template_files(vdir):
            out[Path(model) / src.relative_to(vdir)] = src
    return dict(sorted(out.items()))


def fill_model_repo(opts: BuildOptions, build_dir: Path, template: Path = TEMPLATE_DIR, *, dest_name: str = REFERENCE_REPO,
                    overlay: Path | None = None, drop: Sequence[str] = (),
                    variants: Mapping[str, str] | None = None) -> dict[str, object]:
    """Copy + fill template (+ overlay, + variants) → build_dir/dest_name (replaced atomically); returns facts."""
    sources = _sources(template, overlay, drop, variants)
    values = template_values(opts, build_dir)
    dest = Path(build_dir) / dest_name
    tmp = Path(build_dir) / f".{dest_name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    filled: list[str] = []
    try:
        for rel, src in sources.items():
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
    return {"path": dest_name, "filled": filled, "values": values}


def tap_outputs_pbtxt(taps: Sequence[int]) -> str:
    """The `output` declarations of the tapped target's extra engine outputs ([1, n, hidden] per request, FP32 as
    the scheduler reads them), appended to target/config.pbtxt (a repeated field may be given again)."""
    from dspark_trt.builder.trtllm_taps import tap_output_names  # noqa: PLC0415 - torch-free, no tensorrt_llm

    decl = ",\n".join(f'  {{\n    name: "{n}"\n    data_type: TYPE_FP32\n    dims: [ -1, -1 ]\n  }}'
                      for n in tap_output_names(taps))
    return ("# DSpark: the tapped target's residual stream after each drafter tap layer (builder/trtllm_taps.py)\n"
            f"output [\n{decl}\n]\n")


def tap_parameters_pbtxt(taps: Sequence[int]) -> str:
    """The executor target's parameters naming its tap outputs and the engine's KV block size (builder/trtllm.py)."""
    from dspark_trt.builder.trtllm import TOKENS_PER_BLOCK  # noqa: PLC0415 - no tensorrt_llm import at module level
    from dspark_trt.builder.trtllm_taps import tap_output_names  # noqa: PLC0415

    return (f'parameters: {{ key: "dspark_tap_names" value: {{ string_value: "{",".join(tap_output_names(taps))}" }} }}\n'
            f'parameters: {{ key: "tokens_per_block" value: {{ string_value: "{TOKENS_PER_BLOCK}" }} }}\n')


def fill_trtllm_repo(opts: BuildOptions, build_dir: Path, draft_engine: bool = True,
                     taps: Sequence[int] = ()) -> dict[str, object]:
    """build_dir/model_repo_trtllm: model_repo/ with model_repo_trtllm/'s target + draft (tensorrtllm) and dspark
    adapter; no `draft` without a draft engine; taps (a DSpark pair): `target` is the executor model
    (_variants/target_executor) with the tapped target's outputs and tap parameters."""
    facts = fill_model_repo(opts, build_dir, TEMPLATE_DIR, dest_name=TRTLLM_REPO, overlay=TRTLLM_TEMPLATE_DIR,
                            drop=() if draft_engine else ("draft",),
                            variants={"target": DSPARK_TARGET_VARIANT} if taps else None)
    if taps:
        cfg = Path(build_dir) / TRTLLM_REPO / "target" / "config.pbtxt"
        cfg.write_text(cfg.read_text().rstrip("\n") + "\n" + tap_outputs_pbtxt(taps) + tap_parameters_pbtxt(taps))
        facts["tap_outputs"] = [f"dspark_tap_{int(t)}" for t in taps]
        facts["target_model"] = f"python ({VARIANTS}/{DSPARK_TARGET_VARIANT}: executor bindings)"
    return facts
