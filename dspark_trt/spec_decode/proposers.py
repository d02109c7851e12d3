"""Who proposes each row's drafts in one round: the DSpark block, the suffix match, or nothing.

Owns the per-row proposer choice of spec_decode.loop.RoundScheduler's round and the assembly of the round's draft
tensors from both proposers. Two decisions, both by expected committed tokens against the profiled cost
(scheduler.CostTable), the rule the survival policy already uses for K:

1. Before the drafter runs (`skip_drafter`): a row whose suffix proposal (confidences c_j from
   suffix.SuffixConfidence) promises at least the throughput the DSpark block is expected to reach (its observed
   survival, scheduler.extended_survival, paying one drafter row draft(1)) is not drafted: the drafter pass skips it
   (and is not run at all when no row needs it). Rows with no DSpark estimate yet are drafted (the block's own c_k
   decide after the pass).
2. After the pass (`assemble`): a row holding both proposals takes the one with the better best-K throughput from
   their confidences (the drafter is paid for by then); `schedule_batch` then picks K over the whole batch from the
   chosen rows' confidences, as for DSpark alone.

Rate of a survival curve a (per row, in a round of `rows` rows): max over K of (rows + Σ_{j≤K} a_j) /
(step(rows + K) + extra), extra = the drafter's one-row cost where it is still to be paid.

A suffix proposal is deterministic: sampled rows get a one-hot q at each proposed token, which exact rejection
sampling (accept.sample_accept) turns into accept-with-probability p(d) and a resample from p without d: the
target's distribution, unchanged. Pure torch + Python; knows nothing of models.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dspark_trt.spec_decode.confidence import survival
from dspark_trt.spec_decode.protocols import DraftBlock, SamplingParams
from dspark_trt.spec_decode.scheduler import CostTable, PolicyConfig, PolicyState, extended_survival
from dspark_trt.spec_decode.suffix import SuffixProposal

__all__ = ["NONE", "DSPARK", "SUFFIX", "RoundDrafts", "rate", "worth_proposing", "first_token_floor", "skip_drafter",
           "assemble"]

NONE, DSPARK, SUFFIX = "none", "dspark", "suffix"


def rate(a: Sequence[float], rows: int, table: CostTable, extra_seconds: float = 0.0, min_k: int = 0,
         token_seconds: float = 0.0) -> float:
    """max_{min_k ≤ K ≤ len(a)} (rows + Σ_{j≤K} a_j) / (step(rows + K) + K·token_seconds + extra_seconds): the
    round's throughput (relative units) when this row verifies K of a proposal with survival a (token_seconds: what
    each of its verify tokens adds past the step column, CostTable.token_seconds of its context); 0 when no K ≥ min_k
    exists."""
    best, gained = 0.0, 0.0
    if min_k == 0:
        best = rows / (table.step_seconds(rows) + extra_seconds)
    for k, aj in enumerate(a, start=1):
        gained += float(aj)
        if k >= min_k:
            best = max(best, (rows + gained) / (table.step_seconds(rows + k) + k * token_seconds + extra_seconds))
    return best


def worth_proposing(rows: int, cap: int, table: CostTable) -> bool:
    """Whether any row of a `rows`-row round could gain from a free proposal of up to cap tokens: a proposal accepted
    whole beats leaving the row plain (False from the batch size on where verify tokens are compute-bound, so
    the suffix proposer's lookups are skipped: the round would verify none of its tokens)."""
    return cap > 0 and rate([1.0] * cap, rows, table, min_k=1) > rows / table.step_seconds(rows)


def first_token_floor(rows: int, table: CostTable) -> float:
    """The least acceptance a row's first proposed token needs for the survival rule to verify it in a `rows`-row
    round: a_1 > rows · (step(rows + 1) / step(rows) − 1) (plan_survival admits a token while the batch's expected
    tokens per second do not drop, and the batch expects ≥ rows tokens). The suffix proposer skips its corpus lookup
    where no learned class reaches it (~0.1 ms a row, spent for nothing in a large batch)."""
    return rows * (table.step_seconds(rows + 1) / table.step_seconds(rows) - 1.0)


def _suffix_survival(p: SuffixProposal, cap: int) -> list[float]:
    a, run = [], 1.0
    for c in p.conf[:cap]:
        run *= c
        a.append(run)
    return a


def skip_drafter(draft_caps: Sequence[int], proposals: Sequence[SuffixProposal | None],
                 states: Sequence[PolicyState], table: CostTable, sampled: Sequence[bool] | None = None,
                 contexts: Sequence[int] | None = None) -> list[int]:
    """Draft caps with 0 for the rows whose suffix proposal is expected to pay at least as well as drafting them
    (decision 1 of the module doc; a sampled row's drafting priced with table.sampled_t1; contexts [B]: the rows'
    cached tokens, pricing their verify tokens and drafter rows, CostTable.token_seconds / draft_row_seconds)."""
    rows = len(draft_caps)
    out = list(draft_caps)
    for r, (cap, p, st) in enumerate(zip(draft_caps, proposals, states)):
        if cap <= 0 or p is None or not st.survival_est:
            continue
        a_d = extended_survival(st.survival_est, cap)
        ctx = contexts[r] if contexts is not None else None
        cost = table.draft_seconds(1, int(bool(sampled[r])) if sampled else 0) + table.draft_row_seconds(ctx)
        per_token = table.token_seconds(ctx)
        if rate(_suffix_survival(p, cap), rows, table, token_seconds=per_token) >= rate(
                a_d, rows, table, cost, 1, per_token):
            out[r] = 0
    return out


@dataclass
class RoundDrafts:
    """The round's proposals, one per row (B rows): what schedule_batch and verify need."""

    source: list[str]  # [B] NONE | DSPARK | SUFFIX
    avail: list[int]  # [B] tokens the chosen proposer offers (K ≤ this)
    tokens: torch.Tensor  # [B, W] long, row r valid up to avail[r]
    conf: torch.Tensor | None  # [B, W] c_j of the chosen proposer (None: DSpark alone without a head)
    q: torch.Tensor | None  # [B, W, V] draft distributions (one-hot for suffix rows) or None (no sampled row)

    def block(self, kmax: int) -> DraftBlock:
        """The verify step's DraftBlock cut to the round's longest K."""
        return DraftBlock(self.tokens[:, :kmax], None if self.q is None else self.q[:, :kmax], None)


def assemble(cfgs: Sequence[PolicyConfig], states: Sequence[PolicyState], sampling: Sequence[SamplingParams],
             caps: Sequence[int], draft_caps: Sequence[int], drafted_rows: Sequence[int], proposed: Sequence[int],
             block: DraftBlock | None, proposals: Sequence[SuffixProposal | None], vocab_size: int,
             table: CostTable) -> RoundDrafts:
    """Choose each row's proposer (decision 2) and lay the chosen drafts out as [B, W] tensors.

    caps [B]: the most each row may verify; draft_caps [B]: the most it may verify of the DSpark block (the drafting
    gate's cap, e.g. a probe's probe_k); drafted_rows: the rows the drafter ran for, in block order; proposed [B]:
    tokens it drafted per row (0: not drafted or failed); proposals [B]: suffix proposals (None: none)."""
    b = len(caps)
    brow = {r: i for i, r in enumerate(drafted_rows)}
    source, avail = [NONE] * b, [0] * b
    for r in range(b):
        p, nd = proposals[r], min(proposed[r], draft_caps[r], caps[r])
        ns = min(len(p.tokens), caps[r]) if p is not None else 0
        if nd > 0 and ns > 0:
            a_d = (survival(block.conf[brow[r], :nd]).tolist() if block is not None and block.conf is not None
                   else [states[r].ema ** (j + 1) for j in range(nd)])
            use_suffix = rate(_suffix_survival(p, ns), b, table) > rate(a_d, b, table)  # type: ignore[arg-type]
            source[r], avail[r] = (SUFFIX, ns) if use_suffix else (DSPARK, nd)
        elif nd > 0:
            source[r], avail[r] = DSPARK, nd
        elif ns > 0:
            source[r], avail[r] = SUFFIX, ns
    width = max(avail + [0])
    tokens = torch.zeros(b, width, dtype=torch.long)  # [B, W]
    any_suffix = SUFFIX in source
    conf = None
    if any_suffix or (block is not None and block.conf is not None):
        conf = torch.zeros(b, max(width, 1))  # [B, W]; positions past avail are never verified
    sampled = any(not s.greedy for s in sampling)
    q = torch.zeros(b, width, vocab_size) if sampled and width > 0 else None  # [B, W, V]
    for r in range(b):
        n = avail[r]
        if source[r] == DSPARK:
            assert block is not None
            i = brow[r]
            tokens[r, :n] = block.tokens[i, :n].long()
            if conf is not None:
                conf[r, :n] = (block.conf[i, :n].float() if block.conf is not None
                               else torch.full((n,), float(states[r].ema)))  # a_j = ema^j: the no-head fallback
            if q is not None and block.q is not None:
                q[r, :n] = block.q[i, :n].float()
        elif source[r] == SUFFIX:
            p = proposals[r]
            assert p is not None
            tokens[r, :n] = torch.tensor(p.tokens[:n], dtype=torch.long)
            assert conf is not None
            conf[r, :n] = torch.tensor(p.conf[:n], dtype=torch.float32)
            if q is not None:
                q[r, torch.arange(n), tokens[r, :n]] = 1.0  # one-hot: a deterministic proposal
    return RoundDrafts(source, avail, tokens, conf, q)
