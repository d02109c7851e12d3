"""Triton twin of dspark_trt.spec_decode.rng: the same two-level lowbias32 hash, in native uint32 arithmetic.

Owns only the device-side hash; the constants are imported from spec_decode.rng (hash, streams) and
spec_decode.accept (the exponential-race offset) so both sides cannot drift.
u = hash(hash(seed, position), stream << 20 | lane) >> 8, scaled by 2**-24 (exact in float32).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_trt.spec_decode import rng as _ref
from dspark_trt.spec_decode.accept import _U_OFFSET

GOLDEN: tl.constexpr = tl.constexpr(_ref.GOLDEN)
M1: tl.constexpr = tl.constexpr(_ref.M1)
M2: tl.constexpr = tl.constexpr(_ref.M2)
STREAM_ACCEPT: tl.constexpr = tl.constexpr(_ref.STREAM_ACCEPT)
STREAM_RESAMPLE: tl.constexpr = tl.constexpr(_ref.STREAM_RESAMPLE)
STREAM_DRAFT: tl.constexpr = tl.constexpr(_ref.STREAM_DRAFT)
U_OFFSET: tl.constexpr = tl.constexpr(_U_OFFSET)
RACE_BIG_IDX: tl.constexpr = tl.constexpr(2147483647)  # "no lane": larger than any vocabulary index


@triton.jit
def hash_u32(seed, ctr):
    """lowbias32 mix of uint32 (seed, ctr) → uint32 (wrapping multiply, logical shifts)."""
    x = seed.to(tl.uint32) * tl.full((), GOLDEN, tl.uint32) + ctr.to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * tl.full((), M1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), M2, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def uniform(seed, position, stream: tl.constexpr, lane):
    """float32 uniform in [0, 1) keyed on (seed, position, stream, lane), equal to spec_decode.rng.uniform."""
    key = hash_u32(seed.to(tl.uint32), position.to(tl.uint32))
    ctr = lane.to(tl.uint32) + tl.full((), stream * 1048576, tl.uint32)
    h = hash_u32(key, ctr)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def race_denominator(seed, position, stream: tl.constexpr, lane):
    """e = -log(u + 2**-25) in float32: the exponential-race divisor of spec_decode.accept.exponential_race."""
    u = uniform(seed, position, stream, lane)
    return -tl.log(u + U_OFFSET)


@triton.jit
def race_chunk(p, mask, e, idx, best, arg):
    """One vocabulary chunk of the exponential race: lanes idx with weights p (masked by mask) and divisors e
    (race_denominator) against the running (best score, arg) → the updated (best, arg); ties go to the lowest
    index, as in the reference."""
    sc = tl.where(mask, p / e, -1.0)
    tb = tl.max(sc, axis=0)
    ib = tl.min(tl.where(sc == tb, idx, RACE_BIG_IDX), axis=0)
    return tl.maximum(best, tb), tl.where(tb > best, ib, arg)
