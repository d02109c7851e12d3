"""DSpark rounds over the tapped target engine (builder/trtllm_taps.py) of the GPU-host repository.

Owns TapExecutor: the spec_decode.protocols.RoundExecutor of a DSpark pair on the GPU host, a TrtllmExecutor whose
draft step is the DSpark drafter (the reference runtime's DSparkDrafter, on CUDA there) and whose target steps are
context requests to the tapped `target` model:
- Prefill: input_ids = the prompt, request_output_len 1, return_context_logits and the tap outputs. The first token
  is drawn from the last prompt position's logits exactly as the reference runtime draws it (argmax, or the race keyed
  on (seed, position)); the prompt's tap rows become the drafter's context.
- Draft: drafter.propose over the rows whose drafter context is complete ([R, γ'] tokens, q, confidence).
- Verify: input_ids = sequence + d_1..d_K as context (no draft_input_ids: the tapped target has no speculative mode,
  so every request of a step feeds only context tokens, which copyAdditionalOutputs' row count needs), request_output_len
  1. The context logits of positions T−1..T+K−1 go through spec_decode.accept.sample_accept — the reference
  runtime's acceptance, its keyed RNG included — and the tap rows of the anchor + accepted drafts extend the
  drafter's context. So greedy AND seeded sampled output equal the reference runtime's, token for token.
- KV-cache reuse: the `target` model returns context outputs only for the input rows the engine computed (the
  non-reused suffix; serve/gpu_host/executor_model.py trims the executor's [L, ·] tensors to it); row j of n
  belongs to input position L − n + j. A reply that misses positions we need (another request with the
  same tokens filled those blocks) is re-asked as a plain step (the sequence alone: its last position is always
  computed); a row whose drafter context has a hole drafts nothing from then on (plain rounds, still exact).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import numpy as np
import torch

from dspark_trt.errors import ServeError
from dspark_trt.serve.gpu_host.rounds import EngineCall, EngineClient, EngineReply, Observer, TrtllmExecutor
from dspark_trt.spec_decode import accept as spec_accept
from dspark_trt.spec_decode.protocols import DraftBlock, DraftOutcome, RoundRow, VerifyOutcome

log = logging.getLogger(__name__)

__all__ = ["TapExecutor"]


class TapExecutor(TrtllmExecutor):
    """RoundExecutor of a DSpark pair over the tapped target model + an in-process DSparkDrafter."""

    keyed_sampling = True  # acceptance and first tokens are ours (spec_decode.accept), keyed like the reference

    def __init__(self, client: EngineClient, drafter: Any, tap_names: Sequence[str], max_batch: int, max_seq: int,
                 vocab_size: int, target_model: str = "target", observe: Observer | None = None) -> None:
        super().__init__(client, max_batch, max_seq, vocab_size, target_model, None, observe)
        self.drafter = drafter
        self.taps = tuple(tap_names)
        self.can_draft = True
        self.gamma = int(drafter.gamma)
        self._holes: set[int] = set()  # slots whose drafter context misses positions: no drafting
        drafter.allocate(max_batch, max_seq + self.gamma + 2)

    # ---- engine requests -------------------------------------------------------------------------------
    def _tap_call(self, row: RoundRow, inputs: Sequence[int]) -> EngineCall:
        return EngineCall(tuple(int(t) for t in inputs), 1, request_id=f"dspark-{row.rid}", context_logits=True,
                          taps=self.taps)

    def _rows(self, rep: EngineReply, length: int, first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Context logits [length − first, V] and tap features [length − first, F] | None (None: not returned for
        all of positions first..length−1)."""
        if rep.error or rep.context_logits is None:
            raise ServeError(f"the tapped target returned no context logits: {rep.error or 'none'}; build it with "
                             "--gather_context_logits (engines/build_engines.sh does) and send return_context_logits")
        n = rep.context_logits.shape[0]  # rows of input positions length − n .. length − 1
        if n < length - first:
            return torch.empty(0), None
        lo = n - (length - first)
        logits = torch.from_numpy(np.ascontiguousarray(rep.context_logits[lo:]))  # [length − first, V]
        feats = None
        if rep.taps is not None and all(rep.taps[t].shape[0] == n for t in self.taps):
            feats = torch.from_numpy(np.concatenate([rep.taps[t][lo:] for t in self.taps], axis=-1))  # [.., F]
        return logits, feats

    def _feed(self, slot: int, tokens: Sequence[int], feats: torch.Tensor | None, start: int) -> None:
        """Extend the drafter's context of `slot` with tokens at positions start.. and their features [n, F]."""
        if slot in self._holes:
            return
        if feats is None or self.drafter.context_length(slot) != start:
            log.warning("slot %d: the tapped target returned no features for positions from %d (KV-cache reuse by "
                        "another request); this request drafts nothing from now on", slot, start)
            self._holes.add(slot)
            return
        dev = self.drafter.device
        self.drafter.extend_context(torch.tensor([slot]), torch.tensor([list(tokens)], dtype=torch.long),
                                    torch.tensor([len(tokens)]), feats[None].to(dev))  # [1, n, F]

    def release(self, slot: int) -> None:
        self._holes.discard(slot)
        self.drafter.release(slot)

    # ---- prefill ---------------------------------------------------------------------------------------
    def prefill(self, rows: Sequence[RoundRow]) -> list[int]:
        """The prompts as context requests → first tokens from their last logits; prompt features to the drafter."""
        from dspark_trt.spec_decode.executor import BackendExecutor  # noqa: PLC0415 - the one first-token rule

        replies = self._fan_out("prefill", self.target_model, [self._tap_call(r, r.sequence) for r in rows])
        last = []
        for row, rep in zip(rows, replies):
            if rep.error or rep.context_logits is None or not rep.context_logits.shape[0]:
                raise ServeError(f"the tapped target failed the prefill of a request: {rep.error or 'no logits'}")
            P = len(row.sequence)
            self.release(row.slot)
            _, feats = self._rows(rep, P, 0)
            self._feed(row.slot, row.sequence, feats, 0)
            last.append(torch.from_numpy(np.ascontiguousarray(rep.context_logits[-1])))  # [V] position P − 1
        return BackendExecutor._first_tokens(torch.stack(last), rows)  # noqa: SLF001

    # ---- draft -----------------------------------------------------------------------------------------
    def draft(self, rows: Sequence[RoundRow], caps: Sequence[int]) -> DraftOutcome:
        """One drafter pass of γ' = max(caps) ≤ block_size over the rows with a complete context."""
        gamma = min(max(caps), self.gamma)
        ok = [i for i, r in enumerate(rows) if r.slot not in self._holes and caps[i] > 0]
        if gamma < 1 or not ok:
            return DraftOutcome.failed(len(rows))
        t0 = time.perf_counter()
        sub = [rows[i] for i in ok]
        block = self.drafter.propose(torch.tensor([r.slot for r in sub]), torch.tensor([r.anchor for r in sub]),
                                     gamma, [r.sampling for r in sub],
                                     torch.tensor([r.n_committed for r in sub], dtype=torch.long))
        if self._observe is not None:
            self._observe("draft", time.perf_counter() - t0, None)
        R = len(rows)
        tokens = torch.zeros(R, gamma, dtype=torch.long)  # [R, γ']
        tokens[ok] = block.tokens
        q = conf = None
        if block.q is not None:
            q = torch.zeros(R, gamma, block.q.shape[-1])  # [R, γ', V]
            q[ok] = block.q
        if block.conf is not None:
            conf = torch.zeros(R, gamma)  # [R, γ']
            conf[ok] = block.conf
        proposed = [0] * R
        for i in ok:
            proposed[i] = gamma
        return DraftOutcome(DraftBlock(tokens, q, conf), tuple(proposed))

    # ---- verify → accept → commit ----------------------------------------------------------------------
    def verify(self, rows: Sequence[RoundRow], draft: DraftBlock, k: Sequence[int]) -> VerifyOutcome:
        """sequence + d_1..d_K as one context request per row; acceptance on its context logits (ours)."""
        B, kmax = len(rows), max(k)
        drafts = [tuple(int(t) for t in draft.tokens[i, :k[i]].tolist()) for i in range(B)]
        replies = self._fan_out("verify", self.target_model,
                                [self._tap_call(r, r.sequence + d) for r, d in zip(rows, drafts)])
        got: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        short = []
        for i, (row, rep) in enumerate(zip(rows, replies)):
            T = len(row.sequence)
            got.append(self._rows(rep, T + k[i], T - 1))
            if got[-1][0].shape[0] != k[i] + 1:
                short.append(i)
        if short:  # reused rows we needed: the sequence alone (its last position is always computed), K = 0
            again = self._fan_out("verify", self.target_model, [self._tap_call(rows[i], rows[i].sequence) for i in short])
            for i, rep in zip(short, again):
                T = len(rows[i].sequence)
                logits, feats = self._rows(rep, T, T - 1)
                if logits.shape[0] != 1:
                    raise ServeError("the tapped target returned no logits for the last input position")
                got[i], drafts[i] = (logits, feats), ()
        ks = torch.tensor([len(d) for d in drafts], dtype=torch.long)  # [B] (0 where re-asked)
        V = got[0][0].shape[-1]
        logits = torch.full((B, kmax + 1, V), 0.0)  # [B, K+1, V]
        dtok = torch.zeros(B, kmax, dtype=torch.long)  # [B, K]
        for i, (lg, _) in enumerate(got):
            logits[i, :lg.shape[0]] = lg.float()
            dtok[i, :len(drafts[i])] = torch.tensor(drafts[i], dtype=torch.long)
        res = self._accept(rows, logits, dtok, ks, draft.q)
        accepted, committed = [], []
        for i, row in enumerate(rows):
            a = int(res.accepted[i])
            toks = list(drafts[i][:a]) + [int(res.next_token[i])]
            accepted.append(a)
            committed.append(tuple(toks))
            T = len(row.sequence)
            feats = got[i][1]
            self._feed(row.slot, (row.anchor,) + drafts[i][:a], None if feats is None else feats[:a + 1], T - 1)
        return VerifyOutcome(tuple(accepted), tuple(committed), tuple(res.top1.tolist()), tuple(res.margin.tolist()))

    @staticmethod
    def _accept(rows: Sequence[RoundRow], logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor,
                q: torch.Tensor | None) -> Any:
        """spec_decode.accept over [B, K+1, V] logits: greedy rows by argmax, sampled rows by keyed rejection."""
        sp = [r.sampling for r in rows]
        if all(s.greedy for s in sp):
            return spec_accept.greedy_accept(logits, draft, k)
        K = draft.shape[1]
        qq = torch.zeros(len(rows), K, logits.shape[-1]) if q is None else q[:, :K].float()  # [B, K, V]
        return spec_accept.sample_accept(logits, draft, qq, k, torch.tensor([float(s.temperature) for s in sp]),
                                         torch.tensor([float(s.top_p) for s in sp]),
                                         torch.tensor([int(s.seed or 0) for s in sp], dtype=torch.int64),
                                         torch.tensor([r.n_committed for r in rows], dtype=torch.long))
