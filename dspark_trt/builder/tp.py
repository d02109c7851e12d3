"""Tensor-parallel sharding of TRT-LLM-named state dicts (our writer), and the re-export of reassembly.

Owns `shard_state`: the TRT-LLM split (tensorrt_llm/models/llama/convert.py split_matrix_tp): attention.qkv
rows per rank = [q_r | k_r | v_r]; column-parallel mlp.fc / mlp.gate / lm_head / vocab_embedding rows;
row-parallel attention.dense / mlp.proj columns; norms replicated. The inverse lives with the loader
(runtime.trtllm_checkpoint.reassemble_ranks) so the runtime can rebuild the unsharded model from ranks.
Must not know about files.
"""
from __future__ import annotations

from typing import Any

import torch

from dspark_trt.errors import BuildError
from dspark_trt.runtime.trtllm_checkpoint import reassemble_ranks

__all__ = ["shard_state", "reassemble_ranks", "check_tp"]


def check_tp(cfg: dict[str, Any], tp: int) -> None:
    """TP must divide heads, kv heads, the MLP width and the vocabulary (no kv-head duplication here)."""
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    for what, n in (("attention heads", heads), ("key/value heads", kv), ("intermediate size",
                    int(cfg["intermediate_size"])), ("vocabulary", int(cfg["vocab_size"]))):
        if n % tp:
            raise BuildError(f"--tp-size {tp} does not divide the {what} ({n}); pick a tp size that divides it.")


def shard_state(state: dict[str, torch.Tensor], cfg: dict[str, Any], tp: int) -> list[dict[str, torch.Tensor]]:
    """Unsharded TRT-LLM state dict → tp rank state dicts."""
    if tp == 1:
        return [dict(state)]
    check_tp(cfg, tp)
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_size") or int(cfg["hidden_size"]) // heads)
    q_n, kv_n = heads * d, kv * d
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in state.items():
        per_tensor = t.dim() == 0 or t.numel() == 1
        if ".attention.qkv." in name and not per_tensor and not name.endswith("prequant_scaling_factor"):
            q, k, v = t[:q_n].chunk(tp, 0), t[q_n:q_n + kv_n].chunk(tp, 0), t[q_n + kv_n:].chunk(tp, 0)
            parts = [torch.cat((q[r], k[r], v[r]), 0) for r in range(tp)]
        elif any(s in name for s in ("mlp.fc.", "mlp.gate.", "lm_head.", "vocab_embedding.")) and not per_tensor \
                and not name.endswith("prequant_scaling_factor"):
            parts = list(t.chunk(tp, 0))
        elif any(s in name for s in ("attention.dense.", "mlp.proj.")) and name.endswith(".weight"):
            parts = list(t.chunk(tp, 1))
        elif any(s in name for s in ("attention.dense.", "mlp.proj.")) and name.endswith("prequant_scaling_factor"):
            parts = list(t.chunk(tp, 0))
        else:
            parts = [t] * tp
        for r in range(tp):
            ranks[r][name] = parts[r].contiguous()
    return ranks
