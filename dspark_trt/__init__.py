"""dspark_trt: DSpark speculative decoding — ModelOpt quantization, TensorRT-LLM export and engines,
Triton serving, and a reference PyTorch runtime that executes the same exported artifacts.

The engine API of the DSpark deployment guide is importable from the top level
(`from dspark_trt import SpeculativeDecodingEngine`); it is loaded lazily so `import dspark_trt` stays cheap for the CLI and the Triton adapters.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["SpeculativeDecodingEngine", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SpeculativeDecodingEngine":
        from dspark_trt.engine import SpeculativeDecodingEngine

        return SpeculativeDecodingEngine
    raise AttributeError(f"module 'dspark_trt' has no attribute {name!r}")
