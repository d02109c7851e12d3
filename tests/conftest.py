"""Shared fixtures: tiny real checkpoints (built once per cache dir) and the embedded default target."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from dspark_trt.testing.tiny import TinyPair, default_tiny_root, make_tiny_pair  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair() -> TinyPair:
    """Tiny Llama target, a noisy-copy draft (partial agreement), a 1-layer draft, a Qwen2 target."""
    return make_tiny_pair(default_tiny_root())


@pytest.fixture(scope="session")
def default_target_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a cached HF checkpoint directory (bf16)."""
    from dspark_trt.runtime.default_model import default_target_dir as _dir

    return _dir()
