"""DSpark kernels in OpenAI Triton: one source for CPU interpreter tests, CUDA runs and TensorRT plugins.

Packages: fused_accept (verify-round acceptance: greedy + rejection sampling) and block_draft (the DSpark
Markov step over a block). Importing `plugins` imports neither triton nor tensorrt; `plugins.api` (the torch
launch wrappers) imports triton, `plugins.<name>.trt` imports tensorrt lazily. The torch semantics the kernels
reproduce live in dspark_trt.spec_decode (accept) and the DSpark drafter (Markov head); the runtime reaches the kernels
only through dspark_trt.runtime.dispatch.
"""
from __future__ import annotations

__all__ = ["fused_accept", "block_draft"]
