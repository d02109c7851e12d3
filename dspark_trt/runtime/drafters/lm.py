"""LM drafter: any causal LM with the target's vocabulary, run by the runtime's CausalLM.

Owns: per-slot KV cache of the draft LM (its own context, fed the committed tokens), autoregressive
proposal of γ tokens (γ small forwards), or one-pass PARD proposal over [anchor, MASK×(γ−1)] when the
checkpoint declares mask_token_id and pard=true. Every proposal rolls the draft cache back, so the
context state is unchanged. Target features are ignored (target_layer_ids = ()). Token choice goes through
runtime.dispatch.draft_tokens (argmax, or the STREAM_DRAFT race keyed on seed and absolute position).
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark_trt.errors import DrafterError
from dspark_trt.runtime import dispatch
from dspark_trt.spec_decode.protocols import DraftBlock, SamplingParams


class LMDrafter:
    """spec_decode.protocols.Drafter over a runtime CausalLM (autoregressive or PARD one-pass)."""

    target_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, gamma: int = 7, pard: bool = False,
                 mask_token_id: int | None = None) -> None:
        if pard and mask_token_id is None:
            raise DrafterError("PARD drafting needs mask_token_id in the draft config. Fix: add mask_token_id "
                               "to config.json or set pard=false.")
        self.model = model.eval()
        self.gamma = int(gamma)
        self.pard = bool(pard)
        self.mask_token_id = mask_token_id
        self.vocab_size = int(model.config.vocab_size)
        self.cache = None

    def allocate(self, max_batch: int, max_seq: int) -> None:
        self.cache = self.model.new_cache(max_batch, max_seq + self.gamma + 1)

    def _need_cache(self):  # noqa: ANN202
        if self.cache is None:
            raise DrafterError("LM drafter used before allocate(max_batch, max_seq). Fix: call allocate first.")
        return self.cache

    @torch.inference_mode()
    def extend_context(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                       features: torch.Tensor | None) -> None:
        cache = self._need_cache()
        slots = torch.as_tensor(slots, dtype=torch.long)
        start = cache.lengths[slots].clone()  # [B]
        self.model(tokens, cache, slots, logits="none")
        cache.truncate(slots, start + lengths.to(start.device))

    @torch.inference_mode()
    def propose(self, slots: torch.Tensor, anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
                positions: torch.Tensor | None = None) -> DraftBlock:
        """γ tokens after each anchor; positions [B] = absolute position of d_1 (None → context length + 1)."""
        cache = self._need_cache()
        if gamma < 1:
            raise DrafterError(f"gamma={gamma} must be ≥ 1. Fix: ask for at least one draft token.")
        slots = torch.as_tensor(slots, dtype=torch.long)
        start = cache.lengths[slots].clone()  # [B] context length = position of the anchor
        pos = (start + 1 if positions is None else torch.as_tensor(positions)).to(torch.long).cpu()  # [B] d_1
        B = slots.numel()
        toks = torch.empty(B, gamma, dtype=torch.long)  # [B, γ]
        q = torch.empty(B, gamma, self.vocab_size)  # [B, γ, V]
        try:
            if self.pard:
                x = torch.full((B, gamma), int(self.mask_token_id), dtype=torch.long)
                x[:, 0] = anchors
                logits = self.model(x, cache, slots, logits="all").logits  # [B, γ, V]
                blk = dispatch.draft_tokens(logits, sampling, pos)
                toks[:], q[:] = blk.tokens.cpu(), blk.q.cpu()
            else:
                x = anchors.reshape(B, 1).long()
                for k in range(gamma):
                    logits = self.model(x, cache, slots, logits="last").logits  # [B, 1, V]
                    blk = dispatch.draft_tokens(logits, sampling, pos + k)
                    toks[:, k], q[:, k] = blk.tokens[:, 0].cpu(), blk.q[:, 0].cpu()
                    x = blk.tokens.reshape(B, 1).to(x.device)
        finally:
            cache.truncate(slots, start)
        greedy = all(p.greedy for p in sampling)
        return DraftBlock(tokens=toks, q=None if greedy else q, conf=None)

    def release(self, slot: int) -> None:
        if self.cache is not None:
            self.cache.reset(slot)
