"""What drafting is worth in one round, before the drafter runs: the survival gate's arithmetic.

Owns `drafting_gain` (one row drafted on top of a round), `joint_drafting_gain` (rows drafted together, sharing one
drafter pass) and `extended_survival` (an observed survival curve made non-increasing and extended to the cap) —
pure functions of a spec_decode.costs.CostTable; spec_decode.scheduler.plan_drafting opens and closes the gate with
them, spec_decode.proposers weighs the DSpark block against a suffix proposal with the last.
"""
from __future__ import annotations

from typing import Sequence

from dspark_trt.spec_decode.costs import NO_PREFILL, CostTable, RoundLoad

__all__ = ["drafting_gain", "joint_drafting_gain", "extended_survival"]


def drafting_gain(est: Sequence[float], cap: int, rows: int, table: CostTable,
                  load: RoundLoad = NO_PREFILL, sampled: bool = False, context: int | None = None,
                  pass_paid: bool = False) -> float:
    """Best relative throughput of drafting one more row of a `rows`-row round over leaving it plain:
    max_K (rows + Σ_{j≤K} a_j) / (step(rows) + Σ_{i<K} marginal(rows + i) + K·tok + x + draft(1) + dx) ÷
    (rows / (step(rows) + x)) (marginal: costs.CostTable.marginal_seconds under this round's `load`; without a fused
    prefill the verify term is step(rows + K)), a = observed survival made non-increasing, extended geometrically (the
    last observed ratio a_j / a_{j-1}, or a_1) to positions the policy has not verified yet — else a drafter whose
    rounds chose small K could never show that larger K pays; 0 when nothing can be verified. sampled: the row
    samples (its drafting costs table.sampled_t1 more); context: its cached tokens — x = its anchor's attention past
    the profiled context, tok = each verify token's, dx = its drafter row's (CostTable.row_seconds, token_seconds,
    draft_row_seconds): a long context makes its verify tokens and its drafter row dearer. pass_paid: the drafter
    pass runs this round for other rows anyway, so this row adds only its row to it (draft(1) − draft_t0)."""
    return joint_drafting_gain([est], [cap], rows, table, load, [sampled], [context], pass_paid)


def joint_drafting_gain(ests: Sequence[Sequence[float]], caps: Sequence[int], rows: int, table: CostTable,
                        load: RoundLoad = NO_PREFILL, sampled: Sequence[bool] = (),
                        contexts: Sequence[int | None] = (), pass_paid: bool = False) -> float:
    """drafting_gain for n rows drafted together in a `rows`-row round that drafts nothing else: one drafter pass
    over the n rows (draft_t0 paid once) and a common K ≤ min(caps) each — max_K (rows + Σ_r Σ_{j≤K} a_rj) /
    (step(rows + n·K) + Σ_r (x_r + K·tok_r + dx_r) + draft(n, sampled)) ÷ (rows / (step(rows) + Σ_r x_r)). Rows
    whose drafter pass alone would not pay may pay together: on a 2-core Zen 4, two requests each closed their gate
    (0.99× plain) where drafting both at K = 3 decoded 1.09× plain. pass_paid: the pass runs anyway (draft_t0 not
    charged). One row is drafting_gain."""
    n = len(ests)
    ctx = list(contexts) or [None] * n
    a = [extended_survival(e, c) for e, c in zip(ests, caps)]
    cap = min((len(x) for x in a), default=0)
    if n == 0 or cap == 0:
        return 0.0
    x = sum(table.row_seconds(c) for c in ctx)
    tok = sum(table.token_seconds(c) for c in ctx)
    base = rows / (table.step_seconds(rows) + x)
    fixed = x + table.draft_seconds(n, sum(bool(s) for s in sampled)) - (table.draft_t0 if pass_paid else 0.0) + \
        sum(table.draft_row_seconds(c) for c in ctx)
    best, gained, verify = 0.0, 0.0, table.step_seconds(rows)
    for k in range(1, cap + 1):
        gained += sum(x_r[k - 1] for x_r in a)
        verify = table.step_seconds(rows + n * k) if load.offset == 0 else verify + sum(
            table.marginal_seconds(rows + n * (k - 1) + i, load) for i in range(n))
        best = max(best, (rows + gained) / (verify + k * tok + fixed) / base)
    return best


def extended_survival(est: Sequence[float], cap: int) -> list[float]:
    """Observed survival est made non-increasing and extended geometrically to cap positions (the last observed
    ratio a_j / a_{j-1}, or a_1), cut where it falls under 1e-3; [] when nothing was observed."""
    a, run = [], 1.0
    for x in list(est)[:cap]:
        run = min(run, float(x))
        a.append(run)
    if not a:
        return a
    ratio = a[-1] / a[-2] if len(a) >= 2 and a[-2] > 0 else a[0]
    while len(a) < cap and a[-1] > 1e-3:
        a.append(a[-1] * ratio)
    return a
