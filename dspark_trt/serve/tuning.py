"""Torch intra-op threads of the `dspark` model's stub, chosen by measurement at startup unless set.

Owns `THREADS_ENV` (DSPARK_THREADS: "auto" or a positive integer; `dspark-trt serve --threads` sets it),
`parse_threads`, `measure_threads` (the decode-step time of the loaded backend at each candidate thread count,
interleaved, median), `apply_threads` (what DsparkModel.initialize calls before anything else runs on the
backend) and `on_fresh_thread` (where the stub's startup compute runs: see its docstring). Why measure: on a quiet
2-core host two threads decode SmolLM2 ~1.3× faster than one, while on the same host shared with busy jobs two
threads were 3× slower (OpenMP workers waiting for a descheduled peer) — no fixed default is right on both. No
pb_utils here; torch is imported lazily.
"""
from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from dspark_trt.errors import InvalidArgumentError

log = logging.getLogger(__name__)

THREADS_ENV = "DSPARK_THREADS"
AUTO = "auto"
T = TypeVar("T")


def available_cpus() -> int:
    """CPUs this process may run on (affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def parse_threads(raw: str | None) -> int | None:
    """DSPARK_THREADS → a thread count, or None for "auto" (unset, empty, "auto", "0")."""
    value = (raw or "").strip().lower()
    if value in ("", AUTO, "0"):
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgumentError(f"{THREADS_ENV}={raw!r} is not a thread count: use a positive integer or 'auto' "
                         "(dspark-trt serve --threads N|auto)")
    return n


def candidates(cpus: int) -> tuple[int, ...]:
    """Thread counts worth timing: 1, half the CPUs, all of them (deduplicated, ascending)."""
    return tuple(sorted({1, max(1, cpus // 2), cpus}))


def measure_threads(backend: Any, counts: Sequence[int], reps: int = 5, rows: int = 1) -> dict[int, float]:
    """Median seconds of one batched decode step (`rows` requests, 1 token each, 32 tokens cached) per thread count,
    the counts interleaved rep by rep so a change of machine load hits all of them alike. `backend` is a
    runtime.backend.SpecBackend; the slots used are freed again."""
    import torch  # noqa: PLC0415

    rows = max(1, min(rows, int(backend.max_batch)))
    slots = list(range(rows))
    vocab = int(backend.vocab_size)
    prompt = [(17 + 31 * i) % vocab for i in range(32)]
    times: dict[int, list[float]] = {n: [] for n in counts}
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            backend.prefill(slots, [prompt] * rows)
            idx = torch.tensor(slots)
            start = backend.cache.lengths[idx].clone()  # [rows]
            toks = torch.full((rows, 1), 101, dtype=torch.long)  # [rows, 1]
            for rep in range(reps + 1):  # rep 0 warms every count up and is not kept
                for n in counts:
                    torch.set_num_threads(n)
                    t = time.perf_counter()
                    backend.target(toks, backend.cache, idx, taps=backend.taps, logits="all")
                    dt = time.perf_counter() - t
                    backend.cache.truncate(idx, start)
                    if rep:
                        times[n].append(dt)
    finally:
        for s in slots:
            backend.release(s)
        torch.set_num_threads(before)
    return {n: statistics.median(v) for n, v in times.items()}


def apply_threads(backend: Any, environ: dict[str, str] | None = None) -> int:
    """Set torch's intra-op threads for the round loop: DSPARK_THREADS if given, else the candidate with the lowest
    measured 1-row + 4-row decode step (more threads must win by 10 %). Returns the count in use."""
    import torch  # noqa: PLC0415

    env = os.environ if environ is None else environ
    fixed = parse_threads(env.get(THREADS_ENV))
    if fixed is not None:
        torch.set_num_threads(fixed)
        log.info("torch threads: %d (%s)", fixed, THREADS_ENV)
        return fixed
    counts = candidates(available_cpus())
    if len(counts) == 1:
        torch.set_num_threads(counts[0])
        return counts[0]
    one = measure_threads(backend, counts)
    few = measure_threads(backend, counts, rows=4)  # a batched step too: where a descheduled OpenMP peer hurts most
    score = {n: one[n] + few[n] for n in counts}
    best = min(counts, key=lambda n: (score[n] * (1.0 if n == 1 else 1.1), n))  # more threads must win by 10 %
    torch.set_num_threads(best)
    log.info("torch threads: %d (measured decode step, 1 / 4 rows: %s ms; set %s=N or `dspark-trt serve --threads "
             "N` to fix it)", best, {n: (round(one[n] * 1e3, 2), round(few[n] * 1e3, 2)) for n in counts},
             THREADS_ENV)
    return best


def on_fresh_thread(fn: Callable[[], T], name: str = "dspark-setup") -> T:
    """fn() on a new thread, joined: its return value, or its exception re-raised here.

    Why the `dspark` stub's startup (load, thread measurement, cost profile) runs this way: every thread that runs a
    parallel region with more than one thread keeps its own OpenMP worker pool until it exits, and libgomp spins only
    ~100 iterations (instead of ~3 ms) at its barriers while the process manages more OpenMP threads than it has
    CPUs. Startup compute on the stub's main thread left such a pool behind; with the round thread's own pool the
    process held 3 managed threads on a 2-core host, so in every one of a decode step's ~200 parallel regions the
    peer had gone to sleep and had to be woken: a served decode step took 23.0 ms against 13.1 ms (AMD EPYC Zen 3,
    avx2 engine; 38.5 → 62.6 tok/s at one client). A pool whose thread has exited is freed, so the round thread's
    is the only one left."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
