"""Per-request sampling settings and their one validation rule.

Owns `SamplingParams` (temperature, top_p, seed; the drafter and the target always use the same ones) and
`check_sampling`, the single place that decides which values are valid and how a bad one is reported. Every
entry point — `spec_decode.loop.Request`, `SpeculativeDecodingEngine`, `dspark-trt generate`, the served
`dspark` model — validates by building a SamplingParams (or calling check_sampling with its own argument
names), so they accept the same values and say the same thing. Torch-free: the serving front end imports it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping

from dspark_trt.errors import InvalidArgumentError

__all__ = ["MAX_SEED", "MAX_TEMPERATURE", "SamplingParams", "check_sampling"]

MAX_TEMPERATURE = 100.0  # above this softmax(logits / T) is uniform to float32 precision anyway
MAX_SEED = 2**63 - 1  # seeds travel as int64 tensors; the counter-based RNG uses them mod 2**32

_NAMES = {"temperature": "temperature", "top_p": "top_p", "seed": "seed"}


def check_sampling(temperature: object, top_p: object, seed: object,
                   names: Mapping[str, str] | None = None) -> None:
    """InvalidArgumentError naming the first bad value and its valid range; `names` renames the arguments in
    the message (e.g. {"seed": "random_seed"} for the served input, {"temperature": "--temperature"} for the CLI).

    Valid: temperature a finite number in [0, MAX_TEMPERATURE] (0 = greedy); top_p a number in (0, 1];
    seed None (a random seed is drawn per request) or an integer in [0, 2^63 − 1]."""
    n = {**_NAMES, **(names or {})}
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(float(temperature)) or not 0.0 <= float(temperature) <= MAX_TEMPERATURE):
        raise InvalidArgumentError(f"{n['temperature']} must be a finite number in [0, {MAX_TEMPERATURE:g}] "
                                   f"(0 = greedy), got {temperature!r}")
    if (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not math.isfinite(float(top_p))
            or not 0.0 < float(top_p) <= 1.0):
        raise InvalidArgumentError(f"{n['top_p']} must be a number in (0, 1] (1 = no nucleus filtering), "
                                   f"got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= int(seed) <= MAX_SEED):
        raise InvalidArgumentError(f"{n['seed']} must be unset or an integer in [0, 2^63 − 1], got {seed!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; the drafter and the target always use the same ones.

    Validated on construction (check_sampling). A sampled request's randomness comes only from
    spec_decode.rng keyed on (seed, absolute position, draw stream), so a seed fixes the output."""

    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0
