"""TensorRT-LLM-only: with tensorrt_llm 1.2.x importable, the engines stage really builds the target engine.

Skipped where TensorRT-LLM cannot be installed (every machine of this project's CI); on a GPU host with the
Triton TRT-LLM container it builds the tiny pair's engines through the 1.2.1 Python API.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.trtllm, pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is None,
                                 reason="needs tensorrt_llm 1.2.x + an NVIDIA GPU (not installable here)")]


def test_engines_are_built(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    from dspark_trt.builder.pipeline import run_build
    from dspark_trt.builder.options import BuildOptions

    out = tmp_path / "tiny"
    manifest = run_build(BuildOptions(target=str(tiny_pair.target), draft=str(tiny_pair.draft), dtype="float16",
                                   max_draft_len=4, max_batch_size=2, max_seq_len=256, output=str(out),
                                   bench=False), quiet=True)
    facts = manifest["stages"]["engines"]["outputs"]
    assert facts.get("built") is True, facts
    assert any((out / "engines" / "target").glob("*.engine"))
    assert any((out / "engines" / "draft").glob("*.engine"))
