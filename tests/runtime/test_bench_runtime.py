"""scripts/bench_runtime.py on the tiny checkpoint: one run writes the markdown table and the PNG plot, and the
llama.cpp comparison degrades to a note when `llama_cpp` is not importable."""
from __future__ import annotations

import builtins
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():  # noqa: ANN202 - the script as a module
    spec = importlib.util.spec_from_file_location("bench_runtime", ROOT / "scripts" / "bench_runtime.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_runtime"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_bench_runs_on_tiny_model_without_llama_cpp(tiny_pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_llama(name: str, *a, **k):  # noqa: ANN002, ANN003, ANN202
        if name == "llama_cpp":
            raise ImportError("no llama_cpp here")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    bench = _bench()
    out, png = tmp_path / "bench.md", tmp_path / "bench.png"
    threads = torch.get_num_threads()
    try:  # main() sets the thread count: restore it (other tests compare bits with fresh processes)
        rep = bench.main(["--model", str(tiny_pair.target), "--new", "4", "--reps", "1", "--kmax", "2", "--threads",
                          "1", "--quants", "W8A16", "--llama-gguf", f"q8_0={tmp_path / 'missing.gguf'}", "--out",
                          str(out), "--plot", str(png)])
    finally:
        torch.set_num_threads(threads)
    assert [r.engine for r in rep.rows] == ["ours bf16", "ours W8A16"]
    assert all(r.tok_s > 0 and r.mb_per_token and r.pct_bw for r in rep.rows)
    assert set(rep.verify) == {"ours bf16", "ours W8A16"} and all(len(c) == 2 for c in rep.verify.values())
    text = out.read_text()
    assert "| ours W8A16 |" in text and "K=2" in text
    assert rep.peak_gflops > 0 and all(len(c) == 2 and min(c) >= 1.0 for c in rep.floor.values())
    assert "| compute floor, ours bf16 |" in text
    assert "llama.cpp q8_0: not measured" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.stat().st_size > 1000 and "benchmarks" not in png.name
