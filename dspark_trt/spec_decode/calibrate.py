"""The cost table and the drafter's confidences, corrected online from the loop's own rounds.

Owns `OnlineCosts`: the spec_decode.costs.CostTable the K rule and the proposer choice read in each round of
spec_decode.loop.RoundScheduler, refitted from the times of the rounds the loop has run. The profiled table
(runtime.profile.profile_costs) times each pass alone, hot, once, at start; in the loop a pass also pays the
acceptance and the commit per verify token, runs on caches the other passes just evicted, a lazy drafter first
projects the context it skipped, and a VM's speed drifts after the profile (on a 2-core Zen 3 VM, whole drafted
rounds at two concurrent requests took 1.29–1.54× their table price in one profile's run, 1.03–1.05× in another's).
And a GPU host's scheduler starts from the relative default table: only its rounds can price it.

Model, per round (n = verify tokens Σ_r(1 + K_r)), three parts timed apart by the loop:
    verify (target pass, acceptance, commit):  T_v ≈ θ_s·S + θ_n·n,
        S = step(n) + Σ_r row_seconds(context_r, 1 + K_r)   (the table's target pass);
    drafter pass (rounds that drafted):         T_d ≈ θ_d·D + θ_q·F,
        D = draft(rows, sampled) + Σ_drafted draft_row_seconds(context_r)   (the table's drafter pass),
        F = the context tokens it projected before its block (DraftOutcome.flushed: a lazy drafter's backlog, the
            tokens committed since the row last drafted — a probe after a closed spell or a new 1,024-token prompt
            flushes them all at once);
    the rest of the round (proposals, choosing, the loop's bookkeeping): its mean o per round.
Each part is its own least-squares fit over the rounds seen (exponentially forgotten: `window` rounds), shrunk
toward the table's shape at the measured verify scale g = ΣT_v / ΣS — (g, 0) and (g, 0) — with the weight of
`prior_rounds` rounds per feature but S, so a feature not exercised (no drafted round yet, an executor that does not
report its backlog) keeps the profiled price. Timing the parts apart matters: fitted to whole rounds, what a round
spends outside its passes (a suffix lookup, a backlog flush) lands on whichever decision variable it correlates
with — in a served mix of chats and code contexts the drafter read 3.9× its price and verify tokens dearer than
they are. The corrected table: seconds θ_s·s + θ_n·tokens + o per profiled point, the drafter's columns × θ_d, the
context columns of the target pass × θ_s; θ_q is reported, not priced (a backlog is paid once and the rules price a
row's steady-state pass). Only ratios of costs move the rule's choices, so g alone changes none.

Rounds whose prompt tokens share the verify pass (a fused prefill) are not folded: their pass holds tokens the
features do not. The loop times its rounds (time.perf_counter) and calls `observe`.

Also owns `OnlineAcceptance` (the drafter's c_j corrected per position by what the verifier accepted) and
`Calibration`, the pair a RoundScheduler keeps. Pure Python + torch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.costs import CostTable

log = logging.getLogger(__name__)


__all__ = ["Calibration", "CalibrationConfig", "OnlineCosts", "OnlineAcceptance", "box_solve"]


@dataclass(frozen=True)
class CalibrationConfig:
    """How fast the table follows the loop's rounds."""

    window: float = 200.0  # rounds: each round's weight decays by 1 − 1/window per later round
    prior_rounds: float = 0.25  # the profiled shape of the token and drafter prices weighs like this many rounds
    min_rounds: int = 16  # the profiled table is used as is until this many rounds are folded
    refresh: int = 4  # the corrected table is rebuilt every this many folded rounds (two 2×2 solves: ~20 µs)
    bounds: tuple[float, float] = (0.05, 50.0)  # θ_s and θ_d stay within these multiples of g

    def __post_init__(self) -> None:
        lo, hi = self.bounds
        if self.window < 1 or self.prior_rounds <= 0 or self.min_rounds < 0 or self.refresh < 1 or not 0 < lo < 1 < hi:
            raise InvalidArgumentError(f"calibration needs window ≥ 1, prior_rounds > 0, min_rounds ≥ 0, refresh ≥ 1 "
                                       f"and bounds 0 < lo < 1 < hi, got {self}")


def box_solve(a: Sequence[Sequence[float]], b: Sequence[float], lo: Sequence[float],
              hi: Sequence[float]) -> list[float]:
    """The minimiser of ½·xᵀa·x − bᵀx (a symmetric positive-definite: the normal equations a·x = b) within the box
    lo ≤ x ≤ hi: solve, fix the variable furthest outside its box at the bound, solve for the rest, repeat."""
    n = len(b)
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        x = [fixed.get(i, 0.0) for i in range(n)]
        if free:
            sub = torch.linalg.solve(  # [F] (float64: the normal equations of second-scale times square)
                torch.tensor([[a[i][j] for j in free] for i in free], dtype=torch.float64),
                torch.tensor([b[i] - sum(a[i][j] * v for j, v in fixed.items()) for i in free], dtype=torch.float64))
            for i, v in zip(free, sub.tolist()):
                x[i] = v
        out = [(max(lo[i] - x[i], x[i] - hi[i]), i) for i in free if not lo[i] <= x[i] <= hi[i]]
        if not out:
            return x
        _, i = max(out)
        fixed[i] = min(max(x[i], lo[i]), hi[i])


class _Fit:
    """Exponentially forgotten least squares T ≈ θ·x (few features), solved with a ridge prior within a box."""

    def __init__(self, features: int) -> None:
        self.w = 0.0  # Σ decayed weights
        self.xx = [[0.0] * features for _ in range(features)]  # Σ w·x xᵀ
        self.xt = [0.0] * features  # Σ w·x·T
        self.t = 0.0  # Σ w·T

    def add(self, x: Sequence[float], t: float, decay: float) -> None:
        self.fade(decay)
        self.w += 1.0
        self.t += t
        for i, xi in enumerate(x):
            self.xt[i] += xi * t
            for j, xj in enumerate(x):
                self.xx[i][j] += xi * xj

    def fade(self, decay: float) -> None:
        """One round passed without a sample: what was seen weighs less (the prior takes over in time)."""
        self.w *= decay
        self.t *= decay
        self.xt = [v * decay for v in self.xt]
        self.xx = [[v * decay for v in row] for row in self.xx]

    def solve(self, prior: Sequence[float], weight: Sequence[float], unit: Sequence[float], lo: Sequence[float],
              hi: Sequence[float]) -> list[float]:
        """θ: the prior counts weight[i] rounds of feature i at its mean square (unit[i]² where never seen)."""
        m = len(prior)
        sq = [self.xx[i][i] / self.w if self.w > 0 and self.xx[i][i] > 0 else unit[i] ** 2 for i in range(m)]
        a = [[self.xx[i][j] + (weight[i] * sq[i] if i == j else 0.0) for j in range(m)] for i in range(m)]
        return box_solve(a, [self.xt[i] + weight[i] * sq[i] * prior[i] for i in range(m)], lo, hi)


class OnlineCosts:
    """The profiled `base` table, refitted from timed rounds (module doc); `table` is what a round prices with.

    One per stream of rounds (a RoundScheduler's, or shared by the schedulers of one engine like GateMemory)."""

    def __init__(self, base: CostTable, config: CalibrationConfig = CalibrationConfig()) -> None:
        self.base = base
        self.config = config
        self.table = base
        self.rounds = 0  # rounds folded
        self.theta = (1.0, 0.0, 1.0, 0.0)  # (θ_s, θ_n, θ_d, θ_q) of the current table (seconds per table unit; θ_n
        # per verify token, θ_q per flushed token)
        self.overhead = 0.0  # o: seconds of a round outside its passes, in the current table
        self.scale = 1.0  # g of the current table
        self.fitted = False  # `table` is a refit (else the profiled table as is)
        self._verify, self._draft = _Fit(2), _Fit(2)
        self._s = 0.0  # Σ w·S (the verify scale g = ΣT_v / ΣS)
        self._rest = 0.0  # Σ w·(T − T_v − T_d)
        self._w = 0.0

    def features(self, ks: Sequence[int], contexts: Sequence[int] | None, drafted: Sequence[int] = (),
                 sampled: int = 0, flushed: int = 0) -> tuple[float, float, float, float]:
        """(S, n, D, F) of a round whose rows verified ks (contexts: their cached tokens; drafted: the indices of the
        rows the drafter ran for, `sampled` of them sampling; flushed: the backlog of context tokens its pass projected
        first) under the profiled table."""
        b = self.base
        ctx = list(contexts) if contexts is not None else [None] * len(ks)
        n = sum(1 + k for k in ks)
        s = b.step_seconds(n) + sum(b.row_seconds(c, 1 + k) for c, k in zip(ctx, ks))
        d = (b.draft_seconds(len(drafted), sampled) + sum(b.draft_row_seconds(ctx[i]) for i in drafted)
             if drafted else 0.0)
        return s, float(n), d, float(flushed if drafted else 0)

    def observe(self, verify_seconds: float, ks: Sequence[int], contexts: Sequence[int] | None = None,
                drafted: Sequence[int] = (), sampled: int = 0, flushed: int = 0, draft_seconds: float = 0.0,
                round_seconds: float | None = None) -> None:
        """Fold one round: its verify took verify_seconds, its drafter pass draft_seconds (the rows `drafted`), the
        whole round round_seconds (None: the two passes alone); the other arguments as in `features`. Refits every
        `refresh` rounds. Once fitted, a part the VM stalled moves its fit by at most 3× its fitted price."""
        if not ks or not verify_seconds > 0.0:
            return
        s, n, d, f = self.features(ks, contexts, drafted, sampled, flushed)
        rest = 0.0 if round_seconds is None else max(0.0, round_seconds - verify_seconds - draft_seconds)
        th = self.theta
        if self.fitted:  # (against the fit's own price: the profile may be far off, and then it must move freely)
            verify_seconds = _clip(verify_seconds, th[0] * s + th[1] * n)
            rest = _clip(rest, self.overhead) if self.overhead > 0 else rest
        drafted_fit = self._draft.w >= self.config.min_rounds / 4  # its own fit has seen a few drafted rounds
        decay = 1.0 - 1.0 / self.config.window
        self._verify.add((s, n), verify_seconds, decay)
        self._s = self._s * decay + s
        if drafted and draft_seconds > 0:
            if self.fitted and drafted_fit:
                draft_seconds = _clip(draft_seconds, th[2] * d + th[3] * f)
            self._draft.add((d, f), draft_seconds, decay)
        else:  # an undrafted round: the drafter's last prices fade toward the profile's, so a closed gate probes
            self._draft.fade(decay)  # again one day (and one stalled drafted round cannot close it for good)
        self._rest = self._rest * decay + rest
        self._w = self._w * decay + 1.0
        self.rounds += 1
        if self.rounds >= self.config.min_rounds and self.rounds % self.config.refresh == 0:
            self.refit()

    def refit(self) -> None:
        """Solve the two fits and rebuild `table` (module doc)."""
        if self._s <= 0.0 or self._verify.t <= 0.0:
            return
        g = self._verify.t / self._s  # seconds per table unit of the target pass, the table's shape taken as is
        lo, hi = self.config.bounds
        one = self.base.step_seconds(1) * g
        pr = self.config.prior_rounds
        try:  # θ_s, θ_d within [lo, hi]·g; a verify token and a flushed one ≥ 0 and never dearer than a step
            th_s, th_n = self._verify.solve((g, 0.0), (0.0, pr), (1.0, 1.0), (lo * g, 0.0), (hi * g, one))
            th_d, th_q = self._draft.solve((g, 0.0), (pr, pr), (self.base.draft_seconds(1) or 1.0, 1.0),
                                           (lo * g, 0.0), (hi * g, one))
        except torch.linalg.LinAlgError:  # singular (cannot happen with the priors): keep the table
            return
        first, self.fitted = not self.fitted, True
        self.theta, self.scale = (th_s, th_n, th_d, th_q), g
        self.overhead = self._rest / self._w if self._w > 0 else 0.0
        b, o = self.base, self.overhead
        self.table = replace(b, seconds=tuple(th_s * s + th_n * t + o for s, t in zip(b.seconds, b.tokens)),
                             draft_t0=th_d * b.draft_t0, draft_t1=th_d * b.draft_t1, sampled_t1=th_d * b.sampled_t1,
                             ctx_t0=th_s * b.ctx_t0, ctx_t1=th_s * b.ctx_t1, draft_ctx=th_d * b.draft_ctx)
        (log.info if first else log.debug)("cost table calibrated from %d rounds: %s", self.rounds, self.summary())

    def summary(self) -> dict[str, float]:
        """The fit relative to the profiled table: rounds folded, scale g, and per table unit of g the target pass
        θ_s/g, a verify token θ_n/g (as a fraction of a profiled one-token step), the drafter pass θ_d/g, the rest of a
        round o (same fraction); the drafter's backlog in ms per 1,000 flushed context tokens."""
        g = self.scale
        th_s, th_n, th_d, th_q = self.theta
        one = self.base.step_seconds(1)
        return {"rounds": float(self.rounds), "scale": g, "target": th_s / g, "token": th_n / g / one,
                "drafter": th_d / g, "overhead": self.overhead / g / one, "flush_ms_per_1k": th_q * 1e6}


def _clip(seconds: float, price: float) -> float:
    """A stalled part (the VM descheduled, a cold page storm) counts at most 3× (at least a third of) its price."""
    return min(max(seconds, price / 3.0), 3.0 * price) if price > 0 else seconds


class OnlineAcceptance:
    """The drafter's confidences c_j corrected per position by what the verifier accepted (greedy rows).

    The head's c_j is a conditional: P(d_j accepted | d_1..d_{j−1} accepted), calibrated on the drafter's training
    data. On other text it runs high: measured in process on held-out prompts (Zen 3, two concurrent requests, the
    rounds the survival rule verified), predicted survival a_1..a_3 0.59 / 0.38 / 0.33 against 0.54 / 0.31 / 0.24
    realised — so the rule verified tokens that did not pay. Per position j the ratio r_j = Σ accepted / Σ c_j over
    the verified positions whose predecessors were all accepted (exponentially forgotten after `window` of them,
    shrunk toward 1 by `prior` positions), and `correct` returns min(c_j · r_j, 0.999) (positions never reached take
    the deepest observed ratio). Selection is by design: the ratio is measured where the rule verifies, which is where
    it decides. Sampled rows neither teach nor take the correction (their acceptance is min(1, p/q), not the head's
    greedy event)."""

    def __init__(self, window: float = 500.0, prior: float = 20.0, min_observed: int = 32) -> None:
        if window < 1 or prior < 0 or min_observed < 0:
            raise InvalidArgumentError(f"need window ≥ 1, prior ≥ 0 and min_observed ≥ 0, got {window}, {prior}, "
                                       f"{min_observed}")
        self.window, self.prior, self.min_observed = window, prior, min_observed
        self._pred: list[float] = []  # per position: Σ c_j (decayed)
        self._hit: list[float] = []  # Σ [d_j accepted]
        self._n: list[float] = []  # Σ 1
        self.observed = 0  # rows folded

    def ratios(self, positions: int) -> list[float]:
        """r_1..r_positions (1.0 before min_observed rows)."""
        if self.observed < self.min_observed or not self._n:
            return [1.0] * positions
        out = []
        for j in range(positions):
            i = min(j, len(self._n) - 1)
            mean_c = self._pred[i] / self._n[i] if self._n[i] > 0 else 1.0
            out.append((self._hit[i] + self.prior * mean_c) / (self._pred[i] + self.prior * mean_c))
        return out

    def correct(self, conf: torch.Tensor, greedy: Sequence[bool] | None = None) -> torch.Tensor:
        """conf [R, γ'] → the corrected [R, γ'] (rows with greedy[r] False unchanged)."""
        if self.observed < self.min_observed or conf.numel() == 0:
            return conf
        r = torch.tensor(self.ratios(conf.shape[1]), dtype=conf.dtype)  # [γ']
        out = (conf * r).clamp(0.0, 0.999)  # [R, γ']
        if greedy is not None and not all(greedy):
            keep = torch.tensor([bool(g) for g in greedy]).unsqueeze(1)  # [R, 1]
            out = torch.where(keep, out, conf)
        return out

    def observe(self, conf: Sequence[float], k: int, accepted: int) -> None:
        """Fold one greedy row that verified k drafts with raw confidences conf[:k] and accepted `accepted`."""
        if k < 1:
            return
        self.observed += 1
        decay = 1.0 - 1.0 / self.window
        for j in range(min(k, accepted + 1)):  # positions reached: every earlier draft accepted
            if j == len(self._n):
                self._pred.append(0.0)
                self._hit.append(0.0)
                self._n.append(0.0)
            self._pred[j] = self._pred[j] * decay + float(conf[j])
            self._hit[j] = self._hit[j] * decay + (1.0 if accepted > j else 0.0)
            self._n[j] = self._n[j] * decay + 1.0


class Calibration:
    """What one stream of rounds learns about its machine and its drafter: the round costs (OnlineCosts over the
    profiled `table`) and the drafter's acceptance (OnlineAcceptance). One per RoundScheduler, or shared by the
    schedulers of one engine or server like scheduler.GateMemory."""

    def __init__(self, table: CostTable, config: CalibrationConfig = CalibrationConfig()) -> None:
        self.costs = OnlineCosts(table, config)
        self.acceptance = OnlineAcceptance()

    @property
    def table(self) -> CostTable:
        return self.costs.table

    def summary(self) -> dict[str, float]:
        """The costs' fit (OnlineCosts.summary) and the acceptance ratios r_1..r_3."""
        out = dict(self.costs.summary())
        out.update({f"r{j + 1}": r for j, r in enumerate(self.acceptance.ratios(3))})
        return out
