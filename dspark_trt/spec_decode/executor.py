"""The reference runtime's round executor: spec_decode.protocols.RoundExecutor over any protocols.Backend
(runtime.backend.SpecBackend, its serving / timing proxies, the tests' reference backends).

Owns the model side of a round on slot KV caches: the batched prefill and the first token (argmax, or the
STREAM_RESAMPLE race keyed (seed, prompt length)), one batched draft pass (a malformed block is a failed draft), and
the verify step — target logits over [anchor, d_1..d_K] → acceptance (backend.accept: fused kernels on CUDA,
spec_decode.accept on CPU) → commit of the anchor and the accepted drafts — answered as one VerifyOutcome. Rows,
slots, caps, K, stop conditions and stats are spec_decode.loop.RoundScheduler's.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from dspark_trt.spec_decode import accept as spec_accept
from dspark_trt.spec_decode.accept import AcceptResult
from dspark_trt.spec_decode.protocols import Backend, DraftBlock, DraftOutcome, RoundRow, VerifyOutcome

log = logging.getLogger(__name__)

__all__ = ["BackendExecutor"]


class BackendExecutor:
    """spec_decode.protocols.RoundExecutor over a protocols.Backend: prefill → draft → verify logits → accept →
    commit. A Backend without a drafter raises from draft(), which the scheduler counts as a fallback round."""

    can_draft = True
    keyed_sampling = True  # every draw is spec_decode.rng keyed on (seed, position)

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.vocab_size = int(backend.vocab_size)
        self.max_batch = int(backend.max_batch)
        self.max_seq = int(backend.max_seq)

    def release(self, slot: int) -> None:
        self.backend.release(slot)

    # ---- prefill ---------------------------------------------------------------------------------------
    @property
    def chunked_prefill(self) -> bool:
        """Whether prefill takes spans (the backend continues a slot's prompt: Backend.prefill offsets)."""
        return bool(getattr(self.backend, "chunked_prefill", False))

    def prefill(self, rows: Sequence[RoundRow], spans: Sequence[tuple[int, int]] | None = None) -> list[int]:
        """One batched prefill of the prompts (spans: prompt tokens [a, b) of each row, the slot holding [0, a))
        → each row's first token (meaningful where b is the prompt's end)."""
        slots = [r.slot for r in rows]
        if spans is None:
            logits = self.backend.prefill(slots, [list(r.sequence) for r in rows])  # [B, V]
        else:
            logits = self.backend.prefill(slots, [list(r.sequence[a:b]) for r, (a, b) in zip(rows, spans)],
                                          offsets=[a for a, _ in spans])  # [B, V]
        return self._first_tokens(logits, rows)

    @staticmethod
    def _first_tokens(logits: torch.Tensor, rows: Sequence[RoundRow]) -> list[int]:
        """logits [B, V] at each prompt end → first generated token (argmax, or a sample keyed on position)."""
        logits = logits.float().cpu()  # [B, V]: one row per admitted request, cheap to move
        out = logits.argmax(dim=-1)  # [B]
        sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy]
        if sampled:
            idx = torch.tensor(sampled)
            sp = [rows[i].sampling for i in sampled]
            p = spec_accept.target_probs(logits[idx].float(), torch.tensor([s.temperature for s in sp]),
                                         torch.tensor([s.top_p for s in sp]))  # [b, V]
            seeds = torch.tensor([int(s.seed or 0) for s in sp], dtype=torch.int64)  # [b]
            pos = torch.tensor([rows[i].n_committed for i in sampled], dtype=torch.int64)  # [b]
            out[idx] = spec_accept.exponential_race(p, seeds, pos)
        return [int(t) for t in out.tolist()]

    # ---- draft -----------------------------------------------------------------------------------------
    def draft(self, rows: Sequence[RoundRow], caps: Sequence[int]) -> DraftOutcome:
        """One batched drafter pass of γ' = max(caps) tokens for every row (so proposed = γ' each)."""
        gamma = max(caps)
        queued = getattr(self.backend, "queued_context", None)  # the drafter's backlog this pass projects first
        flushed = tuple(queued([r.slot for r in rows])) if queued is not None else ()
        anchors = torch.tensor([r.anchor for r in rows], dtype=torch.long)  # [R]
        positions = torch.tensor([r.n_committed for r in rows], dtype=torch.long)  # [R] position of d_1
        block = self.backend.draft([r.slot for r in rows], anchors, gamma, [r.sampling for r in rows], positions)
        if block.tokens.shape != (len(rows), gamma):
            log.warning("drafter returned tokens %s, expected %s; plain decoding this round",
                        tuple(block.tokens.shape), (len(rows), gamma))
            return DraftOutcome.failed(len(rows))
        if block.q is None and any(not r.sampling.greedy for r in rows):
            log.warning("drafter returned no draft distributions q for sampling requests; plain decoding this round")
            return DraftOutcome.failed(len(rows))
        return DraftOutcome(block, (gamma,) * len(rows), flushed)

    # ---- verify → accept → commit ----------------------------------------------------------------------
    def verify(self, rows: Sequence[RoundRow], draft: DraftBlock, k: Sequence[int]) -> VerifyOutcome:
        """One batched target pass over [anchor, d_1..d_K], acceptance, then commit of anchor + accepted drafts."""
        k_t = torch.tensor(list(k), dtype=torch.long)  # [B]
        anchors = torch.tensor([r.anchor for r in rows], dtype=torch.long).unsqueeze(1)  # [B, 1]
        tokens = torch.cat([anchors, draft.tokens], dim=1)  # [B, K+1]
        slots = [r.slot for r in rows]
        logits = self.backend.verify(slots, tokens, k_t)  # [B, K+1, V]
        res = self._accept(logits, draft.tokens, k_t, draft.q, rows)
        self.backend.commit(slots, res.accepted + 1)
        return VerifyOutcome(tuple(int(a) for a in res.accepted.tolist()),
                             tuple(tuple(res.committed(draft.tokens, i)) for i in range(len(rows))),
                             tuple(res.top1.tolist()), tuple(res.margin.tolist()))  # [B] × [K+1] floats

    def _accept(self, logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor, q: torch.Tensor | None,
                rows: Sequence[RoundRow]) -> AcceptResult:
        """Acceptance on the logits' device (kernels on CUDA via the backend); results come back on the CPU."""
        dev = logits.device
        sampling = [r.sampling for r in rows]
        positions = torch.tensor([r.n_committed for r in rows], dtype=torch.long, device=dev)  # [B] position of d_1
        draft, k = draft.to(dev), k.to(dev)  # [B, K], [B]
        if not all(s.greedy for s in sampling):
            if q is None:  # no drafted row samples (sampled rows verify K = 0): their bonus is sampled from p
                q = torch.zeros(logits.shape[0], logits.shape[1] - 1, logits.shape[2])  # [B, K, V]
            q = q.to(dev)
        res = self.backend.accept(logits, draft, k, q, sampling, positions)
        return AcceptResult(res.accepted.cpu(), res.next_token.cpu(), res.top1.cpu(), res.margin.cpu())
