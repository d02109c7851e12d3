"""What drafting is worth in one round, before the drafter runs: the survival gate's arithmetic.

Owns `drafting_gain` (one row drafted on top of a round), `joint_drafting_gain` (rows drafted together, sharing one
drafter pass) and `extended_survival` (an observed survival curve made non-increasing and extended to the cap) —
pure functions of a spec_decode.costs.CostTable; spec_decode.scheduler.plan_drafting opens and closes the gate with
them, spec_decode.proposers weighs the DSpark block against a suffix proposal with the last.
"""
from __future__ import annotations

from typing import Sequence

from dspark_trt.spec_decode.costs import NO_PREFILL, CostTable, RoundLoad

__all__ = ["drafting_gain", "joint_drafting_gain", "prefix_drafting_gains", "extended_survival"]


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
    gains = prefix_drafting_gains(ests, caps, rows, table, load, sampled, contexts, pass_paid)
    return gains[-1] if gains else 0.0


def prefix_drafting_gains(ests: Sequence[Sequence[float]], caps: Sequence[int], rows: int, table: CostTable,
                          load: RoundLoad = NO_PREFILL, sampled: Sequence[bool] = (),
                          contexts: Sequence[int | None] = (), pass_paid: bool = False) -> list[float]:
    """[n] joint_drafting_gain of the first 1, 2, …, n rows, in O(n·γ) (the gate ranks its rows and asks every
    prefix in each round: at 32 rows, one call instead of 31)."""
    n = len(ests)
    ctx = list(contexts) or [None] * n
    smp = list(sampled) or [False] * n
    # the verify pass of N tokens past the row tokens: step(rows + N), or with a fused prefill at offset p the
    # marginal tokens step(p + rows + N) − step(p + rows) on top of step(rows) (Σ CostTable.marginal_seconds)
    p = load.offset

    def verify(tokens: int) -> float:
        if p == 0:
            return table.step_seconds(rows + tokens)
        return table.step_seconds(rows) + table.step_seconds(p + rows + tokens) - table.step_seconds(p + rows)

    out: list[float] = []
    g: list[float] = []  # [K] Σ over the prefix's rows of their survival up to K
    cap, x, tok, dx, sampled_rows = 1 << 30, 0.0, 0.0, 0.0, 0
    for r in range(n):
        a = extended_survival(ests[r], caps[r])
        cap = min(cap, len(a))
        x, tok = x + table.row_seconds(ctx[r]), tok + table.token_seconds(ctx[r])
        dx += table.draft_row_seconds(ctx[r])
        sampled_rows += bool(smp[r])
        if len(g) < cap:
            g += [0.0] * (cap - len(g))
        run = 0.0
        for k in range(cap):
            run += a[k]
            g[k] += run
        if cap == 0:
            out.append(0.0)
            continue
        m = r + 1
        base = rows / (table.step_seconds(rows) + x)
        fixed = x + table.draft_seconds(m, sampled_rows) - (table.draft_t0 if pass_paid else 0.0) + dx
        out.append(max((rows + g[k - 1]) / (verify(m * k) + k * tok + fixed) / base for k in range(1, cap + 1)))
    return out


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
