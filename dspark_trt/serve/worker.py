"""In-flight batching worker of the `dspark` Triton model: one central round loop for every active request.

Mechanism (chosen by measuring the alternatives with 16 streaming clients on tritonserver 2.51): the decoupled
`dspark` model's execute() only validates a request and hands it, with its response sender, to this worker; a
single background thread runs spec_decode.loop.RoundScheduler — admit waiting requests (batched prefill) → ONE
batched draft pass → K per request → ONE batched target verify pass → accept → commit — and streams each
request's committed tokens after every round. Requests join and leave between rounds. The draft and target
models execute in process, next to their KV caches: a central loop with in-process models gave the largest
batches (12.4 of ideal ≈ 13) and the lowest latency in that measurement; calling the `draft`/`target` Triton
models by BLS once per round batched just as well (12.6) but added two round trips and tensor copies per round
and would split the KV caches from the loop that rolls them back. Per-request BLS broke batches up (2–4.5).
On a GPU host (model_repo_trtllm/) the same RoundScheduler — the same admission, caps, K policies, stops,
cancellation and stats — drives the TensorRT-LLM engines instead: serve.gpu_host.rounds.TrtllmRoundScheduler is
the RoundScheduler over a TrtllmExecutor, whose prefill / draft / verify steps are BLS requests to the
tensorrtllm `target` and `draft` models (one per row, each step's sent at once), and this worker drives it
unchanged.

Owns: Job / ResponseSink (what execute() hands over), `to_loop_request` (a validated request → the loop's
Request), `latency_observer` (draft/verify latency and drafter-failure counts into ServeMetrics, for either
executor), `serving_backend` (the backend wrapped with spec_decode.stats.TimedBackend reporting to that observer,
plus optional fault injection for tests), InflightBatcher (which turns RoundScheduler.speculate off while the queue
is deeper than MAX_QUEUE; a request proposes with its own `proposers` field, else the server's, DSPARK_PROPOSERS;
the counters per proposer go to ServeMetrics.proposer_done). Knows nothing of
pb_utils: the stub passes a ResponseSink and a ServeMetrics.

Cancellation: one path. Every way a client ends a running request early goes through `InflightBatcher._cancel`,
on the round thread of the `dspark` stub, which calls `RoundScheduler.cancel` (freeing the request's KV slot in
the target and the drafter), counts it (`dspark_cancelled_total`, `dspark_active_requests`) and answers the
request once. What triggers it:
- a `stop=true` request with the running request's id (tensorrtllm_backend's `stop` input; through either
  ensemble, or `dspark` directly: serve.clients.client.stop_remote, DsparkAioClient.stop) → DsparkModel.execute →
  `request_stop` → (next loop turn) `_cancel(job, STOPPED)`: a final response with the tokens so far,
  finish_reason "stopped";
- Triton request cancellation (the client closed its gRPC stream to `dspark` or went away, e.g. the OpenAI
  frontend's disconnects and stop strings) and a response sender that failed → `ResponseSink.is_cancelled()`,
  polled every CANCEL_POLL_S → `_cancel(job, CANCELLED)`: an error response "request cancelled by the client".
Triton 2.51 does not pass a client's cancel into an ensemble's running `dspark` step; there, `stop` is the way.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from dspark_trt.errors import DrafterError, InvalidArgumentError, RequestError
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.text import CONTEXT_TOKENS
from dspark_trt.serve.validate import GenerationParams
from dspark_trt.spec_decode.loop import Request, RoundEvent, RoundScheduler
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.policies import default_proposers, parse_proposers
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.spec_decode.stats import TimedBackend

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1  # how often the loop asks Triton whether its requests were cancelled
PROPOSERS_ENV = "DSPARK_PROPOSERS"  # the server's proposers for every speculating request ("dspark", "suffix",
# "dspark,suffix"; spec_decode.proposers); unset: spec_decode.policies.default_proposers per request
FAULT_ENV = "DSPARK_SERVE_FAULTS"  # "draft" / "verify": every such pass raises; "draft:N": the first N do; "slow:MS":
# every verify pass takes MS ms longer (tests that need a request to stay in flight)
STOPPED, CANCELLED = "stopped", "cancelled"  # why _cancel ended a request (STOPPED is its finish_reason)


class ResponseSink(Protocol):
    """Where one request's responses go (the python backend's response sender, wrapped). finish_reason is set on
    the final response only: the loop's "eos" | "length" | "stop", or "stopped" (a `stop` request ended it)."""

    def send(self, new_ids: Sequence[int], context_ids: Sequence[int], final: bool,
             stats: dict[str, object] | None, finish_reason: str | None = None) -> None: ...

    def error(self, message: str) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class Job:
    """One validated request on its way through the round loop."""

    prompt_ids: tuple[int, ...]
    params: GenerationParams
    sink: ResponseSink
    eos_ids: tuple[int, ...] = ()
    key: str = ""  # the Triton request id; a `stop` request with the same id ends this job
    rid: int = -1
    tokens: list[int] = field(default_factory=list)  # generated so far
    sent: int = 0  # tokens already streamed
    n_rounds_seen: int = 0  # len(stats.rounds) at the previous event
    batch_sizes: list[int] = field(default_factory=list)
    spec_off_rounds: int = 0
    allowed: tuple[str, ...] = ()  # who may propose its drafts, once admitted (() under the plain policy / "none")
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None


class FaultyBackend:
    """A Backend proxy that makes draft / verify passes raise, per DSPARK_SERVE_FAULTS (tests of the fallbacks):
    "draft" / "verify" → every such pass fails, "draft:N" → the first N do, "slow:MS" → verify passes sleep MS ms."""

    def __init__(self, inner: Any, faults: str) -> None:
        self._inner = inner
        self._faults = {"draft": 0, "verify": 0}  # passes still to fail (−1: all)
        self._slow_s = 0.0
        for f in (f.strip() for f in faults.split(",") if f.strip()):
            name, _, count = f.partition(":")
            if name == "slow":
                self._slow_s = float(count or 0) / 1000.0
            elif name in self._faults:
                self._faults[name] = int(count) if count else -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _inject(self, name: str) -> None:
        if self._faults[name] != 0:
            self._faults[name] -= 1 if self._faults[name] > 0 else 0
            err = DrafterError if name == "draft" else RuntimeError
            raise err(f"injected {name} failure ({FAULT_ENV})")

    def draft(self, *args: Any, **kwargs: Any) -> Any:
        self._inject("draft")
        return self._inner.draft(*args, **kwargs)

    def verify(self, *args: Any, **kwargs: Any) -> Any:
        self._inject("verify")
        if self._slow_s:
            time.sleep(self._slow_s)
        return self._inner.verify(*args, **kwargs)


def policy_config(params: GenerationParams, proposers: tuple[str, ...] | None = None) -> PolicyConfig:
    """The loop's PolicyConfig for a request (fixed verifies max_k every round): the request's own proposers
    (params.proposers, its `proposers` field; "none" came as () with policy "plain", serve.validate), else
    `proposers`, the server's, else (None) spec_decode.policies.default_proposers for this request."""
    if params.proposers:
        proposers = params.proposers
    elif proposers is None:
        proposers = default_proposers(params.temperature, params.seed)
    return PolicyConfig(policy=params.policy, k=params.max_k, min_k=params.min_k, max_k=params.max_k,
                        proposers=proposers)


def proposers_from_env() -> tuple[str, ...] | None:
    """The server's proposers from DSPARK_PROPOSERS (unset: None, each request gets
    spec_decode.policies.default_proposers); InvalidArgumentError naming the valid names for
    another value (the stub then fails to load, with that message in the server log)."""
    raw = os.environ.get(PROPOSERS_ENV, "").strip()
    if not raw:
        return None
    try:
        names = parse_proposers(raw)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{PROPOSERS_ENV}={raw!r}: {exc}; fix the environment of `dspark-trt serve` "
                                   f"(e.g. {PROPOSERS_ENV}=dspark,suffix) or unset it") from exc
    log.info("%s=%s: every speculating request proposes with %s", PROPOSERS_ENV, raw, ",".join(names))
    return names


def to_loop_request(prompt_ids: tuple[int, ...], params: GenerationParams, eos_ids: tuple[int, ...],
                    proposers: tuple[str, ...] | None = None) -> Request:
    """A request validated by serve.validate → spec_decode.loop.Request (end_id, when given, replaces the model's eos
    ids). Validation already happened at the entry point; a failure here is answered as a RequestError anyway."""
    eos = (params.end_id,) if params.end_id is not None else tuple(eos_ids)
    try:
        return Request(prompt_ids=tuple(int(t) for t in prompt_ids), max_new_tokens=params.max_tokens,
                       sampling=SamplingParams(params.temperature, params.top_p, params.seed),
                       policy=policy_config(params, proposers), eos_ids=eos, stop_sequences=params.stop_sequences)
    except InvalidArgumentError as exc:
        raise RequestError(str(exc)) from exc


def latency_observer(metrics: ServeMetrics) -> Callable[[str, float, BaseException | None], None]:
    """observe(name, seconds, error) after each "draft" / "verify" pass: the latency histograms, and a drafter failure
    counts as a fallback (the loop runs that round as plain decoding)."""

    def observe(name: str, seconds: float, error: BaseException | None) -> None:
        metrics.observe(f"dspark_{name}_latency_seconds", seconds)
        if name == "draft" and error is not None:
            metrics.inc("dspark_fallback_total")

    return observe


def serving_backend(inner: Any, metrics: ServeMetrics, faults: str = "") -> TimedBackend:
    """The backend the round loop drives when serving: timed into latency_observer, optional injected faults."""
    return TimedBackend(FaultyBackend(inner, faults) if faults else inner, latency_observer(metrics))


def _count_proposers(acc: dict[str, list[int]], records: Sequence[Any]) -> None:
    """Add rounds (spec_decode.stats.RoundRecord) into name → [offered, verified (Σ K), accepted, rounds]."""
    for r in records:
        for name, n in r.offered:
            acc.setdefault(name, [0, 0, 0, 0])[0] += n
        if r.k > 0:
            row = acc.setdefault(r.proposer, [0, 0, 0, 0])
            row[1] += r.k
            row[2] += r.accepted
            row[3] += 1


def _stats_payload(job: Job, ev: RoundEvent | None) -> dict[str, object]:
    out: dict[str, object] = dict(ev.stats.summary(with_rounds=True)) if ev is not None else {}
    out["k_per_round"] = [r["k"] for r in out.get("rounds", [])]  # type: ignore[union-attr]
    out["finish_reason"] = ev.finish_reason if ev is not None else None
    bs = job.batch_sizes or [0]
    out["batch"] = {"mean": round(sum(bs) / len(bs), 3), "max": max(bs), "rounds": len(job.batch_sizes)}
    out["batch_per_round"] = list(job.batch_sizes)  # rows in each of its rounds, aligned with k_per_round
    out["speculation_off_rounds"] = job.spec_off_rounds
    out["proposers_allowed"] = list(job.allowed)  # its field, else the server's default; [] = none (plain)
    out["time_to_first_token_ms"] = round(1e3 * ((job.t_first or time.monotonic()) - job.t_submit), 2)
    out["latency_ms"] = round(1e3 * (time.monotonic() - job.t_submit), 2)
    return out


class InflightBatcher:
    """The central round loop: submit() from any thread; one worker thread runs the rounds."""

    def __init__(self, scheduler: RoundScheduler, metrics: ServeMetrics, max_queue: int,
                 proposers: tuple[str, ...] | None = None) -> None:
        self.scheduler = scheduler
        self.proposers = None if proposers is None else parse_proposers(proposers)
        self.metrics = metrics
        self.max_queue = max_queue
        self._incoming: deque[Job] = deque()
        self._stops: deque[tuple[str, Any]] = deque()  # (request id, sink of the stop request)
        self._jobs: dict[int, Job] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._last_cancel_poll = 0.0
        self._thread = threading.Thread(target=self._run, name="dspark-rounds", daemon=True)

    def start(self) -> "InflightBatcher":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                job.sink.error("the dspark model is shutting down; retry on another server")
                return
            self._incoming.append(job)
            self._cond.notify()

    def request_stop(self, key: str, sink: ResponseSink) -> None:
        """End the in-flight request whose Triton request id is `key` before the next round (tensorrtllm_backend's
        `stop` input; it then ends in _cancel, as a cancelled request does). Needed because Triton 2.51 checks an
        ensemble's cancellation only between ensemble steps, so a client's gRPC cancel never reaches the
        long-running `dspark` step of the ensemble."""
        with self._cond:
            self._stops.append((key, sink))
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current round; every unfinished request gets an error response."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        for job in list(self._jobs.values()) + list(self._incoming):
            job.sink.error("the dspark model was unloaded before this request finished; retry")
        self._jobs.clear()
        self._incoming.clear()

    # ---- loop -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                idle = not (self._incoming or self._jobs or self._stops)
            if idle:
                self.metrics.flush()  # (outside the lock: submit() must not wait on it) Triton's metrics now exact
            with self._cond:
                while not self._stopping and not self._incoming and not self._jobs and not self._stops:
                    self._cond.wait()
                if self._stopping:
                    return
                incoming = list(self._incoming)
                self._incoming.clear()
                stops = list(self._stops)
                self._stops.clear()
            try:
                for job in incoming:
                    self._admit(job)
                if incoming:  # an arrival shows in the active gauge at once, not at the next periodic flush
                    self.metrics.set("dspark_active_requests", self.scheduler.active)
                    self.metrics.flush()
                for key, sink in stops:
                    self._stop_job(key, sink)
                self._drop_cancelled(force=bool(incoming or stops))
                if self._jobs:
                    self._round()
                self.metrics.flush_if_due()
            except Exception as exc:  # noqa: BLE001 - a failed round must not kill the loop (or the server)
                self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        """Answer every request in the loop with an error, free their slots, keep serving."""
        log.exception("round loop failed; answering its %d request(s) with errors", len(self._jobs))
        for rid, job in list(self._jobs.items()):
            try:
                self.scheduler.cancel(rid)
            except Exception:  # noqa: BLE001 - the slot state is already suspect; keep answering the rest
                log.exception("cancelling request %d failed", rid)
            job.sink.error(f"generation failed in the round loop ({type(exc).__name__}: {exc}); retry, and report "
                           "it with the server log if it persists")
            self.metrics.inc("dspark_errors_total")
        self._jobs.clear()
        self.metrics.set("dspark_active_requests", self.scheduler.active)

    def _admit(self, job: Job) -> None:
        try:
            req = to_loop_request(job.prompt_ids, job.params, job.eos_ids, self.proposers)
            job.allowed = tuple(p for p in req.policy.proposers if req.policy.uses(p))
            job.rid = self.scheduler.add(req)
        except Exception as exc:  # noqa: BLE001 - InvalidArgumentError/RequestError carry the fix
            job.sink.error(str(exc))
            self.metrics.inc("dspark_errors_total")
            return
        self._jobs[job.rid] = job

    def _stop_job(self, key: str, sink: ResponseSink) -> None:
        """A `stop` request: end the running request(s) with id `key`, then answer the stop request itself."""
        found = [job for job in self._jobs.values() if key and job.key == key]
        if not found:
            sink.error(f"stop: no in-flight request with id {key!r}; send stop=true with the id of a running "
                       "request")
            return
        for job in found:
            self._cancel(job, STOPPED)
        sink.send([], [], True, None)

    def _drop_cancelled(self, force: bool = False) -> None:
        """End the requests whose client cancelled (or whose sender broke). sender.is_cancelled() is a round trip
        to the server per request, so it is asked every CANCEL_POLL_S (and whenever requests came or went), not
        every round."""
        now = time.monotonic()
        if not self._jobs or (not force and now - self._last_cancel_poll < CANCEL_POLL_S):
            return
        self._last_cancel_poll = now
        for job in list(self._jobs.values()):
            if job.sink.is_cancelled():
                self._cancel(job, CANCELLED)

    def _cancel(self, job: Job, why: str) -> None:
        """The one cancellation path: RoundScheduler.cancel (frees the KV slot, target and drafter), the metrics,
        one answer — STOPPED: a final response with the tokens so far (finish_reason "stopped"); CANCELLED: an
        error response (the client is gone, or will read it as the end of a cancelled call)."""
        self._jobs.pop(job.rid, None)
        self.scheduler.cancel(job.rid)
        self.metrics.inc("dspark_cancelled_total")
        self.metrics.set("dspark_active_requests", self.scheduler.active)
        self.metrics.flush()
        log.info("request %d (id %s) %s after %d tokens; KV slot freed", job.rid, job.key or "-",
                 "stopped" if why == STOPPED else "cancelled by the client", len(job.tokens))
        if why != STOPPED:
            job.sink.error("request cancelled by the client")
            return
        stats = _stats_payload(job, None) if job.params.return_stats else None
        if stats is not None:
            stats["finish_reason"] = STOPPED
        start = job.sent if job.params.stream else 0
        job.sink.send(job.tokens[start:], job.tokens[max(0, start - CONTEXT_TOKENS):start] if start else [], True,
                      stats, STOPPED)

    def _round(self) -> None:
        depth = self.scheduler.pending
        speculate = depth <= self.max_queue
        if speculate != self.scheduler.speculate:
            log.warning("queue depth %d %s MAX_QUEUE %d: speculation %s", depth, ">" if not speculate else "≤",
                        self.max_queue, "off" if not speculate else "back on")
        self.scheduler.speculate = speculate
        # admitted requests' first tokens go out before the round runs (TTFT does not wait for a drafter pass)
        self._handle(self.scheduler.step(on_admit=lambda evs: self._handle(evs, depth, speculate)), depth, speculate)

    def _handle(self, events: list[RoundEvent], depth: int, speculate: bool) -> None:
        """Account one batch of events (the step's admissions, or its round) in the job stats and metrics, then send
        them."""
        batch = len(events)
        ks: list[int] = []
        accepted = committed = prefilled = prefill_tokens = finished = 0
        ready: list[tuple[Job, RoundEvent]] = []
        by_proposer: dict[str, list[int]] = {}  # name → [offered, verified, accepted, rounds] in this step
        for ev in events:
            job = self._jobs.get(ev.request_id)
            if job is None:
                continue
            new_records = ev.stats.rounds[job.n_rounds_seen:]
            job.n_rounds_seen = len(ev.stats.rounds)
            round_tokens = sum(r.committed for r in new_records)
            if new_records:
                ks.extend(r.k for r in new_records)
                _count_proposers(by_proposer, new_records)
                accepted += sum(r.accepted for r in new_records)
                committed += round_tokens
                job.batch_sizes.append(batch)
                job.spec_off_rounds += int(not speculate)
            if len(ev.new_tokens) > round_tokens:  # the prefill's first token
                prefilled += 1
                prefill_tokens += len(ev.new_tokens) - round_tokens
            finished += int(ev.finished)
            ready.append((job, ev))
        self.metrics.set("dspark_queue_depth", depth)
        self.metrics.set("dspark_active_requests", self.scheduler.active)
        cal = self.scheduler.calibration
        if cal is not None and cal.costs.rounds % cal.costs.config.refresh == 0:  # (it refits every `refresh`)
            fit = cal.summary()
            for gauge, key in (("target", "target"), ("drafter", "drafter"), ("token", "token")):
                self.metrics.set(f"dspark_calibrated_{gauge}_price", fit[key])
            self.metrics.set("dspark_drafter_confidence_ratio", fit["r1"])
        if ks:
            self.metrics.round_done(len(ks), ks, accepted, committed, speculate)
        for name, (offered, verified, acc, rounds) in by_proposer.items():
            self.metrics.proposer_done(name, offered, verified, acc, rounds)
        if prefilled:
            self.metrics.prefill_done(prefilled, prefill_tokens)
        if finished:
            self.metrics.inc("dspark_requests_total", finished)
            self.metrics.flush()  # before the final responses: a client holding its answer reads current metrics
        for job, ev in ready:
            self._deliver(job, ev)

    def _deliver(self, job: Job, ev: RoundEvent) -> None:
        try:
            self._send(job, ev)
        except Exception:  # noqa: BLE001 - one client's broken stream must not fail the batch
            log.exception("sending to request %d failed; dropping it", job.rid)
            if self._jobs.pop(job.rid, None) is not None:
                self.scheduler.cancel(job.rid)

    def _send(self, job: Job, ev: RoundEvent) -> None:
        if ev.new_tokens and job.t_first is None:
            job.t_first = time.monotonic()
        job.tokens.extend(ev.new_tokens)
        if ev.finished:
            self._jobs.pop(job.rid, None)
            stats = _stats_payload(job, ev) if job.params.return_stats else None
            if job.params.stream:
                job.sink.send(job.tokens[job.sent:], job.tokens[max(0, job.sent - CONTEXT_TOKENS):job.sent], True,
                              stats, ev.finish_reason)
            else:
                job.sink.send(job.tokens, [], True, stats, ev.finish_reason)
            job.sent = len(job.tokens)
        elif job.params.stream and len(job.tokens) > job.sent:
            job.sink.send(job.tokens[job.sent:], job.tokens[max(0, job.sent - CONTEXT_TOKENS):job.sent], False, None)
            job.sent = len(job.tokens)


def faults_from_env() -> str:
    """Fault injection for tests of the fallback path (never set in production)."""
    faults = os.environ.get(FAULT_ENV, "")
    if faults:
        log.warning("%s=%s: injecting faults", FAULT_ENV, faults)
    return faults
