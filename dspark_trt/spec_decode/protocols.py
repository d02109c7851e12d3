"""Contracts between the algorithm (dspark_trt.spec_decode) and whatever executes models.

spec_decode/ owns these types; runtime/ implements them. Nothing here imports torch model code,
Triton or tritonclient. Shapes: B requests in a round, γ block size, K ≤ γ verify length,
V vocabulary, F = len(target_layer_ids) * hidden_size draft features.

Positions: a request with n committed tokens (prompt + generated) has its anchor at absolute position n − 1
and d_1 at position n. `positions` [B] below is always that n — the RNG key of draft sampling
(spec_decode.rng STREAM_DRAFT, d_j at positions + j − 1) and of acceptance (STREAM_ACCEPT / STREAM_RESAMPLE).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from dspark_trt.spec_decode.sampling import SamplingParams

if TYPE_CHECKING:
    from dspark_trt.spec_decode.accept import AcceptResult

__all__ = ["Backend", "DraftBlock", "Drafter", "SamplingParams"]


@dataclass
class DraftBlock:
    """One drafter pass for B requests."""

    tokens: torch.Tensor  # [B, γ] long: proposed draft tokens d_1..d_γ
    q: torch.Tensor | None  # [B, γ, V] float32 draft distributions at the serving temperature/top-p; None when greedy
    conf: torch.Tensor | None  # [B, γ] float32 in (0, 1): per-position confidence c_k (None: drafter has no head)


class Drafter(Protocol):
    """A drafter proposes γ tokens after an anchor, per slot (one slot = one request)."""

    gamma: int  # block size it was built/trained for (max proposal length)
    target_layer_ids: tuple[int, ...]  # target layers whose outputs it consumes; () = none (standalone LM)

    def allocate(self, max_batch: int, max_seq: int) -> None:
        """Create per-slot state (KV caches) for up to max_batch slots of max_seq tokens."""

    def extend_context(
        self,
        slots: torch.Tensor,  # [B] long
        tokens: torch.Tensor,  # [B, T] long: newly committed tokens (right-padded)
        lengths: torch.Tensor,  # [B] long: valid tokens per row (≤ T)
        features: torch.Tensor | None,  # [B, T, F]: target hidden states at those positions, or None
    ) -> None:
        """Append committed context. The anchor (last committed token) is NOT part of the context."""

    def propose(
        self,
        slots: torch.Tensor,  # [B] long
        anchors: torch.Tensor,  # [B] long: last committed token of each request
        gamma: int,
        sampling: Sequence[SamplingParams],
        positions: torch.Tensor | None = None,  # [B] long: absolute position of d_1 (committed length)
    ) -> DraftBlock:
        """Propose gamma tokens after each anchor. Must leave the context state unchanged.

        Sampled rows draw d_j with spec_decode.rng's STREAM_DRAFT keyed (seed, positions + j − 1) — through
        runtime.dispatch, never a stateful generator — so a seed fixes the draft whatever ran before. positions
        None → the drafter's own context length + 1 (the same number: its context is every committed token
        but the anchor)."""

    def release(self, slot: int) -> None:
        """Forget a slot's state."""


class Backend(Protocol):
    """A target (+ drafter) pair with slot-based KV caches; what the speculative loop drives.

    Invariant per slot: the target cache holds every committed token except the newest one,
    which is the next round's anchor (its KV is written by the next verify pass).
    """

    vocab_size: int
    max_batch: int
    max_seq: int

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run the prompts, feed the drafter its context; return logits at each last prompt position [B, V]."""

    def draft(self, slots: Sequence[int], anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
              positions: torch.Tensor) -> DraftBlock:
        """anchors [B] long, positions [B] long (absolute position of d_1) → a DraftBlock of γ tokens per slot."""

    def verify(self, slots: Sequence[int], tokens: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """tokens [B, Kmax+1] = [anchor, d_1..d_Kmax] (right-padded), k [B] → target logits [B, Kmax+1, V] float32.
        Writes target KV for those positions and keeps the tapped hidden states until commit()."""

    def commit(self, slots: Sequence[int], n_keep: torch.Tensor) -> None:
        """n_keep [B] = 1 + accepted: how many of the last verify's tokens stay in the target cache (the anchor
        and accepted drafts). Rolls the target cache back past them and hands the drafter those tokens + features."""

    def accept(
        self,
        logits: torch.Tensor,  # [B, K+1, V] target logits from verify()
        draft: torch.Tensor,  # [B, K] draft tokens
        k: torch.Tensor,  # [B] long: per-request verify length
        q: torch.Tensor | None,  # [B, K, V] draft distributions (sampling) or None (greedy)
        sampling: Sequence[SamplingParams],
        positions: torch.Tensor,  # [B] long: absolute position of d_1 (the RNG key of sampled rows)
    ) -> AcceptResult:
        """Fused acceptance (kernels on CUDA, dspark_trt.spec_decode.accept on CPU) → AcceptResult with
        spec_decode.accept.greedy_accept / sample_accept semantics."""

    def release(self, slot: int) -> None:
        """Free a slot (finished or cancelled request)."""
