"""scripts/drafter_curve.py end to end on the tiny pair: one teacher pass, two nested budgets trained with the same
recipe, each measured in the real loop (lossless), the table and the plot written; a rerun resumes (skips all)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_trt.train.chatgen import generate_answers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_curve_trains_nested_budgets_and_measures_each_in_the_loop(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    corpus = tmp_path / "chat.jsonl"
    generate_answers(tiny_pair.target, [f"Tell me about item {i}." for i in range(12)], corpus, batch_size=6,
                     max_new_tokens=40, threads=1)
    out = tmp_path / "curve"
    cmd = [sys.executable, str(ROOT / "scripts" / "drafter_curve.py"), "--target", str(tiny_pair.target),
           "--corpus", str(corpus), "--out", str(out), "--budgets", "120,300", "--gamma", "4", "--max-new", "8",
           "--minutes-per-mtok", "1000", "--train-args",
           "--layers 0,1 --num-layers 1 --markov-rank 8 --draft-vocab 256 --max-steps 3 --batch-seqs 2 --anchors 4"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600)
    table = (out / "curve.md").read_text()
    assert "| 0.00012M |" in table and "| 0.0003M |" in table and table.count("| yes |") == 2  # lossless rows
    assert (out / "curve.png").stat().st_size > 1000
    for n in (120, 300):
        met = json.loads((out / str(n) / "metrics.json").read_text())
        assert met["steps"] == 3 and (out / str(n) / "features").resolve() == (out / "teacher" / "features").resolve()
        assert json.loads((out / str(n) / "loop.json").read_text())["by_gamma"]["4"]["lossless_mismatches"] == 0
    stamp = (out / "120" / "loop.json").stat().st_mtime
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600)  # resumes: every stage's output exists
    assert (out / "120" / "loop.json").stat().st_mtime == stamp
