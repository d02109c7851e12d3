"""Training batches from FeatureStores: windows of sequences, random anchors, and the teacher's top-k.

Owns: train/held-out split by sequence (deterministic), windowing long sequences (keeping the answer start
reachable), anchor sampling (uniform with replacement in [max(1, start), n − γ]), and gathering per-slot
teacher top-k for block slots a..a+γ−1. Deterministic given a numpy Generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dspark_trt.train.features import FeatureStore


@dataclass
class Batch:
    features: torch.Tensor  # [B, L, F] bfloat16
    tokens: torch.Tensor  # [B, L] long
    anchors: torch.Tensor  # [B, A] long (window-relative)
    topk_ids: torch.Tensor  # [B, A, γ, k] long target ids
    topk_logp: torch.Tensor  # [B, A, γ, k] float32
    valid: torch.Tensor  # [B, A, γ] bool, or float loss weights (0 = ignored)


@dataclass(frozen=True)
class SeqRef:
    store: int
    index: int


def eligible(stores: Sequence[FeatureStore], gamma: int) -> list[SeqRef]:
    out = []
    for si, st in enumerate(stores):
        for i in range(st.num_sequences):
            a, b = st.seq(i)
            if max(1, int(st.start[i])) <= (b - a) - gamma:
                out.append(SeqRef(si, i))
    return out


def split(refs: list[SeqRef], heldout_frac: float, seed: int) -> tuple[list[SeqRef], list[SeqRef]]:
    rng = np.random.default_rng(seed + 7919)
    mask = rng.random(len(refs)) < heldout_frac
    if heldout_frac > 0 and len(refs) >= 2 and not mask.any():
        mask[-1] = True  # always keep at least one held-out sequence
    return [r for r, m in zip(refs, mask) if not m], [r for r, m in zip(refs, mask) if m]


def take_tokens(stores: Sequence[FeatureStore], refs: list[SeqRef], budget: int, seed: int) -> list[SeqRef]:
    """A seeded random subset of refs holding about `budget` answer tokens (from each sequence's anchor start to
    its end): the same seed gives nested subsets, so drafters trained on 1M ⊂ 2.5M ⊂ 5M tokens share their data."""
    order = np.random.default_rng(seed + 104729).permutation(len(refs))
    out, total = [], 0
    for j in order:
        if total >= budget:
            break
        r = refs[int(j)]
        a, b = stores[r.store].seq(r.index)
        out.append(r)
        total += (b - a) - int(stores[r.store].start[r.index])
    return out


def make_batch(stores: Sequence[FeatureStore], refs: Sequence[SeqRef], rng: np.random.Generator, anchors: int,
               gamma: int, max_len: int) -> Batch:
    rows = []
    for ref in refs:
        st = stores[ref.store]
        a0, b0 = st.seq(ref.index)
        n, start = b0 - a0, int(st.start[ref.index])
        Lw = min(n, max_len)
        lo_w, hi_w = max(0, start - Lw + gamma), n - Lw
        w0 = int(rng.integers(lo_w, hi_w + 1)) if hi_w > lo_w else max(0, min(lo_w, hi_w))
        lo, hi = max(1, start - w0), Lw - gamma
        anc = np.sort(rng.integers(lo, hi + 1, size=anchors))
        rows.append((ref, w0, Lw, anc))
    return gather_batch(stores, rows, gamma)


def gather_batch(stores: Sequence[FeatureStore], rows: Sequence[tuple[SeqRef, int, int, np.ndarray]], gamma: int,
                 weights: Sequence[np.ndarray] | None = None) -> Batch:
    """Rows (ref, window start w0, window length Lw, anchors [A] window-relative) → Batch; weights [A, γ] per row
    (float loss weights, e.g. the on-policy reach) or all ones."""
    L = max(r[2] for r in rows)
    A = len(rows[0][3])
    B, F = len(rows), stores[0].features.shape[1]
    k = stores[0].topk_ids.shape[1]
    feats = torch.zeros(B, L, F, dtype=torch.bfloat16)
    toks = torch.zeros(B, L, dtype=torch.long)
    anc_t = torch.zeros(B, A, dtype=torch.long)
    tk_ids = torch.zeros(B, A, gamma, k, dtype=torch.long)
    tk_lp = torch.zeros(B, A, gamma, k, dtype=torch.float32)
    offs = np.arange(gamma)
    for r, (ref, w0, Lw, anc) in enumerate(rows):
        st = stores[ref.store]
        g0 = st.seq(ref.index)[0] + w0
        feats[r, :Lw] = st.feature_rows(g0, g0 + Lw)
        toks[r, :Lw] = torch.from_numpy(st.tokens[g0:g0 + Lw].astype(np.int64))
        anc_t[r] = torch.from_numpy(anc)
        pos = g0 + anc[:, None] + offs[None, :]  # [A, γ] global positions of the slot targets
        tk_ids[r] = torch.from_numpy(st.topk_ids[pos].astype(np.int64))
        tk_lp[r] = torch.from_numpy(st.topk_logp[pos].astype(np.float32))
    if weights is None:
        valid = torch.ones(B, A, gamma, dtype=torch.bool)
    else:
        valid = torch.from_numpy(np.stack(weights).astype(np.float32))  # [B, A, γ]
    return Batch(feats, toks, anc_t, tk_ids, tk_lp, valid)


def token_counts(stores: Sequence[FeatureStore], refs: Sequence[SeqRef], vocab_size: int) -> torch.Tensor:
    """counts [V] of the target's top-1 next tokens over the referenced sequences (what a draft must predict)."""
    c = np.zeros(vocab_size, dtype=np.int64)
    for ref in refs:
        st = stores[ref.store]
        a, b = st.seq(ref.index)
        np.add.at(c, st.topk_ids[a:b, 0], 1)
        np.add.at(c, st.tokens[a:b], 1)
    return torch.from_numpy(c)
