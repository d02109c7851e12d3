"""Speculative-decoding statistics: the per-round log, the totals derived from it, and pass timing.

Owns RoundRecord (k, accepted and confidence of every round, so each K decision can be inspected), SpecStats
(per request or aggregated): target/draft calls, drafted/accepted/committed tokens, τ, acceptance per position, first-token
rejection rate, drafter fallbacks; and TimedBackend, the one wall-clock timer of draft / verify passes (used by
the Python API's .stats, the serving metrics and the drafter evaluation). Pure bookkeeping; knows nothing of
models or serving.

Definitions:
- τ = committed tokens / target forwards, bonus included; the prefill forward and the token it commits count
  (so plain decoding has τ = 1 exactly).
- acceptance rate α = accepted / drafted-and-verified (Σ accepted / Σ k).
- acceptance_per_position[j-1] = #rounds with accepted ≥ j / #rounds with k ≥ j (the survival curve).
- first-token rejection rate = #rounds with k ≥ 1 and accepted = 0 / #rounds with k ≥ 1.
- per proposer ("dspark", "suffix": `by_proposer`, "proposers" in the summary): the same counts over the rounds
  whose verified tokens that proposer supplied, plus `proposed_tokens`: every token it offered (in each round it
  proposed in, chosen or not; DSpark: the tokens drafted), so proposed ≥ drafted (verified) ≥ accepted.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

__all__ = ["ProposerStats", "RoundRecord", "SpecStats", "TimedBackend"]


@dataclass(frozen=True)
class RoundRecord:
    k: int  # tokens verified
    accepted: int  # of those, accepted
    conf: float  # confidence-formula value after the round
    committed: int  # tokens committed (accepted + 1, fewer if a stop condition cut the round)
    fallback: bool = False  # the drafter failed; the round ran as plain decoding (or on the suffix proposal)
    proposer: str = "dspark"  # who proposed the verified tokens: "dspark" | "suffix" | "none" (k = 0)
    offered: tuple[tuple[str, int], ...] = ()  # (proposer, tokens it proposed this round) for each that proposed
    source: str = ""  # a suffix round's source: "own" | "cross" | "corpus" (spec_decode.suffix); "" otherwise

    def as_dict(self) -> dict[str, float | int | str | None]:
        conf = round(self.conf, 4) if math.isfinite(self.conf) else None
        return {"k": self.k, "accepted": self.accepted, "conf": conf, "proposer": self.proposer}


@dataclass
class ProposerStats:
    """One proposer's share of a request's (or many requests') rounds: tokens it offered, rounds it was verified in,
    tokens verified, accepted (= committed draft tokens it supplied) and acceptance per position α_j."""

    rounds: int = 0
    proposed_tokens: int = 0  # Σ tokens offered in every round it proposed in (chosen or not)
    drafted_tokens: int = 0  # Σ k of its rounds
    accepted_tokens: int = 0
    pos_verified: list[int] = field(default_factory=list)  # [j-1]: its rounds with k ≥ j
    pos_accepted: list[int] = field(default_factory=list)  # [j-1]: its rounds with accepted ≥ j

    def count(self, k: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted_tokens += k
        self.accepted_tokens += accepted
        _count_positions(self.pos_verified, self.pos_accepted, k, accepted)

    def add(self, other: "ProposerStats") -> None:
        self.rounds += other.rounds
        self.proposed_tokens += other.proposed_tokens
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        _add_positions(self.pos_verified, self.pos_accepted, other.pos_verified, other.pos_accepted)

    def summary(self) -> dict[str, object]:
        return {"rounds": self.rounds, "proposed_tokens": self.proposed_tokens, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.accepted_tokens / self.drafted_tokens, 4) if self.drafted_tokens else 0.0,
                "acceptance_per_position": [round(a / v, 4) for a, v in zip(self.pos_accepted, self.pos_verified)]}


def _count_positions(verified: list[int], accepted_at: list[int], k: int, accepted: int) -> None:
    while len(verified) < k:
        verified.append(0)
        accepted_at.append(0)
    for j in range(k):
        verified[j] += 1
        accepted_at[j] += int(accepted > j)


def _add_positions(verified: list[int], accepted_at: list[int], v2: list[int], a2: list[int]) -> None:
    for j, (v, a) in enumerate(zip(v2, a2)):
        while len(verified) <= j:
            verified.append(0)
            accepted_at.append(0)
        verified[j] += v
        accepted_at[j] += a


@dataclass
class SpecStats:
    """Counters for one request (or, via `merge`, for many)."""

    rounds: list[RoundRecord] = field(default_factory=list)
    prefill_calls: int = 0
    verify_calls: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0  # draft tokens verified by the target (Σ k)
    proposed_tokens: int = 0  # draft tokens the drafter produced (≥ drafted; early stop / K cut the rest)
    accepted_tokens: int = 0
    committed_tokens: int = 0  # generated tokens (prefill's first token included)
    draft_failures: int = 0
    pos_verified: list[int] = field(default_factory=list)  # [j-1]: rounds with k ≥ j
    pos_accepted: list[int] = field(default_factory=list)  # [j-1]: rounds with accepted ≥ j
    keep_rounds: bool = True  # False for long-lived aggregates (servers): counters only, no per-round log
    by_proposer: dict[str, ProposerStats] = field(default_factory=dict)  # rounds with k ≥ 1, by RoundRecord.proposer;
    # a proposer that only offered tokens (never chosen) has an entry with rounds 0
    suffix_sources: dict[str, list[int]] = field(default_factory=dict)  # suffix rounds with k ≥ 1 by source:
    # [rounds, accepted tokens]

    def record_round(self, rec: RoundRecord, drafted: bool, proposed: int) -> None:
        if self.keep_rounds:
            self.rounds.append(rec)
        _count_positions(self.pos_verified, self.pos_accepted, rec.k, rec.accepted)
        if rec.k > 0:
            self.by_proposer.setdefault(rec.proposer, ProposerStats()).count(rec.k, rec.accepted)
            if rec.source:
                acc = self.suffix_sources.setdefault(rec.source, [0, 0])
                acc[0] += 1
                acc[1] += rec.accepted
        for name, n in rec.offered:
            if n > 0:
                self.by_proposer.setdefault(name, ProposerStats()).proposed_tokens += n
        self.verify_calls += 1
        self.draft_calls += int(drafted)
        self.proposed_tokens += proposed
        self.drafted_tokens += rec.k
        self.accepted_tokens += rec.accepted
        self.committed_tokens += rec.committed
        self.draft_failures += int(rec.fallback)

    @property
    def target_calls(self) -> int:
        return self.prefill_calls + self.verify_calls

    @property
    def tau(self) -> float:
        return self.committed_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def acceptance_per_position(self) -> list[float]:
        return [a / v for a, v in zip(self.pos_accepted, self.pos_verified)]

    @property
    def first_token_rejection_rate(self) -> float:
        if not self.pos_verified:
            return 0.0
        return 1.0 - self.pos_accepted[0] / self.pos_verified[0]

    def merge(self, others: Iterable["SpecStats"], keep_rounds: bool = True) -> "SpecStats":
        """A new SpecStats holding self + others (round logs concatenated unless keep_rounds is False)."""
        out = SpecStats(keep_rounds=keep_rounds)
        for s in (self, *others):
            if keep_rounds:
                out.rounds.extend(s.rounds)
            _add_positions(out.pos_verified, out.pos_accepted, s.pos_verified, s.pos_accepted)
            for name, ps in s.by_proposer.items():
                out.by_proposer.setdefault(name, ProposerStats()).add(ps)
            for src, (r, a) in s.suffix_sources.items():
                acc = out.suffix_sources.setdefault(src, [0, 0])
                acc[0] += r
                acc[1] += a
            for name in ("prefill_calls", "verify_calls", "draft_calls", "drafted_tokens", "proposed_tokens",
                         "accepted_tokens", "committed_tokens", "draft_failures"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
        return out

    def summary(self, with_rounds: bool = True) -> dict[str, object]:
        """The JSON shape of `dspark-trt generate --json`'s "stats" (plus a few derived fields)."""
        out: dict[str, object] = {
            "target_calls": self.target_calls, "draft_calls": self.draft_calls,
            "accepted_tokens": self.accepted_tokens, "drafted_tokens": self.drafted_tokens,
            "committed_tokens": self.committed_tokens, "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position()],
            "first_token_rejection_rate": round(self.first_token_rejection_rate, 4),
            "draft_failures": self.draft_failures,
            "proposers": {name: ps.summary() for name, ps in sorted(self.by_proposer.items())},
        }
        if self.suffix_sources:  # where the verified suffix proposals came from: own tokens, recent outputs, corpus
            out["suffix_sources"] = {src: {"rounds": r, "accepted_tokens": a}
                                     for src, (r, a) in sorted(self.suffix_sources.items())}
        if with_rounds:
            out["rounds"] = [r.as_dict() for r in self.rounds]
        return out


class TimedBackend:
    """A spec_decode.protocols.Backend proxy that times every draft and verify pass (wall clock).

    Everything else passes through unchanged. `seconds[name]` / `calls[name]` accumulate per pass name
    ("draft", "verify"), failed passes included; `observe(name, seconds, error)` — when given — is called after
    each pass with the exception it raised (or None), then the exception propagates (the loop turns a drafter
    failure into a plain round)."""

    TIMED = ("draft", "verify")

    def __init__(self, inner: Any, observe: Callable[[str, float, BaseException | None], None] | None = None) -> None:
        self._inner = inner
        self._observe = observe
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.reset()

    def __getattr__(self, name: str) -> Any:  # vocab_size, max_batch, max_seq, prefill, accept, commit, ...
        return getattr(self._inner, name)

    def reset(self) -> None:
        """Zero the counters."""
        self.seconds = {n: 0.0 for n in self.TIMED}
        self.calls = {n: 0 for n in self.TIMED}

    def mean_ms(self, name: str) -> float:
        """Mean wall time of one `name` pass in milliseconds (0 before the first)."""
        return 1000.0 * self.seconds[name] / max(1, self.calls[name])

    def _timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            dt = time.perf_counter() - t0
            self.seconds[name] += dt
            self.calls[name] += 1
            if self._observe is not None:
                self._observe(name, dt, error)

    def draft(self, *args: Any, **kwargs: Any) -> Any:
        """backend.draft(...) → DraftBlock (tokens [B, γ]), timed."""
        return self._timed("draft", self._inner.draft, *args, **kwargs)

    def verify(self, *args: Any, **kwargs: Any) -> Any:
        """backend.verify(...) → logits [B, K+1, V], timed."""
        return self._timed("verify", self._inner.verify, *args, **kwargs)
