"""Plugin tests run the OpenAI Triton kernels on CPU through the interpreter (TRITON_INTERPRET=1).

The variable is read when a kernel is decorated, so it is set here, before any test module imports plugins;
`interpreted_kernels` reloads the kernel modules if something imported them compiled earlier in the session.
AOT compiles need the opposite mode and run in a subprocess (test_aot_trt.py).
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest

os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = ("dspark_trt.kernels._rng", "dspark_trt.kernels.fused_accept.kernel", "dspark_trt.kernels.fused_accept.launch",
                   "dspark_trt.kernels.block_draft.kernel", "dspark_trt.kernels.block_draft.launch", "dspark_trt.kernels.api")


def _is_interpreted(mod: ModuleType, attr: str) -> bool:
    return type(getattr(mod, attr)).__name__ == "InterpretedFunction"


@pytest.fixture(scope="session")
def interpreted_kernels() -> ModuleType:
    """dspark_trt.kernels.api with every kernel in interpreter mode (reloaded if needed)."""
    os.environ["TRITON_INTERPRET"] = "1"
    fa = importlib.import_module("dspark_trt.kernels.fused_accept.kernel")
    if not _is_interpreted(fa, "accept_stats_kernel"):
        for name in _KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
    api = importlib.import_module("dspark_trt.kernels.api")
    assert _is_interpreted(importlib.import_module("dspark_trt.kernels.fused_accept.kernel"), "accept_stats_kernel")
    assert _is_interpreted(importlib.import_module("dspark_trt.kernels.block_draft.kernel"), "markov_block_kernel")
    return api
