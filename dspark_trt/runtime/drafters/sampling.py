"""Token choice for drafters: greedy argmax or sampling at the serving temperature / top-p.

Owns the draft distribution q that rejection sampling needs (the exact distribution a token was drawn
from). Greedy rows get a one-hot q. Pure torch; no model code.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark_trt.spec_decode.protocols import SamplingParams


def top_p_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [N, V] → probs [N, V] float32 after temperature and nucleus (top-p) filtering."""
    probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    if top_p >= 1.0:
        return probs
    sp, si = probs.sort(dim=-1, descending=True)
    keep = (sp.cumsum(-1) - sp) < top_p  # always keeps the top token
    sp = sp * keep
    out = torch.zeros_like(probs).scatter_(-1, si, sp)
    return out / out.sum(-1, keepdim=True)


def pick_tokens(logits: torch.Tensor, sampling: Sequence[SamplingParams],
                gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] → (tokens [B] long, probs [B, V] float32 or None when every row is greedy)."""
    greedy_tok = logits.argmax(-1)  # [B]
    if all(p.greedy for p in sampling):
        return greedy_tok, None
    B, V = logits.shape
    probs = torch.zeros(B, V, dtype=torch.float32, device=logits.device)
    toks = greedy_tok.clone()
    for r, p in enumerate(sampling):
        if p.greedy:
            probs[r, greedy_tok[r]] = 1.0
            continue
        pr = top_p_probs(logits[r:r + 1], p.temperature, p.top_p)[0]
        probs[r] = pr
        toks[r] = torch.multinomial(pr.cpu(), 1, generator=gen).to(logits.device)[0]
    return toks, probs
