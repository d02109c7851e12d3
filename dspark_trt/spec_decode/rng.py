"""Counter-based random numbers shared by the torch reference and the OpenAI Triton kernels.

Owns the one hash both sides use, so sampling is reproducible and identical on CPU and GPU:
u = hash(hash(seed, position), stream << 20 | lane) in [0, 1) with 24 random bits (exact in float32).
Keys: seed is the request's seed, position the absolute token position, stream which draw
(accept / resample / draft), lane an index inside the draw (e.g. a vocabulary entry). All
arithmetic is unsigned 32-bit (emulated with int64 + masks in torch; native uint32 in Triton).
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


def lane_counter(stream: int, lane: torch.Tensor | int = 0) -> torch.Tensor | int:
    """Second-level counter for (stream, lane); lane < 2**20."""
    return ((stream << 20) + lane) & MASK32 if isinstance(lane, int) else ((lane.to(torch.int64) + (stream << 20)) & MASK32)


def hash_u32(seed: torch.Tensor, ctr: torch.Tensor) -> torch.Tensor:
    """lowbias32-style mix of (seed, counter) → uint32 values held in int64."""
    x = (seed.to(torch.int64) * GOLDEN + ctr.to(torch.int64)) & MASK32
    x = x ^ (x >> 16)
    x = (x * M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * M2) & MASK32
    x = x ^ (x >> 16)
    return x


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int, lane: torch.Tensor | int = 0) -> torch.Tensor:
    """float32 uniforms in [0, 1) keyed on (seed, position, stream, lane); broadcasts like seed * position * lane."""
    key = hash_u32(seed, position)
    ctr = lane_counter(stream, lane)
    ctr_t = ctr if isinstance(ctr, torch.Tensor) else torch.tensor(ctr, dtype=torch.int64)
    return (hash_u32(key, ctr_t) >> 8).to(torch.float32) * (1.0 / 16777216.0)
