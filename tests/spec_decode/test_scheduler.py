"""spec_decode.confidence / scheduler / policies / stats: one test per confidence-policy rule, survival Alg. 1,
cost table, policy names."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.confidence import ConfidenceWeights, confidence_score, early_stop_k, ema_update, survival
from dspark_trt.spec_decode.policies import POLICIES, canonical_policy
from dspark_trt.spec_decode.scheduler import (CostTable, PolicyConfig, PolicyState, confidence_next_k, observe,
                                              plan_survival, schedule_batch)
from dspark_trt.spec_decode.stats import RoundRecord, SpecStats

CONF = PolicyConfig(policy="confidence")  # defaults min_k 2, max_k 8, low 0.3, high 0.7


def test_rule_weights_are_04_03_03() -> None:
    assert confidence_score(1.0, 0.0, 0.0) == pytest.approx(0.4)
    assert confidence_score(0.0, 1.0, 0.0) == pytest.approx(0.3)
    assert confidence_score(0.0, 0.0, 1.0) == pytest.approx(0.3)
    assert confidence_score(0.5, 0.1, 0.5) == pytest.approx(0.4 * 0.5 + 0.3 * 0.5 + 0.3 * 0.5)


def test_rule_margin_times_5_capped_at_1() -> None:
    assert confidence_score(0.0, 0.1, 0.0) == pytest.approx(0.3 * 0.5)
    assert confidence_score(0.0, 0.2, 0.0) == pytest.approx(0.3)
    assert confidence_score(0.0, 0.9, 0.0) == pytest.approx(0.3)  # 4.5 capped at 1


def test_rule_ema_weight_02_on_new_round() -> None:
    assert ema_update(0.5, 1.0) == pytest.approx(0.6)
    st = PolicyState.initial(CONF)
    assert st.ema == 0.5
    observe(CONF, st, k=4, accepted=2, top1=torch.full((5,), 0.5), margin=torch.zeros(5))
    assert st.ema == pytest.approx(0.2 * 0.5 + 0.8 * 0.5)
    observe(CONF, st, k=4, accepted=4, top1=torch.full((5,), 0.5), margin=torch.zeros(5))
    assert st.ema == pytest.approx(0.2 * 1.0 + 0.8 * 0.5)
    observe(CONF, st, k=0, accepted=0, top1=torch.full((1,), 0.5), margin=torch.zeros(1))
    assert st.ema == pytest.approx(0.6)  # a K=0 round verifies nothing: EMA unchanged


def test_rule_linear_map_between_thresholds() -> None:
    # conf 0.5 is halfway between 0.3 and 0.7 → min_k + 0.5·(max_k − min_k) = 5
    assert confidence_next_k(CONF, 0.5, current_k=2, k=4, accepted=2) == 5
    assert confidence_next_k(CONF, 0.4, current_k=2, k=4, accepted=2) == 3  # int(2 + 6·0.25) = 3
    assert confidence_next_k(CONF, 0.6, current_k=8, k=4, accepted=2) == 6  # lowering is always allowed


def test_rule_clamp_to_min_and_max_k() -> None:
    assert confidence_next_k(CONF, 0.05, current_k=5, k=4, accepted=1) == 2
    assert confidence_next_k(CONF, 0.99, current_k=5, k=4, accepted=3) == 8


def test_rule_raise_only_after_a_round_that_accepted() -> None:
    # high confidence but the last round accepted nothing (a K=0 round, e.g. drafter fallback): K stays
    assert confidence_next_k(CONF, 0.99, current_k=3, k=0, accepted=0) == 3
    assert confidence_next_k(CONF, 0.99, current_k=3, k=4, accepted=1) == 8
    assert confidence_next_k(CONF, 0.4, current_k=5, k=0, accepted=0) == 3  # may still go down


def test_rule_first_token_rejection_drops_to_min_k() -> None:
    assert confidence_next_k(CONF, 0.99, current_k=7, k=4, accepted=0) == 2
    st = PolicyState(k=7)
    observe(CONF, st, k=7, accepted=0, top1=torch.ones(8), margin=torch.ones(8))
    assert st.k == 2


def test_observe_drives_confidence_k_from_verify_signals() -> None:
    st = PolicyState.initial(CONF)
    assert st.k == 2
    conf = observe(CONF, st, k=2, accepted=2, top1=torch.tensor([0.9, 0.9, 0.9]), margin=torch.tensor([0.5] * 3))
    assert conf == pytest.approx(0.4 * 0.9 + 0.3 + 0.3 * (0.2 + 0.4))
    assert st.k == 8 and st.conf == conf


def test_confidence_policy_rejects_min_k_0_and_bad_thresholds() -> None:
    with pytest.raises(InvalidArgumentError, match="min_k must be ≥ 1"):
        PolicyConfig(policy="confidence", min_k=0)
    with pytest.raises(InvalidArgumentError, match="low < high"):
        PolicyConfig(policy="confidence", low=0.8, high=0.7)
    with pytest.raises(InvalidArgumentError, match="policy must be one of"):
        PolicyConfig(policy="greedy")


def test_seed_is_an_alias_of_confidence() -> None:
    assert POLICIES == ("plain", "fixed", "confidence", "survival")
    assert PolicyConfig(policy="seed") == CONF
    assert PolicyState.initial(PolicyConfig(policy="seed")).k == CONF.min_k
    assert canonical_policy("seed") == canonical_policy("confidence") == "confidence"
    with pytest.raises(InvalidArgumentError, match="min_k must be ≥ 1 for the confidence policy"):
        PolicyConfig(policy="seed", min_k=0)
    with pytest.raises(InvalidArgumentError, match="plain, fixed, confidence, survival"):
        canonical_policy("seeds")


def test_survival_is_cumulative_product_and_early_stop_cuts() -> None:
    c = torch.tensor([[0.9, 0.8, 0.5, 0.9]])
    assert torch.allclose(survival(c), torch.tensor([[0.9, 0.72, 0.36, 0.324]]))
    assert early_stop_k(c, 0.5).tolist() == [2]
    assert early_stop_k(c, 0.0).tolist() == [4]
    assert early_stop_k(c, 0.95).tolist() == [0]


def test_survival_plan_free_verification_takes_everything_useful() -> None:
    flat = CostTable((1, 1000), (1.0, 1.0))  # verifying more tokens costs nothing
    ks = plan_survival([torch.tensor([0.9, 0.5, 0.1]), torch.tensor([0.3, 0.2])], 0, flat)
    assert ks == [3, 2]


def test_survival_plan_stops_at_first_drop_and_ranks_across_requests() -> None:
    table = CostTable.linear(1.0, 0.25)
    a = [torch.tensor([0.95, 0.9, 0.3]), torch.tensor([0.6, 0.2])]
    ks = plan_survival(a, 0, table)
    # brute force over prefixes for the objective; greedy admission reaches the same optimum here
    best = max(((k1, k2) for k1 in range(4) for k2 in range(3)),
               key=lambda kk: (2 + float(a[0][:kk[0]].sum()) + float(a[1][:kk[1]].sum())) * table.sps(2 + sum(kk)))
    assert tuple(ks) == best
    assert ks[0] >= 2 and ks[1] <= 1


def test_survival_floor_is_zero_when_drafts_are_hopeless() -> None:
    assert plan_survival([torch.tensor([0.01, 0.001])], 0, CostTable.linear(1.0, 0.25)) == [0]


def test_survival_sees_the_whole_batch() -> None:
    """The same request gets a smaller K when the batch already carries many tokens (cost grows superlinearly)."""
    table = CostTable((1, 8, 16, 64), (1.0, 1.05, 1.3, 6.0))
    a = [torch.tensor([0.8, 0.7, 0.6, 0.5])]
    assert plan_survival(a, 0, table) == [4]
    assert plan_survival(a, 40, table) < [4]


def test_cost_table_json_and_interpolation(tmp_path) -> None:
    p = tmp_path / "cost.json"
    p.write_text(json.dumps({"tokens": [1, 10], "seconds": [1.0, 2.0]}))
    t = CostTable.from_json(p)
    assert t.step_seconds(5) == pytest.approx(1.0 + 4 / 9)
    assert t.step_seconds(19) == pytest.approx(3.0)  # linear extrapolation
    assert t.sps(1) == 1.0
    p.write_text(json.dumps({"t0": 2.0, "t1": 0.5}))
    assert CostTable.from_json(p).step_seconds(4) == pytest.approx(4.0)
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        CostTable((2, 1), (1.0, 1.0))
    with pytest.raises(InvalidArgumentError, match="cannot read cost table"):
        CostTable.from_json(tmp_path / "missing.json")


def test_schedule_batch_caps_and_mixes_policies() -> None:
    cfgs = [PolicyConfig(policy="fixed", k=5), PolicyConfig(policy="plain"),
            PolicyConfig(policy="fixed", k=5, draft_stop=0.5), PolicyConfig(policy="survival", max_k=3)]
    states = [PolicyState.initial(c) for c in cfgs]
    conf = torch.tensor([[0.9] * 5, [0.9] * 5, [0.9, 0.9, 0.4, 0.9, 0.9], [0.99] * 5])
    ks = schedule_batch(cfgs, states, [3, 5, 5, 5], conf, CostTable((1, 100), (1.0, 1.0)))
    assert ks == [3, 0, 2, 3]  # cap, plain, early stop at Π c < 0.5, survival capped by max_k


def test_stats_tau_acceptance_per_position_first_token_rejection() -> None:
    s = SpecStats(prefill_calls=1, committed_tokens=1)
    for k, acc in [(4, 4), (4, 0), (2, 1), (0, 0)]:
        s.record_round(RoundRecord(k, acc, 0.5, acc + 1), drafted=k > 0, proposed=k)
    assert s.target_calls == 5 and s.committed_tokens == 1 + 5 + 1 + 2 + 1
    assert s.tau == pytest.approx(10 / 5)
    assert s.acceptance_per_position() == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])
    assert s.first_token_rejection_rate == pytest.approx(1 / 3)
    assert s.acceptance_rate == pytest.approx(5 / 10)
    summ = s.summary()
    assert summ["rounds"][0] == {"k": 4, "accepted": 4, "conf": 0.5, "proposer": "dspark"} and summ["draft_calls"] == 3
    assert math.isclose(s.merge([s]).tau, s.tau)
