"""Counter-based random numbers shared by the torch reference and the OpenAI Triton kernels.

Owns the one hash both sides use, so sampling is reproducible and identical on CPU and GPU:
u = hash(seed, counter) in [0, 1) with 24 random bits (exact in float32). Keys: seed is the
request's seed, counter encodes (absolute token position, stream, lane). All arithmetic is
unsigned 32-bit (emulated with int64 + masks in torch; native uint32 in Triton).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
M1 = 0x7FEB352D
M2 = 0x846CA68B

# streams: which random draw at a position
STREAM_ACCEPT = 0  # the min(1, p/q) uniform
STREAM_RESAMPLE = 1  # residual / bonus sampling
STREAM_DRAFT = 2  # drafter sampling


def counter(position: torch.Tensor, stream: int, lane: torch.Tensor | int = 0) -> torch.Tensor:
    """Counter for (absolute position, stream, lane); lane < 2**20 (e.g. a vocab tile index)."""
    return ((position.to(torch.int64) * 4 + stream) * (1 << 20) + lane) & MASK32


def hash_u32(seed: torch.Tensor, ctr: torch.Tensor) -> torch.Tensor:
    """lowbias32-style mix of (seed, counter) → uint32 values held in int64."""
    x = (seed.to(torch.int64) * GOLDEN + ctr.to(torch.int64)) & MASK32
    x = x ^ (x >> 16)
    x = (x * M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * M2) & MASK32
    x = x ^ (x >> 16)
    return x


def uniform(seed: torch.Tensor, ctr: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) from the top 24 bits of the hash; broadcasting like seed * ctr."""
    return (hash_u32(seed, ctr) >> 8).to(torch.float32) * (1.0 / 16777216.0)
