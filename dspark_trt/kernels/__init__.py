"""DSpark kernels in OpenAI Triton: one source for CPU interpreter tests, CUDA runs and TensorRT plugins.

Packages: fused_accept (verify-round acceptance: greedy + rejection sampling) and block_draft (the DSpark
Markov step over a block). Importing `dspark_trt.kernels` imports neither triton nor tensorrt;
`dspark_trt.kernels.api` (the torch launch wrappers) imports triton, `dspark_trt.kernels.<name>.trt` imports
tensorrt lazily. The torch semantics the kernels
reproduce live in dspark_trt.spec_decode (accept) and the DSpark drafter (Markov head); the runtime reaches the kernels
only through dspark_trt.runtime.dispatch.
"""
from __future__ import annotations

__all__ = ["fused_accept", "block_draft"]
