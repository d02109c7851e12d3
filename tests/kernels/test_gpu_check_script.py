"""scripts/gpu_check.sh in smoke mode (CPU, Triton interpreter, tiny shapes): the script that will run on the
H200 must at least run end to end here and write a PASS report with every section present."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30 s idle, ~60 s on a loaded 2-core box (subprocess: torch, transformers, tiny models)
def test_gpu_check_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, DSPARK_GPU_CHECK_SMOKE="1", PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, (out.stdout[-2000:], (tmp_path / "gpu_check.log").read_text()[-3000:])
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["verdict"] == "PASS"
    for name in ("parity_accept", "parity_block_draft", "parity_dispatch"):
        assert rep[name]["status"] == "ok" and rep[name]["parity_failures"] == 0, rep[name]
    assert rep["bandwidth"]["status"] == "skipped"
    assert rep["runtime"]["status"] == "ok" and rep["runtime"]["plain_causallm_tok_s"] > 0
    tiny = rep["runtime"].get("tiny_pair")
    if isinstance(tiny, dict):  # present once runtime/backend.py and the LM drafter exist
        assert tiny["greedy_lossless"] is True, tiny
    assert (tmp_path / "report.md").read_text().startswith("# dspark GPU check")
