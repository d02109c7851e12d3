"""The cost table calibrated from the loop's own timed rounds (spec_decode.calibrate.OnlineCosts): the fit recovers
what rounds cost, an unexercised drafter keeps its profiled shape, a stalled round moves it little, and in the loop a
drafter dearer than its table price stops being drafted — the output staying the target's greedy output."""
from __future__ import annotations

import random

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.calibrate import CalibrationConfig, OnlineAcceptance, OnlineCosts, box_solve
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
from dspark_trt.spec_decode.protocols import DraftBlock
from dspark_trt.spec_decode.scheduler import CostTable, PolicyConfig

# a profile in relative units: step(1..16), a drafter pass 0.2 of a step — what the rule believes
TABLE = CostTable((1, 2, 4, 8, 16), (1.0, 1.05, 1.1, 1.3, 1.8), draft_t0=0.2, draft_t1=0.05)


def _parts(costs: OnlineCosts, ks: list[int], drafted: list[int], flushed: int = 0) -> tuple[float, float]:
    """A machine where verifying costs 2 ms per table unit of the pass and 0.7 ms per verify token, the drafter
    4× its table price and 30 µs per backlog token it projects first → (verify, draft) seconds."""
    s, n, d, f = costs.features(ks, None, drafted, flushed=flushed)
    return 0.002 * s + 0.0007 * n, (0.008 * d + 0.00003 * f if drafted else 0.0)


OVERHEAD = 0.001  # and 1 ms a round outside the passes


def _true_seconds(costs: OnlineCosts, ks: list[int], drafted: list[int], flushed: int = 0) -> float:
    return sum(_parts(costs, ks, drafted, flushed)) + OVERHEAD


def _feed(costs: OnlineCosts, rounds: int, seed: int = 0, noise: float = 0.0, draft_p: float = 0.4) -> None:
    rng = random.Random(seed)
    for _ in range(rounds):
        ks = [rng.choice([0, 0, 1, 3, 5, 7]) for _ in range(rng.choice([1, 2, 3]))]
        drafted = [r for r in range(len(ks)) if rng.random() < draft_p]
        flushed = rng.choice([len(drafted)] * 6 + [300, 1024]) if drafted else 0  # now and then a probe's backlog
        v, d = (x * (1.0 + noise * rng.gauss(0.0, 1.0)) for x in _parts(costs, ks, drafted, flushed))
        costs.observe(v, ks, None, drafted, flushed=flushed, draft_seconds=d, round_seconds=v + d + OVERHEAD)


def _price(table: CostTable, ks: list[int], drafted: int) -> float:
    return table.step_seconds(sum(1 + k for k in ks)) + table.draft_seconds(drafted)


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_the_fit_recovers_what_rounds_cost(noise: float) -> None:
    costs = OnlineCosts(TABLE)
    _feed(costs, 400, noise=noise)
    assert costs.fitted
    tol = 0.02 if noise == 0.0 else 0.08  # (the prior toward the profiled shape weighs a quarter round)
    for ks, drafted in (([0], []), ([0, 0], []), ([4], [0]), ([7, 7], [0, 1]), ([3, 0, 5], [0, 2])):
        truth = _true_seconds(costs, ks, list(range(drafted and len(drafted))) if drafted else [])
        assert _price(costs.table, ks, len(drafted)) == pytest.approx(truth, rel=tol), (ks, drafted)
    # the profiled table priced the drafter at a fifth of a step; the rounds say four times that, relative — with
    # the backlog's rounds priced apart (30 ms per 1,000 tokens), not folded into the pass
    s = costs.summary()
    assert s["drafter"] / s["target"] == pytest.approx(4.0, rel=0.15)
    assert s["flush_ms_per_1k"] == pytest.approx(30.0, rel=0.15)


def test_the_drafters_backlog_is_counted_and_reported_by_the_executor(tiny_pair) -> None:  # noqa: ANN001
    """A lazy drafter (the DSpark one) projects the tokens committed since its last block first: the executor says
    how many (DraftOutcome.flushed) — the whole prompt at a request's first block, then what the last round kept."""
    from dspark_trt.runtime.backend import SpecBackend  # noqa: PLC0415
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint  # noqa: PLC0415
    from dspark_trt.spec_decode.executor import BackendExecutor  # noqa: PLC0415
    from dspark_trt.testing.tiny import tiny_dspark_drafter  # noqa: PLC0415

    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    ex = BackendExecutor(SpecBackend(target, tiny_dspark_drafter(target), max_batch=2, max_seq=64))
    sched = RoundScheduler(ex, LoopConfig(gamma=4))
    seen: list[tuple[int, ...]] = []
    draft = ex.draft

    def spy(rows, caps):  # noqa: ANN001, ANN202
        out = draft(rows, caps)
        seen.append(out.flushed)
        return out

    ex.draft = spy  # type: ignore[method-assign]
    prompt = tuple(range(5, 17))  # 12 tokens
    sched.add(Request(prompt, 6, policy=PolicyConfig(policy="fixed", k=2)))
    kept = []
    while sched.pending:
        for ev in sched.step():
            kept.append(len(ev.new_tokens))
    # the first block flushes the prompt (12 tokens; the anchor is not context), then each block what the round
    # before it committed (the first step's event also holds the prefill's token)
    assert len(seen) >= 2 and seen[0] == (12,)
    committed = [kept[0] - 1] + kept[1:]
    assert [f[0] for f in seen[1:]] == committed[:len(seen) - 1]
    assert sched.calibration is not None and sched.calibration.costs.rounds == len(kept)


def test_before_min_rounds_the_profiled_table_is_used_as_is() -> None:
    costs = OnlineCosts(TABLE, CalibrationConfig(min_rounds=16, refresh=4))
    _feed(costs, 15)
    assert costs.table is TABLE and not costs.fitted
    _feed(costs, 1, seed=1)
    assert costs.fitted and costs.table is not TABLE


def test_an_undrafted_stream_keeps_the_drafters_profiled_shape() -> None:
    costs = OnlineCosts(TABLE)
    _feed(costs, 200, draft_p=0.0)  # the gate never opened: no drafted round
    g = costs.scale
    assert costs.table.draft_seconds(1) == pytest.approx(g * TABLE.draft_seconds(1), rel=1e-6)
    assert costs.table.draft_seconds(2) == pytest.approx(g * TABLE.draft_seconds(2), rel=1e-6)


def test_a_stalled_round_moves_the_fit_at_most_three_times_its_price() -> None:
    costs = OnlineCosts(TABLE)
    _feed(costs, 200, draft_p=0.0)
    before = costs.theta[0]
    costs.observe(5.0, [0])  # a 5 s verify (the VM was descheduled; ~2.7 ms is its price): folded as 3× its price
    costs.refit()
    assert costs.theta[0] == pytest.approx(before, rel=0.1)  # unclipped (1,850× its price) it would move it ~10×


def test_one_stalled_drafter_pass_fades_back_to_the_profiled_price() -> None:
    """A drafter pass that took 100× its price (the VM stalled) makes drafting look hopeless; with nothing drafted
    after it, its weight fades and the price returns toward the profile's, so the gate probes again."""
    costs = OnlineCosts(TABLE)
    _feed(costs, 100, draft_p=0.0)
    v, _ = _parts(costs, [3], [0])
    costs.observe(v, [3], None, [0], draft_seconds=100 * TABLE.draft_seconds(1) * costs.scale)
    _feed(costs, 4, seed=1, draft_p=0.0)
    assert costs.summary()["drafter"] > 20  # right after: believed
    _feed(costs, 1500, seed=2, draft_p=0.0)
    assert costs.summary()["drafter"] < 2  # 1,500 undrafted rounds later: mostly the profile's shape again


def test_bad_calibration_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="window"):
        CalibrationConfig(window=0.5)
    with pytest.raises(InvalidArgumentError, match="bounds"):
        CalibrationConfig(bounds=(1.5, 2.0))


def test_box_solve_keeps_each_coefficient_in_its_box() -> None:
    a = [[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]]
    x = box_solve(a, [1.0, 2.0, 3.0], (-9.0,) * 3, (9.0,) * 3)  # the box does not bind: the plain solution
    for row, rhs in zip(a, [1.0, 2.0, 3.0]):
        assert sum(r * v for r, v in zip(row, x)) == pytest.approx(rhs)
    y = box_solve(a, [1.0, 2.0, 3.0], (-9.0, -9.0, -9.0), (9.0, 9.0, 1.0))  # x₂ = 1.45 unbound: fixed at 1, the rest
    assert y[2] == 1.0  # re-solved with it (not merely clipped)
    assert 4.0 * y[0] + 1.0 * y[1] + 0.5 == pytest.approx(1.0) and 1.0 * y[0] + 3.0 * y[1] + 0.2 == pytest.approx(2.0)


class _Clocked:
    """A Backend whose passes advance a fake clock (no real time is measured): verify 10 ms + 1 ms per token, a
    drafter pass 60 ms; the drafter is the target itself with confident c_k (every draft is accepted)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.now = 0.0
        self.draft_calls = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def clock(self) -> float:
        return self.now

    def draft(self, *args, **kwargs) -> DraftBlock:  # noqa: ANN002, ANN003
        self.draft_calls += 1
        self.now += 0.060
        blk = self.inner.draft(*args, **kwargs)
        return DraftBlock(blk.tokens, blk.q, torch.full_like(blk.conf, 0.95))

    def verify(self, slots, tokens, k):  # noqa: ANN001, ANN201
        self.now += 0.010 + 0.001 * int((k + 1).sum())
        return self.inner.verify(slots, tokens, k)


def _stream(be: _Clocked, calibrate: bool, prompts: list[list[int]], n: int) -> list[list[int]]:
    """A plain request, then survival requests, through one scheduler (a server's stream) → their outputs."""
    sched = RoundScheduler(be, LoopConfig(gamma=4, cost_table=TABLE, calibrate=calibrate))
    sched.clock = be.clock
    assert (sched.calibration is not None) == calibrate
    outs = []
    for i, p in enumerate(prompts):
        pol = PolicyConfig(policy="plain") if i == 0 else PolicyConfig(policy="survival", max_k=4)
        rid = sched.add(Request(tuple(p), n, policy=pol))
        toks: list[int] = []
        while sched.pending:
            for ev in sched.step():
                if ev.request_id == rid:
                    toks += ev.new_tokens
        outs.append(toks)
    assert (sched.cost_table is TABLE) != calibrate  # uncalibrated, the rounds priced with the profile as given
    return outs


def test_a_drafter_dearer_than_its_table_price_stops_being_drafted(tiny_models, greedy_oracle) -> None:
    """The table says a drafter pass costs a fourth of a step and a perfect drafter pays 3×; the rounds say it costs
    five and a half, so it loses 1.4× even accepted whole (75 ms for 5 tokens against 11 ms for one). Calibrated,
    the gate closes; from the profile alone it never does. Both outputs are the target's greedy output."""
    from tests.spec_decode.conftest import RefBackend  # noqa: PLC0415

    target = tiny_models["target"]
    prompts = [[11, 22, 33, 44, 55], [7, 8, 9], [100, 3, 5, 9, 2, 4], [42, 43]]
    n = 60
    calls = {}
    for calibrate in (False, True):
        be = _Clocked(RefBackend(target, target))
        outs = _stream(be, calibrate, prompts, n)
        calls[calibrate] = be.draft_calls  # (the plain request drafts nothing)
        for p, out in zip(prompts, outs):
            assert out == greedy_oracle(target, p, n)
    assert calls[False] >= 3 * 11  # every round of the three survival requests drafts (59 tokens / 5-token rounds)
    assert calls[True] <= calls[False] // 2, calls


def test_an_overconfident_head_is_scaled_to_what_was_accepted() -> None:
    """c_j = 0.9 at every position; position 1 is accepted half the time, position 2 (reached) a quarter."""
    acc = OnlineAcceptance(prior=20.0, min_observed=32)
    conf = torch.full((2, 4), 0.9)  # [R, γ']
    assert torch.equal(acc.correct(conf), conf)  # nothing observed yet: as the head says
    rng = random.Random(0)
    for _ in range(2000):
        accepted = 0 if rng.random() < 0.5 else (1 if rng.random() < 0.75 else 2)
        acc.observe([0.9] * 4, 3, accepted)
    r = acc.ratios(4)
    assert r[0] == pytest.approx(0.5 / 0.9, rel=0.08) and r[1] == pytest.approx(0.25 / 0.9, rel=0.15)
    assert r[3] == r[2]  # never reached past 3: the deepest observed ratio
    out = acc.correct(conf, greedy=[True, False])
    assert out[0, 0].item() == pytest.approx(0.9 * r[0]) and torch.equal(out[1], conf[1])  # sampled row: as is


def test_a_well_calibrated_head_is_left_alone() -> None:
    acc = OnlineAcceptance()
    rng = random.Random(1)
    for _ in range(3000):
        c = [rng.uniform(0.2, 0.95) for _ in range(3)]
        accepted = 0
        while accepted < 3 and rng.random() < c[accepted]:
            accepted += 1
        acc.observe(c, 3, accepted)
    assert acc.ratios(3) == pytest.approx([1.0, 1.0, 1.0], abs=0.06)
