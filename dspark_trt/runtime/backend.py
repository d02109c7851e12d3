"""The runtime's spec_decode.protocols.Backend: a target CausalLM (+ optional drafter) over slot KV caches.

Owns: batched ragged prefill, verify passes that tap the drafter's target layers, commit/rollback of the target
cache and feeding the drafter its committed context, release, and routing acceptance to runtime.dispatch
(kernels on CUDA, spec_decode.accept on CPU). The verify → commit handoff is explicit: verify() leaves a frozen
VerifyPass (its tokens, the pre-verify cache lengths, the tapped hidden states) in `pending_commit`, the one thing
commit() reads and clears. Slot ids are the caller's (spec_decode.loop keeps the free list; it drives this class
through spec_decode.executor.BackendExecutor). Must not know about scheduling policies, Triton or files.

Invariant per slot (spec_decode.protocols.Backend): the target cache holds every committed token except the
newest one, which is the next round's anchor. The drafter's context is the same token sequence.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.runtime.model import CausalLM
from dspark_trt.spec_decode.accept import AcceptResult
from dspark_trt.spec_decode.protocols import DraftBlock, Drafter, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyPass:
    """What one verify() leaves for the commit() after it: its tokens, pre-verify lengths and tapped features."""

    row_of: dict[int, int]  # slot -> row in the verify batch
    tokens: torch.Tensor  # [B, K+1] long
    start: torch.Tensor  # [B] long: target cache length before verify (= committed - 1)
    hidden: torch.Tensor | None  # [B, K+1, F] target taps, None when the drafter takes none


class SpecBackend:
    """spec_decode.protocols.Backend over a runtime CausalLM target and an optional spec_decode.protocols.Drafter."""

    chunked_prefill = True  # prefill(..., offsets) continues a slot's prompt (spec_decode.loop: LoopConfig.prefill_chunk)

    def __init__(self, target: CausalLM, drafter: Drafter | None, max_batch: int, max_seq: int,
                 verify_slack: int | None = None) -> None:
        if max_batch < 1 or max_seq < 2:
            raise InvalidArgumentError(f"SpecBackend needs max_batch ≥ 1 and max_seq ≥ 2 (got {max_batch}, {max_seq}).")
        self.target = target
        self.drafter = drafter
        self.vocab_size = int(target.config.vocab_size)
        self.max_batch = int(max_batch)
        self.max_seq = int(max_seq)
        gamma = int(getattr(drafter, "gamma", 0) or 0)
        # verify pads every row to the batch's longest K, so a slot may briefly hold Kmax+1 tokens past its length
        self.slack = verify_slack if verify_slack is not None else max(16, gamma + 1)
        self.cache = target.new_cache(self.max_batch, self.max_seq + self.slack)
        self.taps: tuple[int, ...] = tuple(getattr(drafter, "target_layer_ids", ()) or ())
        if drafter is not None:
            drafter.allocate(self.max_batch, self.max_seq + self.slack)
        self.pending_commit: VerifyPass | None = None  # the last verify, until commit() (None after prefill)

    def _slot_tensor(self, slots: Sequence[int]) -> torch.Tensor:
        s = torch.as_tensor(list(slots), dtype=torch.long)  # [B]
        if s.numel() == 0:
            raise InvalidArgumentError("Empty slot list; pass at least one slot.")
        if len(set(s.tolist())) != s.numel():
            raise InvalidArgumentError(f"Duplicate slots {s.tolist()} in one batch.")
        if int(s.min()) < 0 or int(s.max()) >= self.max_batch:
            raise InvalidArgumentError(f"Slots {s.tolist()} out of range 0..{self.max_batch - 1}.")
        return s

    # ----------------------------------------------------------------- protocol
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                offsets: Sequence[int] | None = None) -> torch.Tensor:
        """Reset the slots, run the prompts (right-padded batch), feed the drafter; logits [B, V] float32.
        offsets [B] (chunked prefill): prompts[r] continues slot r after the offsets[r] prompt tokens it holds
        (0 resets it as without offsets); every row's tokens see their slot's cache, so a prompt prefilled in
        chunks leaves the same cache and drafter context as in one pass (the kernels are row-invariant)."""
        s = self._slot_tensor(slots)
        if len(prompts) != s.numel():
            raise InvalidArgumentError(f"prefill: {s.numel()} slots but {len(prompts)} prompts.")
        offs = [0] * s.numel() if offsets is None else [int(o) for o in offsets]
        if len(offs) != s.numel():
            raise InvalidArgumentError(f"prefill: {s.numel()} slots but {len(offs)} offsets.")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise InvalidArgumentError("prefill: every prompt needs at least one token.")
        if max(o + n for o, n in zip(offs, lengths)) > self.max_seq:
            raise InvalidArgumentError(f"prefill: a prompt of {max(o + n for o, n in zip(offs, lengths))} tokens "
                                       f"exceeds max_seq={self.max_seq}; shorten it or raise max_seq.")
        for slot, off in zip(s.tolist(), offs):
            if off == 0:
                self.cache.reset(slot)
                if self.drafter is not None:
                    self.drafter.release(slot)
            elif int(self.cache.lengths[slot]) != off:
                raise InvalidArgumentError(f"prefill: slot {slot} holds {int(self.cache.lengths[slot])} tokens, not "
                                           f"the offset {off} its chunk continues; prefill the chunks in order.")
        T = max(lengths)
        ids = torch.zeros(s.numel(), T, dtype=torch.long)  # [B, T] right-padded
        for row, p in enumerate(prompts):
            ids[row, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        n = torch.tensor(lengths, dtype=torch.long)  # [B]
        out = self.target(ids, self.cache, s, taps=self.taps, logits="last", last_index=n - 1)
        self.cache.truncate(s, torch.tensor(offs, dtype=torch.long) + n)
        if self.drafter is not None:
            self.drafter.extend_context(s, ids, n, out.hidden)
        self.pending_commit = None
        return out.logits[:, 0]  # [B, V]

    def draft(self, slots: Sequence[int], anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
              positions: torch.Tensor | None = None) -> DraftBlock:
        """anchors [B], positions [B] (absolute position of d_1; None → the drafter's context length + 1) →
        the drafter's DraftBlock (tokens [B, γ], q [B, γ, V] | None, conf [B, γ] | None)."""
        if self.drafter is None:
            raise InvalidArgumentError("This backend has no drafter; use the 'plain' policy (K = 0) or load a drafter.")
        return self.drafter.propose(self._slot_tensor(slots), anchors.long().reshape(-1), gamma, sampling,
                                    None if positions is None else positions.long().reshape(-1))

    def queued_context(self, slots: Sequence[int]) -> list[int]:
        """Per slot, the committed tokens the drafter will project before its next block (0 for a drafter that
        extends its context eagerly, or none)."""
        queued = getattr(self.drafter, "queued", None)
        return list(queued(slots)) if queued is not None else [0] * len(slots)

    def verify(self, slots: Sequence[int], tokens: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """tokens [B, Kmax+1] = [anchor, d_1..d_Kmax], k [B] → logits [B, Kmax+1, V] float32; sets pending_commit."""
        s = self._slot_tensor(slots)
        if tokens.dim() != 2 or tokens.shape[0] != s.numel():
            raise InvalidArgumentError(f"verify: tokens must be [B={s.numel()}, K+1], got {tuple(tokens.shape)}.")
        start = self.cache.lengths[s].clone()  # [B]
        kk = torch.as_tensor(k, dtype=torch.long).reshape(-1)  # [B]: a row verifies its own K + 1 tokens, not Kmax + 1
        out = self.target(tokens.long(), self.cache, s, taps=self.taps, logits="all",
                          row_lengths=kk + 1 if kk.numel() == s.numel() else None)
        self.pending_commit = VerifyPass({slot: row for row, slot in enumerate(s.tolist())}, tokens.long(), start,
                                         out.hidden)
        return out.logits  # [B, K+1, V]

    def commit(self, slots: Sequence[int], n_keep: torch.Tensor) -> None:
        """Keep the first n_keep [B] verify tokens per slot in the target cache; feed them to the drafter
        (consumes pending_commit)."""
        p = self.pending_commit
        if p is None:
            raise InvalidArgumentError("commit without a preceding verify; call verify(slots, tokens, k) first.")
        s = self._slot_tensor(slots)
        keep = torch.as_tensor(n_keep, dtype=torch.long).reshape(-1)  # [B]
        if keep.numel() != s.numel():
            raise InvalidArgumentError(f"commit: {s.numel()} slots but {keep.numel()} n_keep values.")
        try:
            rows = torch.tensor([p.row_of[slot] for slot in s.tolist()], dtype=torch.long)  # [B]
        except KeyError as e:
            raise InvalidArgumentError(f"commit: slot {e.args[0]} was not in the last verify batch.") from None
        width = p.tokens.shape[1]
        if int(keep.min()) < 1 or int(keep.max()) > width:
            raise InvalidArgumentError(f"commit: n_keep {keep.tolist()} must lie in 1..{width} (anchor + accepted).")
        self.cache.truncate(s, p.start[rows] + keep)
        if self.drafter is not None:
            m = int(keep.max())
            feats = None if p.hidden is None else p.hidden[rows, :m]  # [B, m, F]
            self.drafter.extend_context(s, p.tokens[rows, :m], keep, feats)
        self.pending_commit = None

    def accept(self, logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor, q: torch.Tensor | None,
               sampling: Sequence[SamplingParams], positions: torch.Tensor) -> AcceptResult:
        """logits [B, K+1, V], draft [B, K], k [B], q [B, K, V] | None, positions [B] (absolute position of d_1)
        → spec_decode.accept.AcceptResult via runtime.dispatch (kernels on CUDA, the torch reference on CPU)."""
        from dspark_trt.runtime import dispatch  # lazy: keeps triton out of CPU-only imports

        return dispatch.accept(logits, draft, k, q, sampling, positions=positions)

    def release(self, slot: int) -> None:
        """Free a slot in the target cache and the drafter."""
        self._slot_tensor([slot])
        self.cache.reset(slot)
        if self.drafter is not None:
            self.drafter.release(slot)
        if self.pending_commit is not None and slot in self.pending_commit.row_of:
            self.pending_commit = None

    def committed_length(self, slot: int) -> int:
        """Committed tokens of a slot (cache length + the anchor), for diagnostics."""
        return int(self.cache.lengths[slot]) + 1
