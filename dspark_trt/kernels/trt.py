"""Register every dspark TensorRT plugin (QDP AOT) in one call: what the engine-build step imports.

Owns only the list of plugin modules; each dspark_trt/kernels/<name>/trt.py owns its specs and registration.
"""
from __future__ import annotations

from dspark_trt.kernels.block_draft import trt as block_draft_trt
from dspark_trt.kernels.fused_accept import trt as fused_accept_trt

ALL_SPECS = fused_accept_trt.SPECS + block_draft_trt.SPECS


def register_all(arch: int = 90) -> tuple[str, ...]:
    """Register fused_accept and block_draft plugins; BuildError (with the fix) when tensorrt is missing."""
    return fused_accept_trt.register(arch) + block_draft_trt.register(arch)
