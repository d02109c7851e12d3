"""The in-flight batching worker without a server, on the tiny build's real backend: concurrent jobs get their
own outputs from shared rounds (and their finish_reason), cancellation and a `stop` request free the slot through
the one cancellation path, overload turns speculation off, a failing drafter falls back with identical output.
(The same paths run through Triton in the other files of this directory.)"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import pytest

from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.validate import GenerationParams
from dspark_trt.serve.worker import InflightBatcher, Job, serving_backend
from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler

from .conftest import GAMMA, MAX_SEQ_LEN


@dataclass
class Sink:
    """Collects what the worker sends (stands in for the python backend's response sender)."""

    cancel_after: int | None = None
    ids: list[int] = field(default_factory=list)
    responses: int = 0
    stats: dict | None = None
    finish_reason: str | None = None
    err: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, new_ids: Sequence[int], context_ids: Sequence[int], final: bool, stats: dict | None,
             finish_reason: str | None = None) -> None:
        self.ids.extend(new_ids)
        self.responses += 1
        if final:
            self.stats = stats
            self.finish_reason = finish_reason
            self.done.set()

    def error(self, message: str) -> None:
        self.err = message
        self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and self.responses >= self.cancel_after


def _batcher(reference, max_queue: int = 64, faults: str = "") -> tuple[InflightBatcher, ServeMetrics]:  # noqa: ANN001
    from dspark_trt.runtime.backend import SpecBackend

    pair = reference.pair
    metrics = ServeMetrics(None, gamma=GAMMA)
    backend = serving_backend(SpecBackend(pair.target, pair.drafter, max_batch=4, max_seq=MAX_SEQ_LEN), metrics, faults)
    return InflightBatcher(RoundScheduler(backend, LoopConfig(gamma=GAMMA)), metrics, max_queue), metrics


def _job(reference, prompt: str, n: int, sink: Sink, policy: str = "fixed", stream: bool = True) -> Job:  # noqa: ANN001
    params = GenerationParams(max_tokens=n, stream=stream, policy=policy, min_k=1, max_k=GAMMA, return_stats=True)
    return Job(tuple(reference.ids(prompt)), params, sink, reference.eos)


PROMPTS = ["def main(argv):", "class Queue:", "for i in range(10):", "raise ValueError(", "while True:", "print("]


def test_jobs_share_rounds_and_get_their_own_tokens(reference) -> None:  # noqa: ANN001
    batcher, metrics = _batcher(reference)
    sinks = [Sink() for _ in PROMPTS]
    for i, (p, s) in enumerate(zip(PROMPTS, sinks)):  # 6 jobs, 4 slots: two wait for a free slot
        batcher.submit(_job(reference, p, 10 + 3 * i, s, policy=("fixed", "confidence", "survival")[i % 3]))
    batcher.start()
    for s in sinks:
        assert s.done.wait(300)
    batcher.stop()
    for i, s in enumerate(sinks):
        assert s.err is None and s.ids == reference(PROMPTS[i], 10 + 3 * i)
        assert s.finish_reason in ("eos", "length", "stop") and s.finish_reason == s.stats["finish_reason"]
    assert max(s.stats["batch"]["max"] for s in sinks) == 4
    assert metrics.counters["dspark_fallback_total"] == 0
    # the loop's online calibration (spec_decode.calibrate) is published: gauges start at 0, its values are > 0
    assert batcher.scheduler.calibration is not None and batcher.scheduler.calibration.costs.rounds > 0
    for name in ("dspark_calibrated_target_price", "dspark_calibrated_drafter_price",
                 "dspark_drafter_confidence_ratio"):
        assert metrics.gauges[name] > 0, name


def test_cancel_frees_slot(reference, monkeypatch) -> None:  # noqa: ANN001
    # the loop asks for cancellations every CANCEL_POLL_S; the tiny model can finish 200 tokens (~90 ms on a fast
    # CPU) before the first poll, which made this test depend on the machine's speed: poll every round here
    from dspark_trt.serve import worker

    monkeypatch.setattr(worker, "CANCEL_POLL_S", 0.0)
    batcher, metrics = _batcher(reference)
    sink = Sink(cancel_after=1)
    batcher.submit(_job(reference, PROMPTS[0], 200, sink, policy="plain"))
    batcher.start()
    assert sink.done.wait(300)
    later = Sink()
    batcher.submit(_job(reference, PROMPTS[1], 5, later))
    assert later.done.wait(300)
    batcher.stop()
    assert sink.err and "cancel" in sink.err and len(sink.ids) < 200
    assert metrics.counters["dspark_cancelled_total"] == 1
    assert batcher.scheduler.active == 0 and len(batcher.scheduler._free) == 4  # noqa: SLF001 - slot back


def test_stop_request_takes_the_cancellation_path(reference) -> None:  # noqa: ANN001
    """tensorrtllm_backend's `stop`: the running request ends with the tokens so far and finish_reason "stopped",
    counted and its slot freed as a cancelled one; the stop request gets its own empty final response."""
    batcher, metrics = _batcher(reference, faults="slow:20")  # a 200-token answer then takes seconds
    sink, stopper = Sink(), Sink()
    job = _job(reference, PROMPTS[0], 200, sink, policy="plain")
    job.key = "victim"
    batcher.submit(job)
    batcher.start()
    deadline = time.monotonic() + 300
    while sink.responses == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    batcher.request_stop("victim", stopper)
    assert sink.done.wait(300) and stopper.done.wait(300)
    batcher.stop()
    assert sink.err is None and sink.finish_reason == "stopped" and sink.stats["finish_reason"] == "stopped"
    assert 0 < len(sink.ids) < 200 and sink.ids == reference(PROMPTS[0], 200)[:len(sink.ids)]
    assert stopper.err is None and stopper.ids == [] and stopper.responses == 1
    assert metrics.counters["dspark_cancelled_total"] == 1
    assert batcher.scheduler.active == 0 and len(batcher.scheduler._free) == 4  # noqa: SLF001 - slot back


def test_overload_and_drafter_failure(reference) -> None:  # noqa: ANN001
    batcher, metrics = _batcher(reference, max_queue=2, faults="draft:2")
    sinks = [Sink() for _ in range(5)]
    for i, s in enumerate(sinks):
        batcher.submit(_job(reference, PROMPTS[i], 12, s))
    batcher.start()
    for s in sinks:
        assert s.done.wait(300)
    alone = Sink()
    batcher.submit(_job(reference, PROMPTS[5], 12, alone, stream=False))
    assert alone.done.wait(300)
    batcher.stop()
    for i, s in enumerate(sinks):
        assert s.ids == reference(PROMPTS[i], 12)
    assert max(s.stats["speculation_off_rounds"] for s in sinks) > 0
    assert alone.ids == reference(PROMPTS[5], 12) and alone.responses == 1
    assert alone.stats["speculation_off_rounds"] == 0
    assert metrics.counters["dspark_speculation_off_rounds_total"] > 0
    # the injected failures hit the first drafted rounds once the queue fell to ≤ 2 (or the lone request)
    assert metrics.counters["dspark_fallback_total"] == 2
    assert sum(s.stats["draft_failures"] for s in sinks + [alone]) >= 2


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_max_tokens(reference, n: int) -> None:  # noqa: ANN001
    batcher, _ = _batcher(reference)
    sink = Sink()
    batcher.submit(_job(reference, PROMPTS[2], n, sink))
    batcher.start()
    assert sink.done.wait(300)
    batcher.stop()
    assert sink.ids == reference(PROMPTS[2], n)


def test_failed_round_answers_errors_and_keeps_serving(reference) -> None:  # noqa: ANN001
    batcher, metrics = _batcher(reference, faults="verify:1")
    sinks = [Sink(), Sink()]
    for p, s in zip(PROMPTS, sinks):
        batcher.submit(_job(reference, p, 8, s))
    batcher.start()
    for s in sinks:
        assert s.done.wait(300)
    after = Sink()
    batcher.submit(_job(reference, PROMPTS[2], 8, after))
    assert after.done.wait(300)
    batcher.stop()
    assert all(s.err and "injected verify failure" in s.err for s in sinks)
    assert after.err is None and after.ids == reference(PROMPTS[2], 8)
    assert metrics.counters["dspark_errors_total"] == 2 and batcher.scheduler.active == 0
