"""On-policy drafter training: the anchors the real greedy draft-and-verify loop visits, and the positions it reaches.

Owns the rollout and its batches. The data are the target's own greedy answers, so a greedy loop over a training
sequence is fully determined by the drafter: from the first answer token, each round's block is accepted up to its
first token that differs from the sequence, the target's token is committed after it, and the next round starts
there. Inside an accepted prefix the drafter's Markov inputs are the sequence's tokens, so a teacher-forced pass at
every anchor gives every round's block exactly (`DSparkModel.forward_train`). `rollout` walks that path per
sequence; `onpolicy_batch` trains on the path's anchors with the loop's reach as loss weights: 1 for the accepted
positions, `reject_weight` for the first rejected one, 0 after it (the loop never gets there). The trainer mixes
these batches with the supervised (uniform-anchor) ones as replay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.train.batches import Batch, SeqRef, gather_batch
from dspark_trt.train.features import FeatureStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnPolicyConfig:
    every: int = 0  # refresh the rollout every this many steps (0 = supervised only)
    start: int = 0  # the first step that may draw on-policy batches
    start_frac: float = 0.0  # …and the share of the run (steps, or minutes under a time budget) done before it
    seqs: int = 64  # training sequences rolled out per refresh
    frac: float = 0.5  # share of the steps that train on an on-policy batch (the rest: supervised replay)
    reject_weight: float = 2.0  # loss weight of the first rejected position of a block

    def __post_init__(self) -> None:
        if (self.every < 0 or self.seqs < 1 or not 0.0 <= self.frac <= 1.0 or self.reject_weight < 0
                or not 0.0 <= self.start_frac < 1.0):
            raise InvalidArgumentError(f"on-policy settings need every ≥ 0, seqs ≥ 1, 0 ≤ frac ≤ 1 and "
                                       f"reject_weight ≥ 0, 0 ≤ start_frac < 1, got {self}. Fix: e.g. --onpolicy-every 200 "
                                       f"--onpolicy-frac 0.5 --reject-weight 2.")


@dataclass(frozen=True)
class Path:
    """One sequence's greedy loop: the anchors it visits (window-relative, window = the whole sequence) and the
    drafts accepted at each."""

    ref: SeqRef
    length: int
    anchors: np.ndarray  # [R] int64
    accepted: np.ndarray  # [R] int64, 0..γ


@torch.no_grad()
def acceptance_at_every_anchor(model: torch.nn.Module, features: torch.Tensor, tokens: torch.Tensor, lo: int,
                               gamma: int, chunk: int = 64) -> np.ndarray:
    """features [1, n, F], tokens [1, n] → accepted [n] (greedy drafts of the block after anchor a that equal
    tokens[a+1 ..], for lo ≤ a ≤ n − γ − 1; 0 elsewhere)."""
    n = tokens.shape[1]
    acc = np.zeros(n, dtype=np.int64)
    for c0 in range(lo, n - gamma, chunk):
        anc = torch.arange(c0, min(c0 + chunk, n - gamma), device=tokens.device)[None]  # [1, A]
        _, logits, _ = model.forward_train(features, tokens, anc, gamma)  # [1, A, γ, Vd]
        draft = model.d2t[logits.argmax(-1)[0]]  # [A, γ] target ids (d2t is the identity for the full vocab)
        want = tokens[0, anc[0, :, None] + 1 + torch.arange(gamma, device=tokens.device)]  # [A, γ]
        acc[anc[0].cpu().numpy()] = (draft == want).long().cumprod(-1).sum(-1).cpu().numpy()
    return acc


def rollout(model: torch.nn.Module, stores: Sequence[FeatureStore], refs: Sequence[SeqRef], gamma: int,
            max_len: int, autocast_bf16: bool = True) -> list[Path]:
    """The greedy loop's path over each referenced sequence that fits one window (longer ones are skipped)."""
    was_training = model.training
    model.eval()
    dev = model.d2t.device
    paths = []
    for ref in refs:
        st = stores[ref.store]
        a0, b0 = st.seq(ref.index)
        n, start = b0 - a0, max(1, int(st.start[ref.index]))
        if n > max_len or start > n - gamma - 1:
            continue
        feats = st.feature_rows(a0, b0)[None].to(dev)  # [1, n, F]
        toks = torch.from_numpy(st.tokens[a0:b0].astype(np.int64))[None].to(dev)  # [1, n]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            acc = acceptance_at_every_anchor(model, feats, toks, start, gamma)
        anchors, accepted, a = [], [], start
        while a <= n - gamma - 1:
            anchors.append(a)
            accepted.append(int(acc[a]))
            a += int(acc[a]) + 1
        paths.append(Path(ref, n, np.array(anchors, dtype=np.int64), np.array(accepted, dtype=np.int64)))
    model.train(was_training)
    return paths


def reach_weights(accepted: np.ndarray, gamma: int, reject_weight: float) -> np.ndarray:
    """accepted [A] → [A, γ] loss weights: 1 up to the accepted count, reject_weight at the first rejected
    position, 0 after it."""
    k = np.arange(gamma)[None, :]
    a = accepted[:, None]
    return np.where(k < a, 1.0, np.where(k == a, reject_weight, 0.0)).astype(np.float32)


def onpolicy_batch(stores: Sequence[FeatureStore], paths: Sequence[Path], rng: np.random.Generator, batch_seqs: int,
                   anchors: int, gamma: int, reject_weight: float) -> Batch:
    """batch_seqs paths, `anchors` of each path's anchors (drawn with replacement), weighted by the loop's reach."""
    rows, weights = [], []
    for j in rng.integers(0, len(paths), size=batch_seqs):
        p = paths[int(j)]
        pick = np.sort(rng.integers(0, len(p.anchors), size=anchors))
        rows.append((p.ref, 0, p.length, p.anchors[pick]))
        weights.append(reach_weights(p.accepted[pick], gamma, reject_weight))
    return gather_batch(stores, rows, gamma, weights)


def path_tau(paths: Sequence[Path]) -> float:
    """τ of the rolled-out loop (committed tokens per round) over the paths."""
    rounds = sum(len(p.anchors) for p in paths)
    return float(sum(int(p.accepted.sum()) + len(p.anchors) for p in paths) / max(1, rounds))
