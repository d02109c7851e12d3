"""DSpark drafter checkpoint configuration (config.json) and its validation.

Owns: the frozen `DSparkConfig` dataclass, reading/writing it as JSON with field names that follow
DeepSpec's released drafter configs where they apply (architectures, block_size, mask_token_id,
target_layer_ids, num_hidden_layers, markov_rank, markov_head_type, enable_confidence_head,
confidence_head_with_markov, num_anchors) plus ours (confidence_temperatures, draft_vocab_size,
target_fingerprint, target_vocab). Every invalid field raises DrafterError naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark_trt.errors import DrafterError

ARCHITECTURE = "DSparkDrafter"
MARKOV_HEAD_TYPES = ("vanilla", "none")


@dataclass(frozen=True)
class DSparkConfig:
    """Shape and behaviour of a DSpark block drafter (hidden sizes match the target's)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int  # nominal id of MASK (the drafter uses its own learned mask embedding)
    num_hidden_layers: int = 2
    block_size: int = 7
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    markov_rank: int = 64
    markov_head_type: str = "vanilla"  # "vanilla" | "none"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_temperatures: tuple[float, ...] = ()  # per block position, from STS calibration; () = all 1
    draft_vocab_size: int = 0  # 0 = full target vocabulary; else size of the d2t map (EAGLE-3 style)
    num_anchors: int = 32  # anchors per training sequence (informational)
    target_fingerprint: str = ""  # hash of the target's embedding rows; "" = unchecked
    target_vocab: dict[str, Any] = field(default_factory=dict)  # size, special ids, digest of the target vocab
    architectures: tuple[str, ...] = (ARCHITECTURE,)
    model_type: str = "dspark_drafter"
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> DrafterError:
            return DrafterError(f"Invalid DSpark drafter config: {name} {why}. Fix the drafter's config.json "
                                "or retrain it with `dspark-trt train-drafter`.")

        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "num_hidden_layers", "block_size", "num_target_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, f"must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of "
                      f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.target_layer_ids:
            raise bad("target_layer_ids", "must list at least one target layer")
        for i in self.target_layer_ids:
            if not 0 <= int(i) < self.num_target_layers:
                raise bad("target_layer_ids", f"contains {i}, outside 0..{self.num_target_layers - 1}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("mask_token_id", f"={self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise bad("markov_head_type", f"={self.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}")
        if self.markov_head_type != "none" and self.markov_rank <= 0:
            raise bad("markov_rank", f"must be positive with a {self.markov_head_type!r} Markov head")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise bad("draft_vocab_size", f"={self.draft_vocab_size} must be in 0..vocab_size ({self.vocab_size})")
        if self.confidence_temperatures and len(self.confidence_temperatures) != self.block_size:
            raise bad("confidence_temperatures", f"has {len(self.confidence_temperatures)} entries, "
                      f"expected block_size={self.block_size}")
        if any(t <= 0 for t in self.confidence_temperatures):
            raise bad("confidence_temperatures", "must all be positive")
        if ARCHITECTURE not in self.architectures:
            raise bad("architectures", f"={list(self.architectures)} must contain {ARCHITECTURE!r}")

    @property
    def feature_size(self) -> int:
        """F: width of the concatenated target features the drafter consumes."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def has_markov(self) -> bool:
        return self.markov_head_type != "none" and self.markov_rank > 0

    @property
    def head_vocab(self) -> int:
        """Vd: size of the drafter's output vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    def replace(self, **changes: Any) -> "DSparkConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["confidence_temperatures"] = list(self.confidence_temperatures)
        d["architectures"] = list(self.architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in d]
        if missing:
            raise DrafterError(f"DSpark drafter config.json lacks required fields {missing}. Fix: re-export "
                               "the drafter with `dspark-trt train-drafter` (it writes every field).")
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("target_layer_ids", "confidence_temperatures", "architectures"):
            if k in kw:
                kw[k] = tuple(kw[k])
        if isinstance(kw.get("rope_theta"), dict):  # tolerate HF rope_parameters dicts
            kw["rope_theta"] = float(kw["rope_theta"].get("rope_theta", 10000.0))
        return cls(**kw)

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "DSparkConfig":
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise DrafterError(f"No config.json in drafter directory {directory}. Fix: pass a directory written "
                               "by `dspark-trt train-drafter` (config.json + model.safetensors).")
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DrafterError(f"Cannot parse {path}: {exc}. Fix: restore the file from the shipped drafter.") from exc
        return cls.from_dict(d)


def rope_theta_of(hf_config: dict[str, Any]) -> float:
    """rope_theta from an HF config dict (old top-level key or transformers-5 rope_parameters)."""
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    params = hf_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))
