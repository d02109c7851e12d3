"""What one round costs, for the survival K policy: the profiled target step by tokens in one pass (verify tokens,
and prefill tokens where they share the pass), the drafter's pass by drafted rows, and the round's prefill load.

Owns `CostTable` (the measured curve, runtime.profile.profile_costs; JSON in and out) and `RoundLoad` (the prompt
tokens a round admits and whether they ride in the same target pass as the verify tokens). Pure Python.

How prefill enters the K rule (spec_decode.scheduler.plan_survival, drafting_gain). Admitting one more verify token
(r, j) is worth it when its expected tokens a_j repay the time it adds at the rate the batch decodes:
    a_j ≥ Θ · Δ,   Θ = τ / T_dec  (the batch's decode rate: expected tokens over the decode's seconds so far,
                                   T_dec = step(n₀) for the anchors + the Δ of every token admitted before),
    Δ = step(P_f + n + 1) − step(P_f + n)  (the token's marginal cost in the pass it actually rides in),
with P_f = the round's prefill tokens when they share the verify pass (`RoundLoad.fused`: chunked prefill mixed
into the verify batch, as TensorRT-LLM's in-flight batching runs context and generation requests in one step), else
0. With P_f = 0, T_dec = step(n) and this is exactly the rule without prefill ("Θ = τ·SPS(n) does not drop"). A prefill in its own pass
(the reference runtime's and the GPU-host executor's admission today) is paid whatever K is, so it does not move K —
in particular it must not raise K, which comparing against the round's own rate τ / (prefill + step(n)) would do.
A fused prefill moves the verify tokens up the step curve: where the curve is steeper there (compute-bound: a
long prompt fills the pass), prefill-heavy rounds choose smaller K; on a flat (memory-bound) stretch the extra
tokens ride almost free. The table is profiled to a few hundred tokens in one pass so both regimes are measured
(and saturated batches, 32 rows × (1 + K) tokens, are priced from measurements, not from the 1..γ+1 slope).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark_trt.errors import InvalidArgumentError

__all__ = ["CostTable", "RoundLoad", "NO_PREFILL"]


@dataclass(frozen=True)
class RoundLoad:
    """The prompt tokens a round admits (prefill) and where they run: fused = in the same target pass as the
    round's verify tokens (chunked prefill in one batch), else a pass of their own before the round."""

    prefill_tokens: int = 0
    fused: bool = False

    def __post_init__(self) -> None:
        if self.prefill_tokens < 0:
            raise InvalidArgumentError(f"a round's prefill tokens must be ≥ 0, got {self.prefill_tokens}")

    @property
    def offset(self) -> int:
        """Tokens already in the verify pass before the first decode token (P_f)."""
        return self.prefill_tokens if self.fused else 0


NO_PREFILL = RoundLoad()


@dataclass(frozen=True)
class CostTable:
    """Target step time by tokens in one pass (Σ_r(1 + K_r), plus fused prefill tokens); SPS(n) = 1 / seconds(n).

    Piecewise linear between the profiled points, linear extrapolation past the last one (constant before
    the first). Load a profiled table from JSON: {"tokens": [1, 2, 4, ...], "seconds": [...]} or a linear model
    {"t0": s, "t1": s_per_token}."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    draft_t0: float = 0.0  # drafter pass seconds = draft_t0 + draft_t1 · drafted rows (0 rows: nothing)
    draft_t1: float = 0.0
    # + sampled_t1 · sampled drafted rows: what a sampled row's drafting costs over a greedy one's (the drafter's q
    # and draws, the acceptance of that q)
    sampled_t1: float = 0.0
    # The columns above are profiled with `context` tokens cached per row; a row with more pays its attention over
    # them: ctx_t0 a row + ctx_t1 each of its query tokens, per cached token beyond `context` (draft_ctx: its drafter
    # row, likewise). 0: context-blind (a table profiled at one context, or an old JSON).
    context: int = 0
    ctx_t0: float = 0.0
    ctx_t1: float = 0.0
    draft_ctx: float = 0.0

    def __post_init__(self) -> None:
        if min(self.draft_t0, self.draft_t1, self.sampled_t1) < 0 or not math.isfinite(
                self.draft_t0 + self.draft_t1 + self.sampled_t1):
            raise InvalidArgumentError("cost table 'draft' costs (t0, t1, sampled_t1) must be finite and ≥ 0")
        if self.context < 0 or min(self.ctx_t0, self.ctx_t1, self.draft_ctx) < 0 or not math.isfinite(
                self.ctx_t0 + self.ctx_t1 + self.draft_ctx):
            raise InvalidArgumentError("cost table 'context' costs (tokens, t0, t1, draft) must be finite and ≥ 0")
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise InvalidArgumentError("cost table needs equally long, non-empty 'tokens' and 'seconds' lists")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise InvalidArgumentError(f"cost table 'tokens' must be strictly increasing, got {self.tokens}")
        if any(s <= 0 or not math.isfinite(s) for s in self.seconds):
            raise InvalidArgumentError("cost table 'seconds' must be positive and finite")

    @classmethod
    def linear(cls, t0: float = 1.0, t1: float = 0.08, max_tokens: int = 1024, draft_t0: float = 0.2,
               draft_t1: float = 0.02) -> "CostTable":
        """Default model: one target step over n tokens costs t0 + t1·n (relative units; only ratios matter).
        t1/t0 = 0.08 is memory-bound decoding: verifying 8 extra tokens costs ~1.6× a plain step; a drafter pass
        costs about 0.2 of a step. Profiled tables (runtime.profile.profile_costs) replace these guesses."""
        return cls((1, max_tokens), (t0 + t1, t0 + t1 * max_tokens), draft_t0, draft_t1)

    @classmethod
    def from_json(cls, path: str | Path) -> "CostTable":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgumentError(f"cannot read cost table {path}: {exc}; pass a JSON file with "
                                       f'{{"tokens": [...], "seconds": [...]}} or {{"t0": .., "t1": ..}}') from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostTable":
        """The table `to_json` wrote (or the {"t0", "t1"} linear form), already parsed."""
        draft, ctx = data.get("draft", {}), data.get("context", {})
        d0, d1, ds = float(draft.get("t0", 0.0)), float(draft.get("t1", 0.0)), float(draft.get("sampled_t1", 0.0))
        context = {"context": int(ctx.get("tokens", 0)), "ctx_t0": float(ctx.get("t0", 0.0)),
                   "ctx_t1": float(ctx.get("t1", 0.0)), "draft_ctx": float(ctx.get("draft", 0.0))}
        if "t0" in data:
            return replace(cls.linear(float(data["t0"]), float(data["t1"]), int(data.get("max_tokens", 1024)), d0,
                                      d1), sampled_t1=ds, **context)
        return cls(tuple(int(t) for t in data["tokens"]), tuple(float(s) for s in data["seconds"]), d0, d1, ds,
                   **context)

    def to_json(self) -> dict[str, object]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds),
                "draft": {"t0": self.draft_t0, "t1": self.draft_t1, "sampled_t1": self.sampled_t1},
                "context": {"tokens": self.context, "t0": self.ctx_t0, "t1": self.ctx_t1, "draft": self.draft_ctx}}

    def _beyond(self, context: int | None) -> int:
        return max(0, int(context) - self.context) if context is not None else 0

    def row_seconds(self, context: int | None, tokens: int = 1) -> float:
        """What a row with `context` cached tokens and `tokens` query tokens adds to a target pass beyond the step
        column (its attention over the tokens cached past the profiled context); None: nothing (context unknown)."""
        return self._beyond(context) * (self.ctx_t0 + self.ctx_t1 * tokens)

    def token_seconds(self, context: int | None) -> float:
        """What one more verify token of a row with `context` cached tokens adds beyond the step column."""
        return self._beyond(context) * self.ctx_t1

    def draft_row_seconds(self, context: int | None) -> float:
        """What drafting a row with `context` cached tokens adds beyond draft_t1 (its block's attention)."""
        return self._beyond(context) * self.draft_ctx

    def draft_seconds(self, rows: int, sampled: int = 0) -> float:
        """One drafter pass over `rows` rows, `sampled` of them sampling (0 rows: nothing)."""
        return self.draft_t0 + self.draft_t1 * rows + self.sampled_t1 * sampled if rows > 0 else 0.0

    def step_seconds(self, n: int) -> float:
        ts, ss = self.tokens, self.seconds
        if n <= ts[0] or len(ts) == 1:
            return ss[0] if n <= ts[0] else ss[0] * n / ts[0]
        for i in range(1, len(ts)):
            if n <= ts[i]:
                break
        lo, hi = i - 1, i  # interpolate (or extrapolate past the end with the last segment)
        return ss[lo] + (ss[hi] - ss[lo]) * (n - ts[lo]) / (ts[hi] - ts[lo])

    def sps(self, n: int) -> float:
        return 1.0 / self.step_seconds(n)

    def marginal_seconds(self, n: int, load: RoundLoad = NO_PREFILL) -> float:
        """What the (n+1)-th decode token of a round adds to it: step(P_f + n + 1) − step(P_f + n)."""
        p = load.offset
        return self.step_seconds(p + n + 1) - self.step_seconds(p + n)

    def round_seconds(self, n: int, load: RoundLoad = NO_PREFILL, drafted_rows: int = 0) -> float:
        """The whole round: its prefill (in the verify pass when fused, else a pass of its own), the drafter's pass
        over the drafted rows, and the target pass over n verify tokens."""
        p = load.prefill_tokens
        target = self.step_seconds(p + n) if load.fused else self.step_seconds(n) + (self.step_seconds(p) if p else 0.0)
        return target + self.draft_seconds(drafted_rows)
