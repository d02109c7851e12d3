"""Public torch entry points of the kernels (imports triton): what dspark_trt.runtime.dispatch calls on CUDA.

Owns nothing but the re-export, so the dispatcher has one import and tests one surface.
"""
from __future__ import annotations

from dspark_trt.kernels.block_draft.launch import markov_block
from dspark_trt.kernels.fused_accept.launch import greedy_accept, sample_accept, supports_sampling

__all__ = ["greedy_accept", "sample_accept", "supports_sampling", "markov_block"]
