"""What every dspark_trt/kernels/<name>/trt.py shares: the lazy tensorrt import, the plugin namespace/version and the
declarative I/O specs that the QDP registration and the CPU contract tests both read.

Owns no kernel. TensorRT is imported only inside `import_trt()`, so this module imports anywhere.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from dspark_trt.errors import BuildError

NAMESPACE = "dspark"
VERSION = "1"  # tensorrt.plugin registers every QDP creator with version "1"

# TensorRT dtype name → triton pointer element type used in AOT signatures
TRITON_PTR = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32", "int64": "i64"}


@dataclasses.dataclass(frozen=True)
class IOSpec:
    """One plugin input or output: name, allowed dtypes (TensorRT names, first = default) and rank."""

    name: str
    dtypes: tuple[str, ...]
    rank: int


@dataclasses.dataclass(frozen=True)
class PluginSpec:
    """A QDP plugin as the engine sees it; kernel ABI = inputs, scalars (int32), outputs."""

    name: str
    inputs: tuple[IOSpec, ...]
    scalars: tuple[str, ...]  # int32 extra_args, in kernel order
    outputs: tuple[IOSpec, ...]
    attrs: tuple[tuple[str, type], ...]  # build-time attributes (not serialized with AOT)

    @property
    def plugin_id(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def user_params(self) -> int:
        return len(self.inputs) + len(self.scalars) + len(self.outputs)


def import_trt() -> tuple[Any, Any]:
    """(tensorrt, tensorrt.plugin) or BuildError saying how to get them."""
    try:
        trt = importlib.import_module("tensorrt")
        trtp = importlib.import_module("tensorrt.plugin")
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken bindings wheel (no libnvinfer)
        raise BuildError(
            "TensorRT with tensorrt.plugin (QDP, with aot_impl) is not importable here "
            f"({exc}). Register the dspark plugins on the GPU build host: pip install 'dspark_trt[trtllm]' "
            "(tensorrt-llm 1.2.x brings tensorrt 10.14) from NVIDIA's index, or use the TensorRT-LLM container."
        ) from exc
    if not hasattr(trtp, "aot_impl"):
        raise BuildError("this tensorrt.plugin has no aot_impl (TensorRT too old): use TensorRT 10.14 "
                         "(pinned by tensorrt-llm 1.2.1)")
    return trt, trtp


def trt_dtype_name(trt: Any, dtype: Any) -> str:
    """tensorrt.DataType → 'float32' / 'bfloat16' / ... (BuildError for anything else)."""
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16", trt.int32: "int32",
             trt.int64: "int64"}
    if dtype not in names:
        raise BuildError(f"unsupported tensor dtype {dtype} for a dspark plugin")
    return names[dtype]


def const_dim(expr: Any, what: str) -> int:
    """A shape expression that must be a build-time constant (e.g. the vocabulary)."""
    if getattr(expr, "is_constant", False):
        return int(expr.constant_value)
    raise BuildError(f"{what} must be static in the engine (got a dynamic dimension); fix it in the network")
