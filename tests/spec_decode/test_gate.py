"""The survival policy's drafting gate: a drafter that cannot pay for its own cost is not run (with backoff and
probes), a drafter that pays always is, and output stays the target's greedy output either way."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.loop import LoopConfig, generate
from dspark_trt.spec_decode.protocols import DraftBlock
from dspark_trt.spec_decode.scheduler import (CostTable, GateMemory, PolicyConfig, PolicyState, drafting_gain,
                                              joint_drafting_gain, observe, observe_survival, plan_drafting)

# verify of 1..9 tokens: 1.00 1.05 … 1.40 (relative), drafter pass 0.2 of a step: a CPU-like profile
TABLE = CostTable(tuple(range(1, 10)), tuple(1.0 + 0.05 * i for i in range(9)), draft_t0=0.2, draft_t1=0.0)


def _run_rounds(hit: int, rounds: int, cap: int = 7) -> list[bool]:
    """Drive plan_drafting + observe_survival for one survival request whose drafted rounds accept `hit` tokens
    (K = cap); → drafted? per round."""
    cfg = PolicyConfig(policy="survival", max_k=cap)
    st = PolicyState.initial(cfg)
    drafted = []
    for _ in range(rounds):
        caps = plan_drafting([cfg], [st], [cap], TABLE)
        drafted.append(caps[0] > 0)
        if caps[0] > 0:
            observe_survival(st, cap, hit)
    return drafted


def test_useless_drafter_is_probed_with_exponential_backoff() -> None:
    drafted = _run_rounds(hit=0, rounds=400)
    assert drafted[0]  # the first round probes
    n = sum(drafted)
    assert n <= 14, n  # 1 probe + log2(64) doublings + 400/64 probes at the longest backoff
    gaps = [j - i for i, j in zip([k for k, d in enumerate(drafted) if d], [k for k, d in enumerate(drafted) if d][1:])]
    assert gaps == sorted(gaps) and max(gaps) == 64 + 1  # skips of 1, 2, 4 … 64 rounds between probes


def test_paying_drafter_is_always_drafted() -> None:
    assert all(_run_rounds(hit=3, rounds=100))


def test_drafter_that_stops_paying_is_dropped_and_recovers_after_a_probe() -> None:
    cfg = PolicyConfig(policy="survival", max_k=4)
    st = PolicyState.initial(cfg)
    drafted = []
    for r in range(300):  # the drafter is good for 20 rounds, useless for 40, then good again
        caps = plan_drafting([cfg], [st], [4], TABLE)
        drafted.append(caps[0] > 0)
        if caps[0] > 0:
            observe_survival(st, 4, 0 if 20 <= r < 60 else 4)
    assert all(drafted[:21])
    # the estimate (EMA 0.1: slow enough that a marginal drafter's bursts of rejections do not switch it off) falls
    # below paying within ~23 rounds of a perfect drafter turning useless, then backoff
    assert sum(drafted[20:60]) <= 28
    assert all(drafted[60 + cfg.max_backoff + 2:])  # drafting again from the first probe after it recovered


def _requests(hit: int, n_requests: int, rounds: int, memory: GateMemory | None, cap: int = 7) -> list[list[bool]]:
    """n_requests one after another, `rounds` rounds each, through plan_drafting + observe (which feed `memory`)."""
    cfg = PolicyConfig(policy="survival", max_k=cap)
    out = []
    for _ in range(n_requests):
        st = PolicyState.initial(cfg, memory)
        drafted = []
        for _ in range(rounds):
            caps = plan_drafting([cfg], [st], [cap], TABLE, memory)
            drafted.append(caps[0] > 0)
            if caps[0] > 0:
                observe(cfg, st, cap, hit, torch.ones(cap + 1), torch.ones(cap + 1), memory)
        out.append(drafted)
    return out


def test_gate_memory_carries_the_backoff_across_requests() -> None:
    alone = sum(map(sum, _requests(hit=0, n_requests=10, rounds=40, memory=None)))
    shared = _requests(hit=0, n_requests=10, rounds=40, memory=GateMemory())
    assert shared[0][0] and not any(r[0] for r in shared[1:])  # later requests start from the shared verdict
    assert sum(map(sum, shared)) <= 14 < alone, (sum(map(sum, shared)), alone)  # 400 rounds: as if one request


def test_gate_memory_lets_a_paying_drafter_draft_from_the_first_round() -> None:
    mem = GateMemory()
    runs = _requests(hit=3, n_requests=5, rounds=20, memory=mem)
    assert all(all(r) for r in runs)
    assert mem.backoff == 1 and mem.observed == 100 and mem.survival_est[:3] == pytest.approx([1.0, 1.0, 1.0])
    assert mem.survival_est[3] == pytest.approx(0.0, abs=1e-6)


def test_gate_memory_recovers_when_the_drafter_starts_paying() -> None:
    mem = GateMemory()
    _requests(hit=0, n_requests=3, rounds=40, memory=mem)  # learnt: does not pay, backoff at its longest
    good = _requests(hit=4, n_requests=6, rounds=40, memory=mem)
    flat = [d for r in good for d in r]
    first = flat.index(True)  # the next probe comes within one longest backoff
    assert first <= PolicyConfig().max_backoff + 1
    assert all(flat[first:])


def test_drafter_choosing_k0_backs_off() -> None:
    """A probe whose drafter confidence picks K = 0 leaves no estimate: the gate backs off instead of drafting
    at every round."""
    cfg = PolicyConfig(policy="survival", max_k=4)
    st = PolicyState.initial(cfg)
    drafted = [plan_drafting([cfg], [st], [4], TABLE)[0] > 0 for _ in range(100)]  # K = 0 chosen: nothing observed
    assert drafted[0] and sum(drafted) <= 8, sum(drafted)


def test_drafting_gain_counts_the_drafter_cost() -> None:
    assert drafting_gain([], 4, 1, TABLE) == 0.0
    assert drafting_gain([0.0] * 7, 7, 1, TABLE) < 1.0  # nothing accepted: drafting only costs
    # a_1 = 0.15: 1.15 tokens per (1.05 + 0.2) step-units < 1 token per unit → does not pay
    assert drafting_gain([0.15], 1, 1, TABLE) < 1.0
    assert drafting_gain([0.9, 0.8, 0.7, 0.6], 4, 1, TABLE) > 1.5
    free = CostTable(TABLE.tokens, TABLE.seconds)
    assert drafting_gain([0.3], 1, 1, free) > drafting_gain([0.3], 1, 1, TABLE)  # a free drafter pays sooner


def test_other_policies_and_gate_off_are_untouched() -> None:
    fixed = PolicyConfig(policy="fixed", k=3)
    off = PolicyConfig(policy="survival", gate=False)
    sts = [PolicyState.initial(fixed), PolicyState.initial(off)]
    for st in sts:
        st.survival_est, st.probe = [0.0] * 8, False
    assert plan_drafting([fixed, off], sts, [3, 8], TABLE) == [3, 8]


def test_cost_table_json_keeps_the_drafter_cost(tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(TABLE.to_json()))
    assert CostTable.from_json(f) == TABLE
    with pytest.raises(InvalidArgumentError, match="draft"):
        CostTable((1,), (1.0,), draft_t0=-1.0)
    hot = CostTable(TABLE.tokens, TABLE.seconds, draft_t0=0.2, draft_t1=0.05, sampled_t1=0.3)
    f.write_text(json.dumps(hot.to_json()))
    assert CostTable.from_json(f) == hot and hot.draft_seconds(2, 1) == pytest.approx(0.2 + 0.1 + 0.3)
    old = {"tokens": list(TABLE.tokens), "seconds": list(TABLE.seconds), "draft": {"t0": 0.2, "t1": 0.0}}
    f.write_text(json.dumps(old))  # a table stored before sampled_t1: a sampled row costs nothing extra
    assert CostTable.from_json(f).sampled_t1 == 0.0
    with pytest.raises(InvalidArgumentError, match="sampled_t1"):
        CostTable((1,), (1.0,), sampled_t1=-0.1)


def test_a_sampled_row_pays_for_its_dearer_drafting() -> None:
    """A sampled row's drafting costs table.sampled_t1 more (the drafter's q and draws, their acceptance): with the
    same observed acceptance, the gate stays open for a greedy row and closes for a sampled one, and skip_drafter
    hands a sampled row to a suffix match the greedy row would still draft past."""
    from dspark_trt.spec_decode.proposers import skip_drafter
    from dspark_trt.spec_decode.suffix import SuffixProposal

    hot = CostTable(TABLE.tokens, TABLE.seconds, draft_t0=0.2, draft_t1=0.0, sampled_t1=0.4)
    est = [0.45, 0.2, 0.08]
    assert drafting_gain(est, 3, 1, hot) > 1.0 > drafting_gain(est, 3, 1, hot, sampled=True)
    cfg = PolicyConfig(policy="survival", max_k=3)
    states = [PolicyState.initial(cfg) for _ in range(2)]
    for st in states:
        st.survival_est, st.probe = list(est), False
    assert plan_drafting([cfg, cfg], states, [3, 3], hot, sampled=[False, True]) == [3, 0]
    for st in states:
        st.survival_est = [0.7, 0.45, 0.25]
    weak = SuffixProposal((5, 6, 7), (0.5, 0.4, 0.3), 2, "own")
    assert skip_drafter([3, 3], [weak, weak], states, hot, sampled=[False, True]) == [3, 0]


class _UselessDrafter:
    """Wraps a backend: every draft token is shifted by one id, so the target (almost) never agrees."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.draft_calls = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def draft(self, *args, **kwargs) -> DraftBlock:  # noqa: ANN002, ANN003
        self.draft_calls += 1
        blk = self.inner.draft(*args, **kwargs)
        bad = (blk.tokens + 1) % self.inner.vocab_size
        return DraftBlock(bad, blk.q, None if blk.conf is None else torch.ones_like(blk.conf))


def test_useless_drafter_runs_rarely_and_output_stays_exact(ref_backend, greedy_oracle, tiny_models) -> None:
    be = _UselessDrafter(ref_backend("draft"))
    prompt, n = [11, 22, 33, 44, 55], 60
    res = generate(be, prompt, max_new_tokens=n, policy=PolicyConfig(policy="survival", max_k=4),
                   config=LoopConfig(gamma=4, cost_table=TABLE, calibrate=False))
    assert res.tokens == greedy_oracle(tiny_models["target"], prompt, n)
    assert be.draft_calls <= 8, be.draft_calls  # of ~60 rounds


def test_useless_drafter_across_requests_shares_one_gate(ref_backend, greedy_oracle, tiny_models) -> None:
    be = _UselessDrafter(ref_backend("draft"))
    gate = GateMemory()
    prompts = [[11, 22, 33, 44, 55], [7, 8, 9], [100, 3, 5, 9, 2, 4], [42]]
    for prompt in prompts:
        res = generate(be, prompt, max_new_tokens=30, policy=PolicyConfig(policy="survival", max_k=4),
                       config=LoopConfig(gamma=4, cost_table=TABLE, calibrate=False), gate=gate)
        assert res.tokens == greedy_oracle(tiny_models["target"], prompt, 30)
    assert be.draft_calls <= 8, be.draft_calls  # of ~120 rounds over 4 requests (alone: ≥ 4 probes each)


def test_drafting_gain_extends_the_observed_survival_geometrically() -> None:
    """Rounds that verified one token say nothing about position 2+: the gate assumes the observed decay goes on,
    so a drafter with a_1 = 0.35 is judged on K = 1..cap, not on K = 1 alone (where it cannot pay here)."""
    flat = CostTable(tuple(range(1, 10)), tuple(1.0 + 0.02 * i for i in range(9)), draft_t0=0.4, draft_t1=0.0)
    one = drafting_gain([0.35], 1, 1, flat)
    assert one < 1.0  # 1.35 tokens per 1.02 + 0.4 step-units
    ext = drafting_gain([0.35], 4, 1, flat)  # a = .35 .12 .043 .015 → best K = 3
    want = max((1 + sum(0.35 ** j for j in range(1, k + 1))) / (1.0 + 0.02 * k + 0.4) for k in range(1, 5))
    assert ext == pytest.approx(want) and ext > 1.0 > one
    assert drafting_gain([0.0], 7, 1, flat) < 1.0  # nothing accepted: nothing to extend


def test_gate_hysteresis_keeps_a_marginal_drafter_in_its_state() -> None:
    """An estimate whose drafting gain lies between 1 − gate_hysteresis and 1 + gate_margin changes nothing: an open
    gate stays open (drafts every round), a closed one stays closed (only probes). The default band is [1, 1 + margin):
    an open gate closes as soon as drafting promises less than plain."""
    cfg = PolicyConfig(policy="survival", min_k=1, max_k=1, gate_hysteresis=0.03)
    est = [0.22]  # K = 1: (1 + 0.22) / (1.05 + 0.2) = 0.976 of plain
    assert 1.0 - cfg.gate_hysteresis <= drafting_gain(est, 1, 1, TABLE) < 1.0 + cfg.gate_margin
    opened = PolicyState.initial(cfg)
    opened.survival_est, opened.probe = list(est), False
    assert all(plan_drafting([cfg], [opened], [1], TABLE)[0] == 1 for _ in range(50))
    closed = PolicyState.initial(cfg)
    closed.survival_est, closed.probe, closed.backoff = list(est), False, 2  # closed once already
    drafted = [plan_drafting([cfg], [closed], [1], TABLE)[0] > 0 for _ in range(200)]
    assert sum(drafted) <= 8  # probes only, at backoffs 2, 4, … 64
    strict = PolicyConfig(policy="survival", min_k=1, max_k=1)
    assert strict.gate_hysteresis == 0.0
    st = PolicyState.initial(strict)
    st.survival_est, st.probe = list(est), False
    assert plan_drafting([strict], [st], [1], TABLE)[0] == 0  # without hysteresis the same estimate closes it


def test_a_probe_after_a_closed_spell_verifies_at_most_probe_k_tokens() -> None:
    """The first round of a fresh request drafts its full cap; a probe after the gate closed drafts ≤ probe_k (it
    re-measures a_1..a_probe_k at a short verify's cost), and a recovered drafter gets its full cap back."""
    cfg = PolicyConfig(policy="survival", max_k=7, probe_k=2)
    st = PolicyState.initial(cfg)
    caps = [plan_drafting([cfg], [st], [7], TABLE)[0] for _ in range(1)]
    assert caps == [7]
    observe_survival(st, 7, 0)
    seen = []
    for _ in range(40):
        c = plan_drafting([cfg], [st], [7], TABLE)[0]
        seen.append(c)
        if c:
            observe_survival(st, c, 0)
    assert seen.count(0) > 30 and {c for c in seen if c} == {2}  # closed: probes only, each of 2 tokens
    after = []
    for _ in range(300):  # the drafter recovers: probes accept everything until the gate reopens
        c = plan_drafting([cfg], [st], [7], TABLE)[0]
        after.append(c)
        if c:
            observe_survival(st, c, c)
    assert after[-50:] == [7] * 50  # open again, at the full cap
    with pytest.raises(InvalidArgumentError, match="probe_k"):
        PolicyConfig(policy="survival", probe_k=0)


def test_survival_estimate_counts_every_drafted_round_not_only_the_deep_ones() -> None:
    """K follows the drafter's confidences, so the rounds that verify position j are the confident ones: folding
    verified positions only overestimates the drafter (a 0.5-survival drafter looked like 0.9). Folding every
    drafted round — the unverified positions at the block's own calibrated survival — recovers the true mean."""
    gen = torch.Generator().manual_seed(7)
    good, bad = [0.9, 0.81, 0.73, 0.66], [0.1, 0.01, 0.001, 0.0001]  # calibrated survival a_1..a_4 of the block
    folded, verified_only = PolicyState(k=4), PolicyState(k=4)
    seen: list[list[float]] = []
    for r in range(4000):
        is_good = bool(torch.rand(1, generator=gen) < 0.5)
        model = good if is_good else bad
        k = 4 if is_good else 0  # the survival rule verifies confident blocks only
        u = float(torch.rand(1, generator=gen))
        accepted = sum(u < a for a in model[:k])  # a draw from the block's own survival
        observe_survival(folded, k, accepted, model=model)
        if k:
            observe_survival(verified_only, k, accepted)
        if r >= 100:
            seen.append(list(folded.survival_est))
    mean_est = [sum(e[j] for e in seen) / len(seen) for j in range(4)]  # the EMA's time average (one EMA is noisy)
    truth = [(g + b) / 2 for g, b in zip(good, bad)]
    assert verified_only.survival_est[0] > 0.8  # the biased estimate: only the confident half is seen
    assert mean_est == pytest.approx(truth, abs=0.03)
    # the gate therefore sees that this drafter does not pay at batch 4 under a CPU-like profile
    knee = CostTable((1, 4, 5, 8), (1.0, 1.0, 1.2, 1.5), draft_t0=0.15, draft_t1=0.0)
    assert drafting_gain(truth, 4, 4, knee) < 1.0 < drafting_gain(verified_only.survival_est, 4, 4, knee)


def test_no_probe_where_even_a_perfect_drafter_cannot_pay() -> None:
    """At a batch where verify tokens cost what they commit (compute-bound), a probe can only lose: a wave of requests
    admitted together would each pay a drafter row and probe_k tokens after their closed spells. The rows wait;
    where the batch is small enough for drafting to pay, the same states probe."""
    # step(n) = n from 8 tokens on (compute-bound), flat below; drafter pass 0.5 of a one-token step
    tokens = tuple(range(1, 65))
    table = CostTable(tokens, tuple(max(1.0, n / 8) for n in tokens), draft_t0=0.5, draft_t1=0.0)
    cfg = PolicyConfig(policy="survival", max_k=4)
    assert drafting_gain([1.0] * 4, 4, 32, table) < 1.0 < drafting_gain([1.0] * 4, 4, 2, table)

    def wave(rows: int) -> tuple[list[int], list[PolicyState]]:
        states = [PolicyState.initial(cfg) for _ in range(rows)]
        for st in states:  # due to probe after a closed spell
            st.survival_est, st.backoff, st.probe = [0.9, 0.8, 0.7, 0.6], 8, True
        return plan_drafting([cfg] * rows, states, [4] * rows, table), states

    caps, states = wave(32)
    assert caps == [0] * 32
    assert all(st.skip_left == 7 and st.backoff == 8 and not st.probe for st in states)  # the same spell again
    caps, states = wave(2)
    assert caps == [cfg.probe_k] * 2 and all(st.skip_left == 0 for st in states)
    # a request's first round measures the drafter for the first time: it probes whatever the batch
    fresh = [PolicyState.initial(cfg) for _ in range(32)]
    assert plan_drafting([cfg] * 32, fresh, [4] * 32, table) == [4] * 32


def test_hybrid_requests_keep_their_own_gate_memory() -> None:
    """A hybrid row drafts only the rounds its suffix match did not win: its DSpark rounds are another sample of the
    drafter, so they neither lower nor close the DSpark-alone requests' shared gate (and the other way round)."""
    memory = GateMemory()
    alone = PolicyConfig(policy="survival", max_k=4)
    hybrid = PolicyConfig(policy="survival", max_k=4, proposers=("dspark", "suffix"))
    st = PolicyState.initial(hybrid, memory)
    for _ in range(30):  # the hybrid's drafted rounds accept nothing; its gate closes
        if plan_drafting([hybrid], [st], [4], TABLE, memory)[0]:
            observe(hybrid, st, 4, 0, [0.5] * 5, [0.1] * 5, memory)
    mine = memory.of(("dspark", "suffix"))
    assert mine.survival_est[0] == 0.0 and mine.backoff > 1
    assert memory.survival_est == [] and memory.backoff == 1 and memory.skip_left == 0  # DSpark alone: untouched
    fresh = PolicyState.initial(alone, memory)
    assert fresh.probe and fresh.survival_est == [] and fresh.skip_left == 0
    assert PolicyState.initial(hybrid, memory).survival_est == mine.survival_est  # the next hybrid request inherits


def test_a_stream_probes_once_a_spell_not_once_per_request() -> None:
    """Two requests of one stream (a shared GateMemory) with a drafter that never pays: after the gate closes, one
    probe a spell for the stream — the other row waits, its result folded into the shared estimate — where two
    independent requests would each probe on their own schedule."""
    cfg = PolicyConfig(policy="survival", max_k=7)

    def drafted_rows(memory: GateMemory | None) -> int:
        states = [PolicyState.initial(cfg, memory) for _ in range(2)]
        states[1].probe = True  # both start drafting (two fresh requests)
        n = 0
        for _ in range(1000):
            caps = plan_drafting([cfg, cfg], states, [7, 7], TABLE, memory)
            for st, c in zip(states, caps):
                if c > 0:
                    n += 1
                    observe_survival(st, c, 0)
                    if memory is not None:
                        memory.observe(c, 0)
        return n

    alone = drafted_rows(None)  # no memory: each request its own schedule (1 + log2(64) + 1000/65 probes, twice)
    shared = drafted_rows(GateMemory())  # at the longest spell one probe per 65 rounds for both (ones at the start)
    assert alone >= 40 and shared <= alone * 2 // 3, (alone, shared)


# verify of 1..16 tokens: +2% a token; a drafter pass 0.3 of a step plus 0.02 a row (its weights read once a pass)
SHARED = CostTable(tuple(range(1, 17)), tuple(1.0 + 0.02 * i for i in range(16)), draft_t0=0.3, draft_t1=0.02)
MARGINAL = [0.45, 0.2, 0.09]  # the shipped drafter's loop acceptance: does not pay a whole pass alone here


def _states(cfg: PolicyConfig, *ests: list[float]) -> list[PolicyState]:
    sts = [PolicyState.initial(cfg) for _ in ests]
    for st, est in zip(sts, ests):
        st.survival_est, st.probe, st.backoff = list(est), False, 1
    return sts


def test_rows_that_do_not_pay_alone_share_one_drafter_pass() -> None:
    cfg = PolicyConfig(policy="survival")
    assert drafting_gain(MARGINAL, 3, 2, SHARED) < 1.0 < joint_drafting_gain([MARGINAL] * 2, [3, 3], 2, SHARED)
    plain = PolicyConfig(policy="plain")
    alone = _states(cfg, MARGINAL) + [PolicyState.initial(plain)]
    assert plan_drafting([cfg, plain], alone, [3, 0], SHARED) == [0, 0]  # beside a plain row: it pays no pass alone
    both = _states(cfg, MARGINAL, MARGINAL)
    assert plan_drafting([cfg] * 2, both, [3, 3], SHARED) == [3, 3]  # together: one pass pays for both
    assert all(st.backoff == 1 and st.skip_left == 0 for st in both)
    solo = PolicyConfig(policy="survival", share_pass=False)
    assert plan_drafting([solo] * 2, _states(solo, MARGINAL, MARGINAL), [3, 3], SHARED) == [0, 0]  # as before
    useless = _states(cfg, [0.02], [0.02])
    assert plan_drafting([cfg] * 2, useless, [3, 3], SHARED) == [0, 0]  # together or not, nothing pays
    assert all(st.backoff == 2 for st in useless)  # closed: the backoff doubles as before
    # a row already drafting pays the pass's fixed cost: a marginal row beside it pays only for its own row
    assert drafting_gain(MARGINAL, 3, 2, SHARED, pass_paid=True) > 1.0
    assert plan_drafting([cfg] * 2, _states(cfg, [0.9, 0.8, 0.7], MARGINAL), [3, 3], SHARED) == [3, 3]
    # three rows: the best-rated pair opens where it pays and the third stays closed if it cannot pay its row
    three = _states(cfg, MARGINAL, MARGINAL, [0.01])
    assert plan_drafting([cfg] * 3, three, [3, 3, 3], SHARED) == [3, 3, 0]


def _joint_by_formula(ests, caps, rows, table, load, sampled, ctx):  # noqa: ANN001, ANN202
    """The docstring's formula term by term, with the verify pass summed token by token (marginal_seconds)."""
    from dspark_trt.spec_decode.gain import extended_survival

    a = [extended_survival(e, c) for e, c in zip(ests, caps)]
    n, cap = len(a), min(len(x) for x in a)
    x = sum(table.row_seconds(c) for c in ctx)
    base = rows / (table.step_seconds(rows) + x)
    best = 0.0
    for k in range(1, cap + 1):
        tokens = rows + sum(sum(r[:k]) for r in a)
        verify = table.step_seconds(rows) + sum(table.marginal_seconds(rows + i, load) for i in range(n * k))
        cost = (verify + x + sum(k * table.token_seconds(c) + table.draft_row_seconds(c) for c in ctx)
                + table.draft_seconds(n, sum(sampled)))
        best = max(best, tokens / cost / base)
    return best


def test_prefix_gains_match_the_formula_for_every_prefix() -> None:
    from dspark_trt.spec_decode.costs import RoundLoad
    from dspark_trt.spec_decode.gain import prefix_drafting_gains

    ests = [[0.9, 0.8, 0.7], MARGINAL, [0.3], [0.6, 0.2, 0.1, 0.05]]
    caps, ctx, smp = [3, 7, 2, 4], [64, 900, None, 3000], [False, True, False, False]
    ctx_table = replace(SHARED, context=64, ctx_t0=1e-4, ctx_t1=2e-5, draft_ctx=1e-5, sampled_t1=0.1)
    for table in (SHARED, ctx_table):
        for load in (RoundLoad(), RoundLoad(40, fused=True)):
            gains = prefix_drafting_gains(ests, caps, 5, table, load, smp, ctx)
            for n in range(1, len(ests) + 1):
                want = _joint_by_formula(ests[:n], caps[:n], 5, table, load, smp[:n], ctx[:n])
                assert gains[n - 1] == pytest.approx(want, rel=1e-9)
            assert gains[0] == pytest.approx(drafting_gain(ests[0], caps[0], 5, table, load, smp[0], ctx[0]))
