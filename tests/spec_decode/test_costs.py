"""The round cost model (spec_decode.costs) in the survival rule: prefill tokens that share the verify pass price
each verify token at its marginal cost there (prefill-heavy rounds on a compute-bound stretch choose smaller K, a
flat stretch or a linear table change nothing), a prefill in its own pass never moves K, the gate weighs the same
cost, the loop hands the admitted prompt tokens to the rule, and output stays the target's greedy output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.costs import NO_PREFILL, CostTable, RoundLoad
from dspark_trt.spec_decode.executor import BackendExecutor
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
from dspark_trt.spec_decode.scheduler import (GateMemory, PolicyConfig, PolicyState, drafting_gain, plan_drafting,
                                              plan_survival)

# memory-bound up to 64 tokens in a pass (each token +0.5 % of a step), compute-bound past it (+3 % per token):
# a CPU/GPU-like knee. Relative units.
KNEE = CostTable((1, 64, 1024), (1.0, 1.0 + 0.005 * 63, 1.0 + 0.005 * 63 + 0.03 * 960), draft_t0=0.2)
A = [torch.tensor([0.9, 0.8, 0.65, 0.5, 0.35, 0.2, 0.1])] * 4  # four rows' survival a_1..a_7


def test_fused_prefill_heavy_rounds_choose_smaller_k() -> None:
    free = plan_survival(A, 0, KNEE)
    short = plan_survival(A, 0, KNEE, load=RoundLoad(8, fused=True))  # a chat prompt: 8 + ≤ 32 tokens, still flat
    mid = plan_survival(A, 0, KNEE, load=RoundLoad(40, fused=True))  # the knee falls inside the verify tokens
    heavy = plan_survival(A, 0, KNEE, load=RoundLoad(512, fused=True))  # a long prompt: compute-bound throughout
    assert free == short == [7, 7, 7, 7]  # flat: every drafted token with a_j ≥ ~0.02·Θ pays
    assert mid == heavy == [5, 5, 5, 5]  # +3 % of a step per token: a_6 = 0.2, a_7 = 0.1 no longer repay it
    steeper = CostTable(KNEE.tokens, (1.0, 1.315, 1.315 + 0.3 * 960))  # +30 % per token past the knee
    assert sum(plan_survival(A, 0, steeper, load=RoundLoad(512, fused=True))) < sum(heavy)


def test_prefill_in_its_own_pass_never_moves_k() -> None:
    for table in (KNEE, CostTable.linear(1.0, 0.08)):
        for p in (0, 8, 512, 4000):
            assert plan_survival(A, 3, table, load=RoundLoad(p, fused=False)) == plan_survival(A, 3, table)
    assert RoundLoad(512).offset == 0 and RoundLoad(512, fused=True).offset == 512


def test_linear_cost_fused_prefill_changes_nothing() -> None:
    lin = CostTable.linear(1.0, 0.08)  # every token costs the same wherever it rides: the same K
    assert all(plan_survival(A, 0, lin, load=RoundLoad(p, fused=True)) == plan_survival(A, 0, lin)
               for p in (8, 100, 900))


def test_gate_weighs_the_fused_prefill() -> None:
    est = [0.9, 0.8, 0.6]
    base = drafting_gain(est, 3, 4, KNEE)
    assert drafting_gain(est, 3, 4, KNEE, RoundLoad(512)) == base  # own pass: unchanged
    fused = drafting_gain(est, 3, 4, KNEE, RoundLoad(512, fused=True))
    assert 1.0 < fused < base  # +3 % per token: drafting still pays, by less
    steeper = CostTable(KNEE.tokens, (1.0, 1.315, 1.315 + 0.3 * 960), draft_t0=0.2)
    assert drafting_gain(est, 3, 4, steeper, RoundLoad(512, fused=True)) < 1.0 < drafting_gain(est, 3, 4, steeper)


def test_round_seconds_counts_prefill_draft_and_verify() -> None:
    n, p = 12, 300
    assert KNEE.round_seconds(n) == KNEE.step_seconds(n)
    assert KNEE.round_seconds(n, RoundLoad(p), drafted_rows=3) == (KNEE.step_seconds(n) + KNEE.step_seconds(p)
                                                                    + KNEE.draft_seconds(3))
    assert KNEE.round_seconds(n, RoundLoad(p, fused=True), 3) == KNEE.step_seconds(p + n) + KNEE.draft_seconds(3)
    assert KNEE.marginal_seconds(10) < KNEE.marginal_seconds(10, RoundLoad(p, fused=True))
    assert KNEE.marginal_seconds(10, NO_PREFILL) == KNEE.step_seconds(11) - KNEE.step_seconds(10)


class _FusedPricing(BackendExecutor):
    """The reference executor, its prefill priced as sharing the verify pass (fused_prefill: only K changes)."""

    fused_prefill = True


# flat to 64 tokens in a pass, then one full step per token: a fused 100-token prompt makes every verify token cost
# a whole step (no draft pays), while without it verify tokens are nearly free
STEEP = CostTable((1, 64, 2048), (1.0, 1.063, 1.063 + 1984.0))


def _rounds(executor: BackendExecutor, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """One survival request (gate off) → (its K per round, its tokens)."""
    sched = RoundScheduler(executor, LoopConfig(gamma=4, cost_table=STEEP, calibrate=False))
    rid = sched.add(Request(tuple(prompt), n, policy=PolicyConfig(policy="survival", max_k=4, gate=False)))
    tokens: list[int] = []
    while True:
        for ev in sched.step():
            if ev.request_id == rid:
                tokens += ev.new_tokens
                if ev.finished:
                    return [r.k for r in ev.stats.rounds], tokens


def test_loop_prices_the_admission_round_with_its_prompt(ref_backend, greedy_oracle, tiny_models) -> None:  # noqa: ANN001
    prompt = [(13 * i + 5) % 250 + 3 for i in range(100)]
    k_fused, out_fused = _rounds(_FusedPricing(ref_backend()), prompt, 12)
    k_own, out_own = _rounds(BackendExecutor(ref_backend()), prompt, 12)
    assert k_fused[0] == 0 and any(k > 0 for k in k_fused[1:])  # the round that admitted 100 prompt tokens: K = 0
    assert k_own[0] > 0  # the same round with the prefill in its own pass drafts as any other
    want = greedy_oracle(tiny_models["target"], prompt, 12)
    assert out_fused == want and out_own == want


# the KNEE's step column profiled at 64 cached tokens; a row pays 1e-4 of a step per cached token past them and
# each of its query tokens 2e-5 more (a 1,000-token row: +9 % of a step for its anchor, +1.9 % per verify token)
CTX = CostTable(KNEE.tokens, KNEE.seconds, draft_t0=0.2, context=64, ctx_t0=1e-4, ctx_t1=2e-5, draft_ctx=5e-5)


def test_context_terms_price_a_long_rows_tokens() -> None:
    assert CTX.row_seconds(64) == CTX.row_seconds(10) == CTX.row_seconds(None) == 0.0  # within the profiled context
    assert CTX.row_seconds(1064, 3) == pytest.approx(1000 * (1e-4 + 3 * 2e-5))
    assert CTX.token_seconds(1064) == pytest.approx(0.02) and CTX.draft_row_seconds(1064) == pytest.approx(0.05)
    blind = CostTable(KNEE.tokens, KNEE.seconds, draft_t0=0.2)  # an old table: context-blind
    assert blind.row_seconds(5000, 8) == blind.token_seconds(5000) == blind.draft_row_seconds(5000) == 0.0
    with pytest.raises(InvalidArgumentError, match="context"):
        CostTable((1,), (1.0,), ctx_t1=-1.0)


def test_cost_table_json_keeps_the_context_terms(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(CTX.to_json()))
    assert CostTable.from_json(path) == CTX == CostTable.from_dict(CTX.to_json())  # (a trace's table: no file)
    old = CTX.to_json()
    del old["context"]  # a table written before the context terms: read as context-blind
    path.write_text(json.dumps(old))
    assert CostTable.from_json(path) == CostTable(KNEE.tokens, KNEE.seconds, draft_t0=0.2)


def test_long_context_rows_verify_fewer_tokens() -> None:
    """A long-context row's verify tokens cost its attention over every cached token: with the same survival, it
    verifies fewer of them than a short-context row in the same round; contexts within the profiled one change
    nothing."""
    assert plan_survival(A, 0, CTX, contexts=[64] * 4) == plan_survival(A, 0, CTX) == plan_survival(A, 0, KNEE)
    ks = plan_survival(A, 0, CTX, contexts=[64, 3000, 64, 3000])
    assert ks[0] == ks[2] == 7 and 0 < min(ks[1], ks[3]) <= max(ks[1], ks[3]) < 7  # (ties: the first row first)
    # the other rows' contexts make the pass dearer, which makes a short row's token relatively cheaper: never fewer
    assert plan_survival(A[:1], 4, CTX, contexts=[64], fixed_seconds=CTX.row_seconds(3000, 2)) == [7]


def test_gate_weighs_a_rows_context() -> None:
    est = [0.3, 0.1, 0.03]
    assert drafting_gain(est, 3, 1, CTX, context=64) == pytest.approx(drafting_gain(est, 3, 1, KNEE))
    assert drafting_gain(est, 3, 1, CTX, context=20000) < 1.0 < drafting_gain(est, 3, 1, CTX, context=64)
    cfg = PolicyConfig(policy="survival", max_k=3)

    def drafted(context: int) -> int:
        st = PolicyState.initial(cfg)
        st.survival_est, st.probe = list(est), False
        return plan_drafting([cfg], [st], [3], CTX, contexts=[context])[0]

    assert drafted(64) == 3 and drafted(20000) == 0


def test_an_inherited_skip_is_weighed_at_the_new_requests_context() -> None:
    """A closed spell inherited from an earlier request (GateMemory) — e.g. a long code context the drafter could not
    pay for — goes on only where the shared estimate does not pay at the new request's own context."""
    cfg = PolicyConfig(policy="survival", max_k=3)

    def memory() -> GateMemory:
        return GateMemory(survival_est=[0.3, 0.1, 0.03], observed=50, backoff=8, skip_left=7)

    short = PolicyState.initial(cfg, memory())
    assert short.skip_left == 7 and short.inherited_skip
    assert plan_drafting([cfg], [short], [3], CTX, contexts=[64]) == [3]  # pays at its context: drafts at once
    assert short.backoff == 1 and short.skip_left == 0
    long = PolicyState.initial(cfg, memory())
    assert plan_drafting([cfg], [long], [3], CTX, contexts=[20000]) == [0]  # does not pay there: the skip goes on
    assert long.skip_left == 6 and long.backoff == 8 and not long.inherited_skip
    useless = GateMemory(survival_est=[0.0, 0.0, 0.0], observed=50, backoff=64, skip_left=40)
    assert plan_drafting([cfg], [PolicyState.initial(cfg, useless)], [3], CTX, contexts=[64]) == [0]
