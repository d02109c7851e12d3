"""`BuildOptions`: the frozen, hashable description of one build (the CLI's defaults come from here).

Owns the option names and their validation. Must not do any work (no file access beyond path
normalisation, no torch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.limits import request_room  # torch-free
from dspark_trt.spec_decode.policies import POLICIES, resolve_policy_alias  # torch-free

DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
QUANT_MODES: tuple[str, ...] = ("none", "fp8", "int8_sq", "w8a16")
KV_QUANT_MODES: tuple[str, ...] = ("none", "fp8")
# Which Triton model repositories the build writes: model_repo/ (the reference runtime serves everything),
# model_repo_trtllm/ (GPU host: target/draft as tensorrtllm in-flight-batching models over the engines), or both.
SERVING_MODES: tuple[str, ...] = ("reference", "trtllm", "both")

# Our --quant name → TensorRT-LLM 1.2.1 QuantAlgo name written into checkpoint config.json.
QUANT_ALGO: dict[str, str | None] = {"none": None, "fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "w8a16": "W8A16"}
KV_QUANT_ALGO: dict[str, str | None] = {"none": None, "fp8": "FP8"}


@dataclass(frozen=True)
class BuildOptions:
    """Every knob of `dspark-trt build`; `None` target/draft = the embedded default pair."""

    target: str | None = None
    draft: str | None = None
    dtype: str = "bfloat16"
    quant: str = "none"
    kv_quant: str = "none"
    max_draft_len: int = 7  # γ: the DSpark block size the target verifies at most
    max_batch_size: int = 32  # KV slots / engine batch; chosen by measurement (docs/serving.md, "Batch cap")
    max_seq_len: int = 2048
    tp_size: int = 1
    output: str = "build/default"
    calib_samples: int = 32  # calibration sequences
    calib_seq_len: int = 128  # tokens per calibration sequence
    eval_tokens: int = 512  # held-out tokens for the quality report
    policy: str = "survival"  # served default K policy; the alias "seed" is stored as "confidence"
    min_k: int = 2
    max_k: int = 0  # 0 → γ (max_draft_len)
    max_queue: int = 64
    build_engines: bool = True  # try TensorRT-LLM when present; never required
    bench: bool = True  # measure the exported target's decode speed in the verify stage (informational)
    serving: str = "reference"  # one of SERVING_MODES (docs/gpu.md)
    cost_table: str | None = None  # survival CostTable JSON for the TensorRT-LLM >= 1.4 DSpark config (None: linear)
    corpus: str = "auto"  # suffix corpus (spec_decode.corpus): "auto" (the shipped one for the default target),
    # "none", or a corpus .npz of this target's own outputs (scripts/build_corpus.py)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"Invalid build option --{name.replace('_', '-')}: {why}.")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quant not in QUANT_MODES:
            raise bad("quant", f"{self.quant!r} is not one of {', '.join(QUANT_MODES)}")
        if self.kv_quant not in KV_QUANT_MODES:
            raise bad("kv_quant", f"{self.kv_quant!r} is not one of {', '.join(KV_QUANT_MODES)}")
        if self.serving not in SERVING_MODES:
            raise bad("serving", f"{self.serving!r} is not one of {', '.join(SERVING_MODES)}")
        object.__setattr__(self, "policy", resolve_policy_alias(self.policy))
        if self.policy not in POLICIES:
            raise bad("policy", f"{self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("max_draft_len", "max_batch_size", "max_seq_len", "tp_size", "calib_samples",
                     "calib_seq_len", "eval_tokens", "max_queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, f"must be a positive integer, got {v!r}")
        if self.tp_size & (self.tp_size - 1):
            raise bad("tp_size", f"must be a power of two, got {self.tp_size}")
        if not 0 <= self.min_k <= self.gamma:
            raise bad("min_k", f"must be in 0..{self.gamma} (γ = --max-draft-len), got {self.min_k}")
        if not 0 <= self.max_k <= self.gamma:
            raise bad("max_k", f"must be in 0..{self.gamma} (0 = γ), got {self.max_k}")
        if self.max_seq_len <= self.max_draft_len + 1:
            raise bad("max_seq_len", f"must exceed --max-draft-len + 1 = {self.max_draft_len + 1}")

    @property
    def gamma(self) -> int:
        return self.max_draft_len

    @property
    def effective_max_k(self) -> int:
        return self.max_k or self.gamma

    @property
    def max_input_len(self) -> int:
        """Prompt budget handed to trtllm-build: spec_decode.limits.request_room (the sequence budget minus one
        block), ≥ 1."""
        return max(1, request_room(self.max_seq_len, self.max_draft_len))

    @property
    def serves_reference(self) -> bool:
        return self.serving in ("reference", "both")

    @property
    def serves_trtllm(self) -> bool:
        return self.serving in ("trtllm", "both")

    @property
    def quant_algo(self) -> str | None:
        return QUANT_ALGO[self.quant]

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return KV_QUANT_ALGO[self.kv_quant]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BuildOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **changes: Any) -> "BuildOptions":
        return dataclasses.replace(self, **changes)
