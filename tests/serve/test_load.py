"""`dspark-trt load`: its bounds and report on their own, and a short soak of the tiny build through a real
tritonserver (its own server: every answer right, nothing failed, nothing left behind after it stopped)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_trt.commands.load import Sample, _check_loopback, _pct, summarize
from dspark_trt.errors import InvalidArgumentError


def test_only_loopback_servers() -> None:
    _check_loopback("127.0.0.1:8001")
    _check_loopback("localhost:8001")
    with pytest.raises(InvalidArgumentError, match="loopback"):
        _check_loopback("10.1.2.3:8001")


def test_bounds_are_errors() -> None:
    for extra in (["--clients", "0"], ["--clients", "1000"], ["--duration", "0"], ["--duration", "99999"]):
        proc = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "load", "--url", "127.0.0.1:1", *extra],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and "InvalidArgumentError" in proc.stderr, (extra, proc.stderr[-500:])


def test_summary_counts_and_percentiles() -> None:
    refs = [[1, 2, 3], [4, 5]]
    ok = Sample(0, ids=[1, 2, 3], t_send=0.0, t_first=0.01, gaps=[0.002, 0.004])
    wrong = Sample(1, ids=[4, 6], t_send=0.0, t_first=0.02, gaps=[0.003])
    err = Sample(1, error="boom")
    rep = summarize([ok, wrong, err], 2.0, refs, clients=2)
    assert (rep["ok"], rep["wrong"], rep["errors"], rep["tokens"]) == (1, 1, 1, 5)
    assert rep["first_wrong"] == [{"prompt": 1, "first_difference_at": 1, "got": 2, "want": 2}]
    assert rep["ttft_ms"] == {"p50": 10.0, "p99": 20.0} and rep["itl_ms"]["p50"] == 3.0
    assert _pct([], 50) is None and _pct([5.0], 99) == 5.0


@pytest.mark.triton
def test_short_soak_on_tiny_build(tiny_build: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "load", "--repo", str(tiny_build / "model_repo"),
                           "--clients", "3", "--duration", "4", "--max-tokens", "24", "--json"],
                          capture_output=True, text=True, timeout=900)
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (rep, proc.stderr[-3000:])
    assert rep["ok"] > 3 and rep["wrong"] == 0 and rep["errors"] == 0 and rep["leak_check"] == "clean"
    assert rep["ttft_ms"]["p50"] is not None and rep["itl_ms"]["p99"] is not None and rep["tok_per_s"] > 0
