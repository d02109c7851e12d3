"""serve.tuning: the `dspark` stub's torch threads, and where its startup compute runs (on_fresh_thread)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.serve import tuning


def test_parse_threads_and_candidates() -> None:
    assert [tuning.parse_threads(v) for v in (None, "", "auto", "AUTO", "0", "3")] == [None] * 5 + [3]
    with pytest.raises(InvalidArgumentError, match="DSPARK_THREADS"):
        tuning.parse_threads("two")
    assert tuning.candidates(2) == (1, 2)
    assert tuning.candidates(8) == (1, 4, 8)


def test_fixed_threads_are_applied_without_measuring() -> None:
    import torch

    before = torch.get_num_threads()
    try:
        assert tuning.apply_threads(None, {tuning.THREADS_ENV: "1"}) == 1  # no backend needed: nothing is timed
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_on_fresh_thread_returns_the_value_and_reraises_on_the_caller() -> None:
    import threading

    assert tuning.on_fresh_thread(lambda: threading.current_thread().name) == "dspark-setup"
    with pytest.raises(KeyError, match="boom"):
        tuning.on_fresh_thread(lambda: {}["boom"])


# A parallel torch op with 2 threads on a thread leaves that thread's OpenMP worker pool (here one worker) behind
# until the thread exits: run on the main thread the pool stays, on on_fresh_thread it goes. (torch.set_num_threads
# also starts a pthreadpool worker, process-wide, in both cases: not OpenMP's, and idle.)
_POOLS = textwrap.dedent("""
    import os, sys, time, torch
    from dspark_trt.serve.tuning import on_fresh_thread
    def count():
        return len(os.listdir("/proc/self/task"))
    def parallel_work():
        torch.set_num_threads(2)
        x = torch.randn(1 << 21)
        for _ in range(5):
            (x * 2.0 + 1.0).sum()
    torch.randn(8).sum()
    n0 = count()
    if sys.argv[1] == "fresh":
        on_fresh_thread(parallel_work)
    else:
        parallel_work()
    deadline = time.monotonic() + 5.0
    while count() > n0 and time.monotonic() < deadline:  # exiting pool workers are reaped asynchronously
        time.sleep(0.02)
    print(count() - n0)
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux /proc and at least 2 CPUs (an OpenMP pool of 2 threads)")
def test_startup_compute_on_a_fresh_thread_leaves_no_openmp_pool() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as serve.server.server_env gives the stubs

    def extra_threads(where: str) -> int:
        out = subprocess.run([sys.executable, "-c", _POOLS, where], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    assert extra_threads("main") - extra_threads("fresh") == 1  # the main thread's pool worker


def test_the_dspark_stub_runs_its_startup_compute_on_a_thread_that_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from dspark_trt.serve.triton import dspark as stub_module
    from dspark_trt.serve.triton.stub import StubModel

    seen: list[threading.Thread] = []
    monkeypatch.setattr(StubModel, "initialize", lambda self, args: None)  # no stub setup (logging, parent watch)
    monkeypatch.setattr(stub_module.DsparkModel, "_setup", lambda self: seen.append(threading.current_thread()))
    stub_module.DsparkModel.__new__(stub_module.DsparkModel).initialize({})
    assert len(seen) == 1 and seen[0] is not threading.current_thread() and not seen[0].is_alive()
