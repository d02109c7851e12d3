"""Contracts between the algorithm (dspark_trt.spec_decode) and whatever executes models.

spec_decode/ owns these types; runtime/ and serve/ implement them. Nothing here imports torch model code,
Triton or tritonclient. Shapes: B requests in a round, γ block size, K ≤ γ verify length,
V vocabulary, F = len(target_layer_ids) * hidden_size draft features.

Two levels:
- `Drafter` and `Backend`: a drafter, and a target + drafter pair over slot KV caches (runtime.backend.SpecBackend).
- `RoundExecutor`: the model side of one speculative round as spec_decode.loop.RoundScheduler drives it — prefill,
  draft, verify (+ accept + commit) — over the rows (`RoundRow`) the scheduler owns. Two implementations:
  spec_decode.executor.BackendExecutor (the reference runtime: any Backend) and serve.gpu_host.rounds.TrtllmExecutor
  (TensorRT-LLM engines through Triton BLS). Its steps answer with one frozen outcome each: `DraftOutcome`,
  `VerifyOutcome`.

Positions: a request with n committed tokens (prompt + generated) has its anchor at absolute position n − 1
and d_1 at position n. `positions` [B] below is always that n — the RNG key of draft sampling
(spec_decode.rng STREAM_DRAFT, d_j at positions + j − 1) and of acceptance (STREAM_ACCEPT / STREAM_RESAMPLE).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

from dspark_trt.spec_decode.sampling import SamplingParams

if TYPE_CHECKING:
    from dspark_trt.spec_decode.accept import AcceptResult
    from dspark_trt.spec_decode.scheduler import PolicyConfig

__all__ = ["Backend", "DraftBlock", "DraftOutcome", "Drafter", "RoundExecutor", "RoundRow", "SamplingParams",
           "VerifyOutcome"]


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

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                offsets: Sequence[int] | None = None) -> torch.Tensor:
        """Run the prompts, feed the drafter its context; return logits at each last prompt position [B, V].
        offsets (backends with `chunked_prefill = True`): prompts[r] continues slot r's prompt after the offsets[r]
        tokens already in its cache (0: a new prompt; the slot is reset) — chunked prefill."""

    def draft(self, slots: Sequence[int], anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
              positions: torch.Tensor) -> DraftBlock:
        """anchors [B] long, positions [B] long (absolute position of d_1) → a DraftBlock of γ tokens per slot."""

    def verify(self, slots: Sequence[int], tokens: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """tokens [B, Kmax+1] = [anchor, d_1..d_Kmax] (right-padded), k [B] → target logits [B, Kmax+1, V] float32.
        Writes target KV for those positions and keeps the tapped hidden states until commit()."""

    def commit(self, slots: Sequence[int], n_keep: torch.Tensor) -> None:
        """n_keep [B] = 1 + accepted: how many of the last verify's tokens stay in the target cache (the anchor
        and accepted drafts). Rolls the target cache back past them and hands the drafter those tokens + features.
        Consumes what that verify() left (runtime.backend.SpecBackend: its `pending_commit`)."""

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


class RoundRow(Protocol):
    """One active request as a RoundExecutor sees it (read-only: spec_decode.loop.RoundScheduler owns it)."""

    rid: int  # the scheduler's request id
    slot: int  # its KV slot, 0 ≤ slot < max_batch (free again after release)

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def policy(self) -> "PolicyConfig": ...

    @property
    def sequence(self) -> tuple[int, ...]:
        """The committed tokens: prompt + generated (at prefill: the prompt)."""

    @property
    def n_committed(self) -> int:
        """len(sequence): the absolute position of d_1 (the RNG key of draft, accept and first-token draws)."""

    @property
    def anchor(self) -> int:
        """The newest committed token (the next verify writes its KV)."""


@dataclass(frozen=True)
class DraftOutcome:
    """One draft step over the R rows it was asked for (in that order)."""

    block: DraftBlock | None  # tokens [R, γ'] (row r valid up to proposed[r]), q [R, γ', V] | None,
    # conf [R, γ'] | None; None: nothing was drafted
    proposed: tuple[int, ...]  # [R] tokens drafted per row; 0: its drafting failed (that row runs plain this round)
    flushed: tuple[int, ...] = ()  # [R] queued context tokens the pass projected first (a lazy drafter's backlog:
    # the tokens committed since its last block); () where the executor does not know

    @classmethod
    def failed(cls, rows: int) -> "DraftOutcome":
        """Every row's drafting failed: the round is plain decoding for them."""
        return cls(None, (0,) * rows)


@dataclass(frozen=True)
class VerifyOutcome:
    """What one verify step (verify → accept → commit) did, per row of the round."""

    accepted: tuple[int, ...]  # [B] drafts accepted (0 ≤ accepted ≤ k)
    committed: tuple[tuple[int, ...], ...]  # [B] tokens committed, in order: d_1..d_accepted, then target tokens
    # (the recovered / bonus token; at least accepted + 1 tokens); the last is the row's new anchor
    top1: tuple[Sequence[float], ...]  # [B] × [n]: target top-1 probability per verified position (policies)
    margin: tuple[Sequence[float], ...]  # [B] × [n]: top-1 − top-2 probability per verified position

    def __post_init__(self) -> None:
        if not len(self.accepted) == len(self.committed) == len(self.top1) == len(self.margin):
            raise ValueError(f"VerifyOutcome rows disagree: {len(self.accepted)} accepted, {len(self.committed)} "
                             f"committed, {len(self.top1)} top1, {len(self.margin)} margin")


@runtime_checkable
class RoundExecutor(Protocol):
    """The model side of the rounds spec_decode.loop.RoundScheduler runs (which owns requests, slots, caps, K,
    stop conditions, cancellation and stats). Rows are RoundRows; lists of them are in the round's row order.

    Invariant per row: after prefill and after every verify, the executor holds the row's committed tokens
    (cache state, or the sequence it resends), the newest one being the anchor of the next round."""

    vocab_size: int
    max_batch: int  # rows in flight at once (slots 0..max_batch − 1)
    max_seq: int  # tokens one row may hold (spec_decode.limits.request_room applies)
    can_draft: bool  # False: no drafter here; every round is plain (caps 0, draft() is never called)
    keyed_sampling: bool  # True: sampled rows draw from spec_decode.rng keyed on the request's seed (add() gives a
    # seedless request a random one); False: the engine samples, the seed goes through as given

    def prefill(self, rows: Sequence[RoundRow], spans: Sequence[tuple[int, int]] | None = None) -> list[int]:
        """Run each row's prompt (row.sequence) into its slot → its first generated token (the token at position
        row.n_committed). spans (executors with `chunked_prefill = True` only): run prompt tokens [a, b) of each row,
        the slot already holding [0, a); the first token is meaningful only for rows whose b is the prompt's end."""

    def draft(self, rows: Sequence[RoundRow], caps: Sequence[int]) -> DraftOutcome:
        """Propose up to caps[r] ≥ 1 tokens after each row's anchor. May raise (the scheduler runs the round as plain
        decoding); a row it could not draft gets proposed 0."""

    def verify(self, rows: Sequence[RoundRow], draft: DraftBlock, k: Sequence[int]) -> VerifyOutcome:
        """Verify d_1..d_k[r] of every row — draft.tokens [B, K] right-padded (K = max k), draft.q [B, K, V] | None
        for rejection sampling — accept, and commit → VerifyOutcome (the committed tokens are the executor's state
        when it returns)."""

    def release(self, slot: int) -> None:
        """Forget a slot (finished or cancelled request)."""
