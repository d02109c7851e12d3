"""K policies: how many draft tokens each request verifies in the next round (0 ≤ K ≤ γ).

Owns the policy configs (frozen dataclasses), per-request policy state, the confidence heuristic, the
batch-aware survival/cost policy (DSpark paper Algorithm 1) over the cost table (spec_decode.costs: CostTable, the
round's prefill RoundLoad; re-exported here), and `schedule_batch`,
which combines them with the draft-side early stop for one round. Every policy is lossless: it only chooses
how much to verify. Pure Python/torch; knows nothing of models, caches or serving.

Policies:
- plain: K = 0 (plain decoding; the drafter is not run).
- fixed: K = k.
- confidence (alias "seed"): conf = 0.4·avg_top1 + 0.3·min(5·avg(top1 − top2), 1) + 0.3·EMA(acceptance, 0.2 on
  the new round); K_next = clamp(int(min_k + (max_k − min_k)·(conf − low)/(high − low)), min_k, max_k); K rises only if the
  last round accepted ≥ 1; a first-token rejection (k ≥ 1, accepted 0) drops K to min_k at once.
- survival (the default): per-request K maximising Σ_r(1 + Σ_{j≤K_r} a_rj)·SPS(Σ_r(1 + K_r)) over the whole
  batch, by greedy admission of (request, position) pairs in descending a, stopping at the first drop; floor K = 0.
  Before drafting, `plan_drafting` weighs the drafter's own cost too: a request whose observed acceptance cannot
  pay for a drafter pass plus the extra verify tokens is not drafted (K = 0, drafter not run) for a backoff of
  1, 2, 4, … rounds, then probed again — so a useless drafter costs little more than plain decoding. Rows share
  the drafter's pass: those that would not pay alone are opened where they pay together (one pass, its fixed
  cost once: spec_decode.gain.joint_drafting_gain) or where the pass runs for other rows anyway. The gate has
  hysteresis: open, it closes when drafting promises < 1 − gate_hysteresis (default 0) of plain; closed, it
  reopens at ≥ 1 + gate_margin (a marginal drafter's noisy estimate would otherwise switch it on and off). A
  `GateMemory` carries the gate across requests (the observed survival and the backoff of one engine or server):
  a new request starts from what earlier requests measured, so short requests do not each re-probe from scratch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.confidence import (ConfidenceWeights, confidence_score, early_stop_k, ema_update,
                                               fallback_survival, round_signals, survival)
from dspark_trt.spec_decode.costs import NO_PREFILL, CostTable, RoundLoad
from dspark_trt.spec_decode.gain import (drafting_gain, extended_survival, joint_drafting_gain,
                                         prefix_drafting_gains)
from dspark_trt.spec_decode.policies import POLICIES, PROPOSERS, canonical_policy, parse_proposers

__all__ = ["POLICIES", "PROPOSERS", "PolicyConfig", "PolicyState", "GateMemory", "CostTable", "RoundLoad",
           "plan_survival", "plan_drafting", "drafting_gain", "joint_drafting_gain", "extended_survival",
           "observe_survival", "schedule_batch", "confidence_next_k", "verify_cap"]


@dataclass(frozen=True)
class PolicyConfig:
    """One request's K policy and its parameters (unused fields are ignored by other policies)."""

    policy: str = "survival"  # one of POLICIES; the alias "seed" is stored as "confidence"
    k: int = 4  # fixed
    min_k: int = 2  # confidence
    max_k: int = 8  # confidence, survival
    low: float = 0.3  # confidence: conf at/below → min_k
    high: float = 0.7  # confidence: conf at/above → max_k
    weights: ConfidenceWeights = field(default_factory=ConfidenceWeights)
    draft_stop: float = 0.0  # draft-side early stop: cut where Π c_i < draft_stop (0 = off; needs drafter conf)
    gate: bool = True  # survival: skip drafting (with backoff) while the drafter does not pay for its own cost
    gate_margin: float = 0.02  # survival gate: a closed gate reopens when drafting promises ≥ this gain over plain
    gate_hysteresis: float = 0.0  # survival gate: an open gate closes when drafting promises < 1 − this
    max_backoff: int = 64  # survival gate: the longest run of undrafted rounds between probes
    probe_k: int = 2  # survival gate: the most a probe after a closed spell verifies (it only re-measures a_1, a_2)
    share_pass: bool = True  # survival gate: rows that would not pay a drafter pass alone may share one
    proposers: tuple[str, ...] = ("dspark",)  # who may propose drafts: "dspark" (the drafter's block), "suffix"
    # (spec_decode.suffix: a match in the request's own tokens / recent outputs); both: chosen per row per round

    def uses(self, proposer: str) -> bool:
        """Whether this request may take its drafts from `proposer` (never, under the plain policy)."""
        return self.policy != "plain" and proposer in self.proposers

    def ceiling(self, k_now: int) -> int:
        """The most this policy verifies in one round; k_now: the K its state wants now (the confidence policy's)."""
        return {"plain": 0, "fixed": self.k, "confidence": k_now, "survival": self.max_k}[self.policy]

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", canonical_policy(self.policy))
        object.__setattr__(self, "proposers", parse_proposers(self.proposers))
        if self.k < 0:
            raise InvalidArgumentError(f"k must be ≥ 0 (0 = plain decoding), got {self.k}")
        if self.policy == "confidence" and self.min_k < 1:
            raise InvalidArgumentError(
                f"min_k must be ≥ 1 for the confidence policy (a K=0 round carries no acceptance signal, so K could "
                f"never rise again), got {self.min_k}; use --policy plain for K=0")
        if self.min_k < 0 or self.max_k < self.min_k:
            raise InvalidArgumentError(f"need 0 ≤ min_k ≤ max_k, got min_k={self.min_k}, max_k={self.max_k}")
        if not 0.0 <= self.low < self.high <= 1.0:
            raise InvalidArgumentError(f"need 0 ≤ low < high ≤ 1, got low={self.low}, high={self.high}")
        if not 0.0 <= self.draft_stop < 1.0:
            raise InvalidArgumentError(f"draft_stop (confidence threshold) must be in [0, 1), got {self.draft_stop}")
        if self.gate_margin < 0 or not 0.0 <= self.gate_hysteresis < 1.0 or self.max_backoff < 1 or self.probe_k < 1:
            raise InvalidArgumentError(f"need gate_margin ≥ 0, 0 ≤ gate_hysteresis < 1, max_backoff ≥ 1 and "
                                       f"probe_k ≥ 1, got {self.gate_margin}, {self.gate_hysteresis}, "
                                       f"{self.max_backoff}, {self.probe_k}")


@dataclass
class PolicyState:
    """Per-request scheduler state, updated after every verified round."""

    k: int  # K the policy wants next round (confidence; fixed; 0 plain; survival: cap)
    ema: float = 0.5  # EMA of the acceptance rate
    last_accepted: int = -1  # -1 before the first round
    last_k: int = -1
    conf: float = float("nan")  # last confidence-formula value
    survival_est: list[float] = field(default_factory=list)  # observed P(accepted ≥ j), j = 1.. (survival gate)
    observed: int = 0  # verified rounds behind survival_est
    skip_left: int = 0  # survival gate: rounds left without drafting
    backoff: int = 1  # survival gate: length of the next skip
    probe: bool = True  # survival gate: draft this round whatever the estimate says (first round, after a skip)
    inherited_skip: bool = False  # survival gate: skip_left came from an earlier request (GateMemory), not this one
    closed_at: int = -1  # survival gate: the stream round (GateMemory.rounds) its current skip began (-1: inherited)

    @classmethod
    def initial(cls, cfg: PolicyConfig, memory: "GateMemory | None" = None) -> "PolicyState":
        """A new request's state; a gated survival request starts from `memory` (what earlier requests measured)."""
        k = cfg.ceiling(cfg.min_k)
        st = cls(k=k, ema=cfg.weights.ema_init)
        mem = memory.of(cfg.proposers) if memory is not None and cfg.policy == "survival" and cfg.gate else None
        if mem is not None and mem.survival_est:
            st.survival_est = list(mem.survival_est)
            st.observed = min(mem.observed, GateMemory.PRIOR_ROUNDS)  # its own rounds soon outweigh the prior
            st.backoff = min(mem.backoff, cfg.max_backoff)
            st.skip_left = min(mem.skip_left, cfg.max_backoff)  # a skip in progress goes on (unless this request
            st.inherited_skip = st.skip_left > 0  # pays: plan_drafting weighs it at its own context first)
            st.closed_at = mem.closed_at  # the spell it continues began there
            st.probe = mem.probe  # else decided by the inherited estimate
        return st


@dataclass
class GateMemory:
    """The survival gate across requests of one engine or server: the observed survival P(accepted ≥ j) over all
    gated rounds (EMA) and the current backoff. Requests read it when they start (PolicyState.initial) and fold
    their rounds and gate decisions into it, so a drafter that does not pay is probed every max_backoff rounds of
    the whole stream instead of 1, 2, 4, … rounds into every request. Mutable, one per RoundScheduler owner;
    with several gated requests in flight it follows the one decided last. Requests with other proposers than the
    DSpark block alone keep their own (`of`): a hybrid row drafts only the rounds its suffix match did not win, so
    its DSpark rounds are another sample of the drafter's acceptance."""

    PRIOR_ROUNDS = 3  # a new request weighs the shared estimate like this many of its own rounds
    survival_est: list[float] = field(default_factory=list)
    observed: int = 0
    backoff: int = 1  # length of the next skip
    skip_left: int = 0  # rounds of the current skip still to go
    probe: bool = False  # the next round is a probe
    others: dict[tuple[str, ...], "GateMemory"] = field(default_factory=dict)  # proposer set → its memory
    rounds: int = 0  # rounds of the stream so far (plan_drafting counts them on the memory it is given)
    last_probe: int = -2  # the stream round of the last probe after a closed spell (this proposer set's)
    closed_at: int = -1  # the stream round the current skip began

    def of(self, proposers: Sequence[str]) -> "GateMemory":
        """The memory of the requests whose proposers are `proposers`: this one for the DSpark block alone."""
        key = tuple(proposers)
        return self if key == ("dspark",) else self.others.setdefault(key, GateMemory())

    def observe(self, k: int, accepted: int, floor_weight: float = 0.02,
                model: Sequence[float] | None = None) -> None:
        """Fold one drafted gated round into the shared estimate (running mean, then EMA; `model` as in _fold)."""
        self.observed += 1
        w = max(1.0 / self.observed, floor_weight)
        _fold(self.survival_est, k, accepted, w, model)


def verify_cap(cfg: PolicyConfig, state: PolicyState, gamma: int, tokens_left: int, max_seq: int,
               committed: int) -> int:
    """The most one request may verify next round: min(γ, its policy's ceiling, tokens left − 1 (the round's own
    target token), cache room max_seq − committed − 1), never below 0. spec_decode.loop.RoundScheduler asks this,
    whatever its executor."""
    return max(0, min(gamma, cfg.ceiling(state.k), tokens_left - 1, max_seq - committed - 1))


def confidence_next_k(cfg: PolicyConfig, conf: float, current_k: int, k: int, accepted: int) -> int:
    """The confidence rule: linear map of conf between low/high onto [min_k, max_k], clamped; raise only after a round
    that accepted ≥ 1; drop to min_k right after a first-token rejection (k ≥ 1 and accepted == 0)."""
    lin = int(cfg.min_k + (cfg.max_k - cfg.min_k) * (conf - cfg.low) / (cfg.high - cfg.low))
    nxt = max(cfg.min_k, min(cfg.max_k, lin))
    if k >= 1 and accepted == 0:
        return cfg.min_k
    if nxt > current_k and accepted < 1:
        return max(cfg.min_k, min(cfg.max_k, current_k))
    return nxt


def observe(cfg: PolicyConfig, state: PolicyState, k: int, accepted: int,
            top1: Sequence[float], margin: Sequence[float], memory: GateMemory | None = None,
            model: Sequence[float] | None = None) -> float:
    """Update `state` after a verified round (top1/margin [K+1] floats of this row) → the confidence-formula value.
    model: the drafter's calibrated survival a_1..a_n of this row's block when the drafter ran for it (None: not
    drafted, or no confidence head); the survival estimate folds every drafted round, K = 0 included (_fold).
    The acceptance EMA only moves on rounds that verified something (k ≥ 1). Computed for every policy (it is
    logged); only the confidence policy uses it to set K."""
    avg_top1, avg_margin = round_signals(top1, margin, k)
    if k >= 1:
        state.ema = ema_update(state.ema, accepted / k, cfg.weights.ema_weight)
    if k >= 1 or model:
        observe_survival(state, k, accepted, model=model)
        if memory is not None and cfg.policy == "survival" and cfg.gate:
            memory.of(cfg.proposers).observe(k, accepted, model=model)
    conf = confidence_score(avg_top1, avg_margin, state.ema, cfg.weights)
    if cfg.policy == "confidence":
        state.k = confidence_next_k(cfg, conf, state.k, k, accepted)
    state.last_k, state.last_accepted, state.conf = k, accepted, conf
    return conf


def plan_survival(a_rows: Sequence[torch.Tensor], fixed_tokens: int, table: CostTable,
                  min_gain: float = 0.0, fixed_tau: float | None = None, load: RoundLoad = NO_PREFILL,
                  contexts: Sequence[int] | None = None, fixed_seconds: float = 0.0) -> list[int]:
    """Batch-aware K for the survival rows (DSpark Alg. 1).

    a_rows[r] [cap_r]: survival a_{r,1..cap_r} (non-increasing; cap_r = the most row r may verify).
    fixed_tokens: tokens of the other rows in the same verify batch (Σ(1 + K) of non-survival rows);
    fixed_tau: their expected committed tokens (default: fixed_tokens, i.e. every other token commits).
    load: the prompt tokens this round admits (spec_decode.costs: a fused prefill prices each verify token at its
    marginal cost after the prompt's tokens in the same pass; a separate one does not move K).
    contexts [R]: each row's cached tokens (costs.CostTable.row_seconds / token_seconds: a long-context row's verify
    tokens cost more); fixed_seconds: what the other rows' contexts add to the pass.
    Start at K_r = 0 (every row still verifies its anchor), then admit (r, j) pairs in descending a (ties: lower j,
    then lower r) while Θ = (expected committed tokens) / (decode seconds) does not drop by more than min_gain
    (relative); stop at the first drop (with contexts: a row stops at its first drop, the others go on while some
    row's tokens are cheaper than the stopped ones'). Decode seconds = step(n₀) for the anchors plus each admitted
    token's marginal cost (costs.CostTable.marginal_seconds, + its row's token_seconds); without a fused prefill or
    contexts that is step(n), Θ = τ·SPS(n)."""
    n_rows = len(a_rows)
    ks = [0] * n_rows
    ctx = list(contexts) if contexts is not None else [None] * n_rows
    tokens = fixed_tokens + n_rows
    tau = float(n_rows) + (float(fixed_tokens) if fixed_tau is None else fixed_tau)
    curve = table.step_seconds(max(tokens, 1))  # the step column's part of the pass
    extra = fixed_seconds + sum(table.row_seconds(c) for c in ctx)  # what the rows' contexts add to it
    theta = tau / (curve + extra)
    per_token = [table.token_seconds(c) for c in ctx]  # [R] what each row's verify token adds past the column
    closed: set[int] = set()  # rows whose next token did not pay (a dearer row's stop does not stop cheaper rows)
    cand = [(-float(a[j]), j, r) for r, a in enumerate(a_rows) for j in range(len(a))]
    cand.sort()
    for neg_a, j, r in cand:
        if j != ks[r] or r in closed:  # keep each row's K a prefix (a is non-increasing: this only skips ties/noise)
            continue
        new_curve = (table.step_seconds(tokens + 1) if load.offset == 0
                     else curve + table.marginal_seconds(tokens, load))
        new_extra = extra + per_token[r]
        new_theta = (tau - neg_a) / (new_curve + new_extra)
        if new_theta < theta * (1.0 + min_gain):
            closed.add(r)
            if all(per_token[q] >= per_token[r] for q in range(n_rows) if q not in closed):
                break  # no open row's token is cheaper: none with a smaller a can pay either
            continue
        ks[r] += 1
        tokens += 1
        tau -= neg_a
        theta, curve, extra = new_theta, new_curve, new_extra
    return ks


def observe_survival(state: PolicyState, k: int, accepted: int, floor_weight: float = 0.1,
                     model: Sequence[float] | None = None) -> None:
    """Fold one drafted round (k tokens verified, `accepted` of them kept; `model`: the drafter's calibrated
    survival a_1..a_n of the round's block, None without a head) into the observed survival estimate
    P(accepted ≥ j): a running mean over the first rounds, then an EMA with weight `floor_weight` (see _fold)."""
    state.observed += 1
    _fold(state.survival_est, k, accepted, max(1.0 / state.observed, floor_weight), model)


def _fold(est: list[float], k: int, accepted: int, w: float, model: Sequence[float] | None = None) -> None:
    """est[j-1] ← (1 − w)·est[j-1] + w·h_j (positions first seen start at h_j), over j = 1..max(k, len(model)).

    h_j is what the round says about P(accepted ≥ j): [accepted ≥ j] where it verified j; past k, 0 if a verified
    token was rejected, else the drafter's own conditional a_j / a_k (a_j for k = 0). Every drafted round counts —
    the rounds whose confidences chose a small K (or none) included — so the estimate is the drafter's survival
    over the rounds the gate pays for, not over the rounds that verified deep (K follows the confidences, so
    folding verified positions only overestimates every position past the first). Without a model only verified
    positions are folded."""
    n = max(k, len(model) if model is not None else 0)
    for j in range(1, n + 1):
        if j <= k:
            hit = 1.0 if accepted >= j else 0.0
        elif accepted < k or model is None:
            hit = 0.0
        else:
            base = float(model[k - 1]) if k >= 1 else 1.0
            hit = min(1.0, float(model[j - 1]) / base) if base > 0 else 0.0
        if j <= len(est):
            est[j - 1] = (1.0 - w) * est[j - 1] + w * hit
        else:
            est.append(hit)


def plan_drafting(cfgs: Sequence[PolicyConfig], states: Sequence[PolicyState], caps: Sequence[int],
                  table: CostTable, memory: GateMemory | None = None, load: RoundLoad = NO_PREFILL,
                  sampled: Sequence[bool] | None = None, contexts: Sequence[int] | None = None) -> list[int]:
    """Draft caps for one round before the drafter runs: survival rows whose observed acceptance cannot pay for a
    drafter pass and its verify tokens get 0 (not drafted) for 1, 2, 4, … rounds (up to max_backoff), then one
    probe round drafts again whatever the estimate says (at most probe_k tokens after a closed spell: enough to see
    whether a_1, a_2 recovered, without paying a long verify for a drafter that does not pay). Other policies keep
    their caps. No row probes after a closed spell in a round where even a drafter whose every token is accepted
    could not pay (a large batch, verify tokens compute-bound): it waits another spell (a request's first round,
    which measures the drafter for the first time, still probes). A skip a request inherited from an earlier one
    (GateMemory) goes on only where the shared estimate does not pay at this row's context: a long-context request
    that closed the gate does not close it for the short-context requests after it. With a memory, the stream
    probes once a spell, not once per request: a row whose closed spell saw another row of the stream probe (its
    result in the shared estimate) waits another spell unless that estimate now pays here — each probe pays a
    drafter pass and the backlog its row has not projected since it last drafted. sampled [B]: the rows that
    sample (their drafting is priced with table.sampled_t1); contexts [B]: the rows' cached tokens (a long-context
    row's verify tokens and drafter row cost more: costs.CostTable). Updates `states` (and `memory`'s backoff and
    skip: the next request continues them)."""
    out = [max(0, int(c)) for c in caps]
    rows = len(out)
    hopeless: dict[int, bool] = {}  # cap → even a drafter whose every token is accepted cannot pay in this round
    deferred: list[int] = []  # rows whose drafting does not pay alone (_share_the_pass decides them)
    now = -1
    if memory is not None:
        memory.rounds += 1
        now = memory.rounds
    for r, (cfg, st) in enumerate(zip(cfgs, states)):
        if cfg.policy != "survival" or not cfg.gate or out[r] == 0:
            continue
        ctx = contexts[r] if contexts is not None else None
        samples = bool(sampled[r]) if sampled else False
        if st.inherited_skip:  # an earlier request's closed spell: it may have closed for its own context or text
            st.inherited_skip = False
            if drafting_gain(st.survival_est, out[r], rows, table, load, samples, ctx) >= 1.0 + cfg.gate_margin:
                st.skip_left, st.backoff, st.probe = 0, 1, False  # the shared estimate pays here: decide now
        if st.skip_left > 0:
            st.skip_left -= 1
            st.probe = st.skip_left == 0
            out[r] = 0
        elif st.probe and st.backoff > 1 and hopeless.setdefault(
                out[r], drafting_gain([1.0] * out[r], out[r], rows, table, load) < 1.0):
            # a batch this large turns verify tokens compute-bound: no acceptance could pay for a drafter row and
            # its tokens, so a probe after a closed spell would only pay them (a wave of requests admitted together
            # ends its spells together, and each would probe); the row waits another spell of the same length
            st.skip_left, st.closed_at = st.backoff - 1, now
            st.probe = st.skip_left == 0
            out[r] = 0
        elif st.probe and st.backoff > 1 and memory is not None and memory.of(cfg.proposers).last_probe > \
                st.closed_at and drafting_gain(memory.of(cfg.proposers).survival_est, out[r], rows, table, load,
                                               samples, ctx) < 1.0 + cfg.gate_margin:
            # another row of this stream probed the drafter during this row's closed spell, and the shared estimate
            # (its result folded in) still does not pay here: one probe a spell for the stream, not one per request
            # (each pays a drafter pass and the backlog since its row last drafted); the row waits another spell
            st.skip_left, st.closed_at = st.backoff - 1, now
            st.probe = st.skip_left == 0
            out[r] = 0
        elif st.probe:  # drafts whatever the estimate says (no estimate yet: the drafter chose K = 0 → backoff)
            st.probe = False
            if st.backoff > 1:  # a probe after a closed spell re-measures a_1..a_probe_k, at a short verify's cost
                out[r] = min(out[r], cfg.probe_k)
                if memory is not None:
                    memory.of(cfg.proposers).last_probe = now
        elif drafting_gain(st.survival_est, out[r], rows, table, load, samples, ctx) >= (
                1.0 - cfg.gate_hysteresis if st.backoff == 1 else 1.0 + cfg.gate_margin):
            st.backoff = 1  # open: stays open until drafting clearly loses (acceptance comes in bursts)
        elif cfg.share_pass:
            deferred.append(r)  # does not pay alone: decided below, where rows may share one drafter pass
            continue
        else:
            _close(out, r, cfg, st, now)
        _remember(memory, cfg, st)
    for r in _share_the_pass(deferred, out, cfgs, states, table, load, sampled, contexts):
        _close(out, r, cfgs[r], states[r], now)
    for r in deferred:
        _remember(memory, cfgs[r], states[r])
    return out


def _close(out: list[int], r: int, cfg: PolicyConfig, st: PolicyState, now: int) -> None:
    """Leave row r undrafted for a spell of backoff − 1 more rounds, and double its next backoff."""
    out[r] = 0
    st.skip_left, st.closed_at = st.backoff - 1, now
    st.probe = st.skip_left == 0
    st.backoff = min(2 * st.backoff, cfg.max_backoff)


def _remember(memory: GateMemory | None, cfg: PolicyConfig, st: PolicyState) -> None:
    if memory is not None:  # the next request of this proposer set continues the row's gate
        mem = memory.of(cfg.proposers)
        mem.backoff, mem.skip_left, mem.probe, mem.closed_at = st.backoff, st.skip_left, st.probe, st.closed_at


def _share_the_pass(deferred: list[int], out: list[int], cfgs: Sequence[PolicyConfig],
                    states: Sequence[PolicyState], table: CostTable, load: RoundLoad,
                    sampled: Sequence[bool] | None, contexts: Sequence[int] | None) -> list[int]:
    """plan_drafting's rows whose drafting does not pay alone: open (backoff 1) the best-rated of them where they pay
    together (joint_drafting_gain: one pass, draft_t0 once) or, where the pass runs for other rows anyway, each
    that pays for its row of it (drafting_gain, pass_paid); → the rows to close."""
    rows, busy = len(out), set(deferred)

    def ctx(r: int) -> int | None:
        return contexts[r] if contexts is not None else None

    def smp(r: int) -> bool:
        return bool(sampled[r]) if sampled else False

    def bar(r: int) -> float:
        return 1.0 - cfgs[r].gate_hysteresis if states[r].backoff == 1 else 1.0 + cfgs[r].gate_margin

    opened: set[int] = set()
    runs = any(out[i] > 0 for i in range(rows) if i not in busy)
    if not runs and len(deferred) > 1:
        order = sorted(deferred, key=lambda r: -(states[r].survival_est[:1] or [0.0])[0])
        gains = prefix_drafting_gains([states[r].survival_est for r in order], [out[r] for r in order], rows, table,
                                      load, [smp(r) for r in order], [ctx(r) for r in order])
        best_n, best, need = 0, 0.0, bar(order[0])
        for n, g in enumerate(gains, start=1):
            need = max(need, bar(order[n - 1]))
            if n >= 2 and g >= need and g > best:
                best_n, best = n, g
        opened, runs = set(order[:best_n]), best_n > 0
    for r in deferred:
        if r not in opened and runs and drafting_gain(states[r].survival_est, out[r], rows, table, load, smp(r),
                                                      ctx(r), pass_paid=True) >= bar(r):
            opened.add(r)
    for r in opened:
        states[r].backoff = 1
    return [r for r in deferred if r not in opened]


_NO_DRAFT = torch.zeros(0)  # [0]: the survival of a row with nothing to verify


def schedule_batch(
    cfgs: Sequence[PolicyConfig],
    states: Sequence[PolicyState],
    caps: Sequence[int],  # per row: the most it may verify this round (γ, tokens left, cache room)
    conf: torch.Tensor | None,  # [B, γ'] drafter confidences for the drafted rows (None: no head / not drafted)
    table: CostTable,
    fixed_other_tokens: int = 0,
    load: RoundLoad = NO_PREFILL,  # the prompt tokens this round admits (spec_decode.costs)
    contexts: Sequence[int] | None = None,  # [B] the rows' cached tokens (CostTable.row_seconds)
) -> list[int]:
    """K for every row of one round: policy K (survival rows jointly, priced under the round's prefill `load`),
    capped by caps and the draft-side early stop. Rows in the same order as conf."""
    ks: list[int] = []
    surv_rows: list[int] = []
    surv_a: list[torch.Tensor] = []
    for r, (cfg, st, cap) in enumerate(zip(cfgs, states, caps)):
        cap = max(0, cap)
        if cfg.draft_stop > 0 and conf is not None and cap > 0:
            cap = min(cap, int(early_stop_k(conf[r:r + 1, :cap], cfg.draft_stop)[0]))
        if cfg.policy == "survival":
            cap = min(cap, cfg.max_k)
            a = (_NO_DRAFT if cap == 0  # an undrafted row (a closed gate): nothing to price
                 else survival(conf[r, :cap]) if conf is not None else fallback_survival(st.ema, cap))
            surv_rows.append(r)
            surv_a.append(a)
            ks.append(0)
        else:
            ks.append(min(cap, st.k))
    if surv_rows:
        other_rows = [r for r in range(len(ks)) if r not in set(surv_rows)]
        others = sum(1 + ks[r] for r in other_rows) + fixed_other_tokens
        other_tau = float(fixed_other_tokens)
        for r in other_rows:  # expected committed tokens of the non-survival rows
            a = survival(conf[r, :ks[r]]) if conf is not None else fallback_survival(states[r].ema, ks[r])
            other_tau += 1.0 + float(a.sum())
        ctx = None if contexts is None else [contexts[r] for r in surv_rows]
        other_s = 0.0 if contexts is None else sum(table.row_seconds(contexts[r], 1 + ks[r]) for r in other_rows)
        for r, kr in zip(surv_rows, plan_survival(surv_a, others, table, fixed_tau=other_tau, load=load,
                                                  contexts=ctx, fixed_seconds=other_s)):
            ks[r] = kr
    return ks
