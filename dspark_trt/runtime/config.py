"""Model configuration of the runtime's Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2).

Owns: `ModelConfig` (frozen) and its construction from a Hugging Face config dict (transformers 4
style `rope_theta`/`rope_scaling` and transformers 5 style `rope_parameters` alike), plus the
RoPE inverse frequencies (default, linear, llama3 scaling). Must not know about weights or files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from dspark_trt.errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_ROPE_TYPES = ("default", "linear", "llama3")


def _unsupported(msg: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"{msg}. The runtime executes Llama-family decoders only ({', '.join(SUPPORTED_ARCHITECTURES)} with "
        f"silu MLPs and rope types {', '.join(_ROPE_TYPES)}); convert the model to one of them or pick another.")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about shapes and numerics."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted (key, value) pairs; hashable
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (Qwen2; Llama attention_bias)
    dense_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)  # e.g. mask_token_id

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def get(self, key: str, default: Any = None) -> Any:
        """A field not modelled explicitly (kept from the HF config), e.g. `mask_token_id`."""
        return dict(self.extra).get(key, default)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Build from a HF config.json dict (and optionally generation_config.json for extra EOS ids)."""
        archs = list(cfg.get("architectures") or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type")
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if archs or model_type not in by_type:
                raise _unsupported(f"Unsupported architecture {archs or model_type!r}")
            arch = by_type[model_type]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(f"Unsupported MLP activation {act!r} in a {arch} config")
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise _unsupported(f"Mixture-of-experts {arch} configs are not supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
            layers = int(cfg["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as e:
            raise _unsupported(f"The {arch} config lacks or mangles a required field ({e})") from e

        rope = dict(cfg.get("rope_parameters") or {})  # transformers 5
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = dict(cfg.get("rope_scaling") or {})
        scaling.update({k: v for k, v in rope.items() if k != "rope_theta"})
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise _unsupported(f"Unsupported rope scaling {rope_type!r}")
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        rope_scaling = None if rope_type == "default" else tuple(sorted(scaling.items()))

        qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        dense_bias = arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            e = src.get("eos_token_id")
            for t in (e if isinstance(e, (list, tuple)) else [e]):
                if t is not None and int(t) not in eos:
                    eos.append(int(t))
        known = set(cls.__dataclass_fields__) | {"rope_parameters", "architectures"}
        extra = tuple(sorted((k, v) for k, v in cfg.items()
                             if k not in known and isinstance(v, (int, float, str, bool)) and v is not None))
        return cls(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
            rope_scaling=rope_scaling, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias, dense_bias=dense_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=int(window) if window else None, eos_token_ids=tuple(eos),
            pad_token_id=cfg.get("pad_token_id"), bos_token_id=cfg.get("bos_token_id"),
            architecture=arch, extra=extra)

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim/2] float32 and the attention scaling factor for cos/sin."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
        sc = self.rope_scaling_dict
        kind = sc.get("rope_type", "default")
        if kind == "linear":
            inv = inv / float(sc["factor"])
        elif kind == "llama3":
            factor = float(sc["factor"])
            low = float(sc.get("low_freq_factor", 1.0))
            high = float(sc.get("high_freq_factor", 4.0))
            old_ctx = float(sc.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv, 1.0
