"""Serving metrics on Triton's metrics port (pb_utils.MetricFamily), with an in-memory twin for tests.

Owns the metric names and what feeds them: acceptance rate and τ (running gauges), the cost table's and the
drafter's online calibration (gauges), the K histogram, round batch size, fallback / cancelled / speculation-off
counters, draft and verify latency histograms, active requests and queue depth, and the counters per proposer
(PROPOSER_COUNTERS, label proposer = "dspark" | "suffix": tokens each offered, verified and accepted, rounds it
supplied; summed over proposers the verified and accepted ones equal dspark_drafted_tokens_total and
dspark_accepted_tokens_total). `ServeMetrics(pb_utils)` inside the `dspark` model;
`ServeMetrics(None)` records into plain dicts (a labelled counter under `labelled(name, proposer)`, the series
name as Prometheus writes it without the model label: name{proposer="suffix"}).

Every update lands in the in-memory twin at once; what goes to Triton is queued and sent by `flush()`. Each
pb_utils metric call is a blocking round trip to the server process (0.05–0.2 ms measured here), and the round
loop made 6–20 of them per round, so the in-flight batching worker flushes between rounds instead: when a
request finishes (before its final response, so a client that has its answer reads up-to-date metrics), when
the loop goes idle, and at least every FLUSH_INTERVAL_S while it is busy.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from dspark_trt.spec_decode.policies import PROPOSERS  # torch-free

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
FLUSH_INTERVAL_S = 0.5  # most time queued updates wait while the round loop is busy

COUNTERS = {
    "dspark_rounds_total": "Batched speculative rounds run (one draft pass + one verify pass each)",
    "dspark_requests_total": "Requests finished (any reason)",
    "dspark_drafted_tokens_total": "Draft tokens verified by the target (sum of K)",
    "dspark_accepted_tokens_total": "Draft tokens accepted",
    "dspark_committed_tokens_total": "Tokens committed (generated)",
    "dspark_target_calls_total": "Per-request target forwards (prefill + verify)",
    "dspark_fallback_total": "Rounds where the drafter failed and the round ran as plain decoding",
    "dspark_cancelled_total": "Requests cancelled by the client (KV slots freed)",
    "dspark_speculation_off_rounds_total": "Rounds run without speculation because the queue exceeded MAX_QUEUE",
    "dspark_errors_total": "Requests answered with an error",
}
# Labelled {model, proposer}, one series per name in spec_decode.policies.PROPOSERS (zero until it proposes).
PROPOSER_COUNTERS = {
    "dspark_proposed_tokens_total": "Draft tokens each proposer offered (every round it proposed in, chosen or not; "
                                    "DSpark: tokens drafted)",
    "dspark_proposer_drafted_tokens_total": "Draft tokens of each proposer verified by the target (sum of K of the "
                                            "rounds it supplied)",
    "dspark_proposer_accepted_tokens_total": "Draft tokens of each proposer accepted",
    "dspark_proposer_rounds_total": "Per-request rounds whose verified drafts each proposer supplied",
}


def labelled(name: str, proposer: str) -> str:
    """The in-memory key of one labelled series: name{proposer="..."}."""
    return f'{name}{{proposer="{proposer}"}}'


GAUGES = {
    "dspark_acceptance_rate": "Running acceptance rate: accepted / drafted tokens",
    "dspark_tau": "Running tau: committed tokens per target forward",
    "dspark_active_requests": "Requests holding a KV slot",
    "dspark_queue_depth": "Requests waiting or active in the round loop",
    # what the round loop learned from its own rounds (spec_decode.calibrate; 1 / 0 / 1 before its first refit)
    "dspark_calibrated_target_price": "A target pass as the calibrated cost table prices it, x its profiled price "
                                      "(relative to the measured scale)",
    "dspark_calibrated_drafter_price": "A drafter pass as the calibrated cost table prices it, x its profiled price "
                                       "(relative to the measured scale)",
    "dspark_calibrated_token_price": "What a verify token adds to a round beyond the profiled step curve, as a "
                                     "fraction of a one-token step",
    "dspark_drafter_confidence_ratio": "Accepted / predicted at draft position 1: the factor on the drafter's c_1",
}
HISTOGRAMS = {
    "dspark_k": ("Verify length K chosen per request per round", None),
    "dspark_round_batch_size": ("Requests served by one batched round", BATCH_BUCKETS),
    "dspark_draft_latency_seconds": ("Wall time of one batched draft pass", LATENCY_BUCKETS),
    "dspark_verify_latency_seconds": ("Wall time of one batched target verify pass", LATENCY_BUCKETS),
}


@dataclass
class ServeMetrics:
    """Thread-safe metric sink; `pb` is the triton_python_backend_utils module or None (in-memory only)."""

    pb: Any = None
    gamma: int = 8
    model: str = "dspark"
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    observations: dict[str, list[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _families: list[Any] = field(default_factory=list, repr=False)
    _metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    _pending_inc: dict[str, float] = field(default_factory=dict, repr=False)
    _pending_set: dict[str, float] = field(default_factory=dict, repr=False)
    _pending_obs: list[tuple[str, float]] = field(default_factory=list, repr=False)
    _last_flush: float = field(default_factory=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.counters[name] = 0.0
        for name in PROPOSER_COUNTERS:
            for prop in PROPOSERS:
                self.counters[labelled(name, prop)] = 0.0
        for name in GAUGES:
            self.gauges[name] = 0.0
        for name in HISTOGRAMS:
            self.observations[name] = []
        if self.pb is None:
            return
        labels = {"model": self.model}
        fam = self.pb.MetricFamily
        for name, desc in COUNTERS.items():
            f = fam(name=name, description=desc, kind=fam.COUNTER)
            self._families.append(f)
            self._metrics[name] = f.Metric(labels=labels)
        for name, desc in PROPOSER_COUNTERS.items():
            f = fam(name=name, description=desc, kind=fam.COUNTER)
            self._families.append(f)
            for prop in PROPOSERS:
                self._metrics[labelled(name, prop)] = f.Metric(labels={**labels, "proposer": prop})
        for name, desc in GAUGES.items():
            f = fam(name=name, description=desc, kind=fam.GAUGE)
            self._families.append(f)
            self._metrics[name] = f.Metric(labels=labels)
        for name, (desc, buckets) in HISTOGRAMS.items():
            f = fam(name=name, description=desc, kind=fam.HISTOGRAM)
            self._families.append(f)
            b = buckets if buckets is not None else [float(k) for k in range(self.gamma + 1)]
            self._metrics[name] = f.Metric(labels=labels, buckets=[float(x) for x in b])

    def inc(self, name: str, value: float = 1.0) -> None:
        if value <= 0:
            return
        with self._lock:
            self.counters[name] += value
            if name in self._metrics:
                self._pending_inc[name] = self._pending_inc.get(name, 0.0) + float(value)

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = float(value)
            if name in self._metrics:
                self._pending_set[name] = float(value)

    def observe(self, name: str, values: Sequence[float] | float) -> None:
        vals = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
        with self._lock:
            self.observations[name].extend(vals)
            if len(self.observations[name]) > 10_000:  # keep the in-memory twin bounded
                del self.observations[name][:5_000]
            if name in self._metrics:
                self._pending_obs.extend((name, v) for v in vals)

    def flush(self) -> None:
        """Send the queued updates to Triton (one pb_utils call per changed counter / gauge and per observation)."""
        with self._lock:
            self._last_flush = time.monotonic()
            incs, sets, obs = self._pending_inc, self._pending_set, self._pending_obs
            if not (incs or sets or obs):
                return
            self._pending_inc, self._pending_set, self._pending_obs = {}, {}, []
            try:
                for name, value in incs.items():
                    self._metrics[name].increment(value)
                for name, value in sets.items():
                    self._metrics[name].set(value)
                for name, value in obs:
                    self._metrics[name].observe(value)
            except Exception:  # noqa: BLE001 - metrics must never fail a request; the twin keeps the truth
                log.exception("sending metrics to Triton failed; %d update(s) dropped",
                              len(incs) + len(sets) + len(obs))

    def flush_if_due(self, interval: float = FLUSH_INTERVAL_S) -> None:
        if time.monotonic() - self._last_flush >= interval:
            self.flush()

    def round_done(self, batch: int, ks: Sequence[int], accepted: int, committed: int, speculate: bool) -> None:
        """One batched round: batch size, every request's K, tokens accepted/committed."""
        self.inc("dspark_rounds_total")
        self.observe("dspark_round_batch_size", batch)
        self.observe("dspark_k", list(ks))
        self.inc("dspark_drafted_tokens_total", sum(ks))
        self.inc("dspark_accepted_tokens_total", accepted)
        self.inc("dspark_committed_tokens_total", committed)
        self.inc("dspark_target_calls_total", len(ks))
        if not speculate:
            self.inc("dspark_speculation_off_rounds_total")
        self._running_ratios()

    def proposer_done(self, proposer: str, proposed: int, drafted: int, accepted: int, rounds: int) -> None:
        """One proposer's share of a batched round (or several): tokens it offered, verified (Σ K) and accepted, and
        the per-request rounds it supplied. An unknown proposer name is ignored (logged)."""
        if labelled("dspark_proposed_tokens_total", proposer) not in self.counters:
            log.warning("metrics: unknown proposer %r ignored", proposer)
            return
        values = (proposed, drafted, accepted, rounds)
        for name, value in zip(PROPOSER_COUNTERS, values):  # the order PROPOSER_COUNTERS lists them in
            self.inc(labelled(name, proposer), value)

    def prefill_done(self, n_requests: int, committed: int) -> None:
        self.inc("dspark_target_calls_total", n_requests)
        self.inc("dspark_committed_tokens_total", committed)
        self._running_ratios()

    def _running_ratios(self) -> None:
        c = self.counters
        if c["dspark_drafted_tokens_total"] > 0:
            self.set("dspark_acceptance_rate", c["dspark_accepted_tokens_total"] / c["dspark_drafted_tokens_total"])
        if c["dspark_target_calls_total"] > 0:
            self.set("dspark_tau", c["dspark_committed_tokens_total"] / c["dspark_target_calls_total"])

    def close(self) -> None:
        """Drop Metric objects before their families (the python backend requires this order)."""
        self.flush()
        with self._lock:
            self._metrics.clear()
            self._families.clear()
