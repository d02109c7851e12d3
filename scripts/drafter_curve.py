#!/usr/bin/env python
"""The data → τ curve: DSpark drafters trained on nested subsets of the target-generated data (the same recipe and
the same training minutes per token), each measured in the real draft-and-verify loop on the held-out prompts.

Stages, each skipped when its output exists (rerun the same command to resume after an interruption):
1. one teacher pass over the corpus (`dspark-trt train-drafter --features-only`, the runtime teacher) → OUT/teacher;
2. per budget N: `train-drafter --train-tokens N --max-minutes N/1M · --minutes-per-mtok` on that store → OUT/N;
3. per budget: `train.evaluate` at fixed K = γ on the held-out prompts (lossless check on) → OUT/N/loop.json;
4. a markdown table and a PNG (loop τ and teacher-forced τ against answer tokens) → OUT/curve.md, OUT/curve.png,
   stamped with the CPU, its kernel engine and the commit.

    .venv/bin/python scripts/drafter_curve.py --corpus runs/data/chat.jsonl --out runs/curve \\
        [--budgets 1000000,2500000,5000000] [--minutes-per-mtok 12 | --steps-per-mtok 600] [--gamma 7]

A long job (hours on 2 cores): run it with nohup on a quiet machine. Never a test.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("drafter_curve")
ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> None:
    log.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True, cwd=ROOT)


def _stamp() -> str:
    from dspark_trt.runtime import native

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return f"{native.cpu_model()} ({native.cpu_family()}), engine {native.engine()}, commit {commit.strip()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budgets", default="1000000,2500000,5000000", help="answer-token budgets, comma-separated")
    p.add_argument("--minutes-per-mtok", type=float, default=12.0, help="training minutes per 1M answer tokens")
    p.add_argument("--steps-per-mtok", type=int, default=0,
                   help="train by steps instead: this many steps per 1M answer tokens (the minute budget becomes "
                        "4× --minutes-per-mtok, a bound only), so a busy machine slows the curve but cannot bend it")
    p.add_argument("--target", type=Path, default=None, help="target HF dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--train-args", default="", help="extra train-drafter arguments (the recipe), one string")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    py = sys.executable
    if a.target is None:
        from dspark_trt.runtime.default_model import default_target_dir

        a.target = default_target_dir()
    cli = [py, "-m", "dspark_trt.cli"]
    tgt = ["--target", str(a.target)]
    teacher = a.out / "teacher"
    if not (teacher / "features" / "meta.json").exists():
        _run(cli + ["train-drafter", *tgt, "--corpus", *map(str, a.corpus), "--out", str(teacher), "--features-only",
                    "--gamma", str(a.gamma), "--max-tokens", str(10**10)])
    def budget(n: int) -> list[str]:
        minutes = a.minutes_per_mtok * n / 1e6
        if not a.steps_per_mtok:
            return ["--max-minutes", f"{minutes:.1f}"]
        return ["--max-steps", str(round(a.steps_per_mtok * n / 1e6)), "--max-minutes", f"{4 * minutes:.1f}"]

    rows = []
    for n in (int(x) for x in a.budgets.split(",")):
        run = a.out / f"{n}"
        run.mkdir(parents=True, exist_ok=True)
        if not (run / "features").exists():
            os.symlink((teacher / "features").resolve(), run / "features")
        if not (run / "drafter" / "config.json").exists() or not (run / "metrics.json").exists():
            _run(cli + ["train-drafter", *tgt, "--corpus", *map(str, a.corpus), "--out", str(run),
                        "--gamma", str(a.gamma), "--train-tokens", str(n), *budget(n), *a.train_args.split()] + (["--resume"] if (run / "train_state.pt").exists() else []))
        loop = run / "loop.json"
        if not loop.exists():
            _run([py, "-m", "dspark_trt.train.evaluate", *tgt, "--drafter",
                  str(run / "drafter"), "--gammas", str(a.gamma), "--max-new", str(a.max_new), "--json", str(loop)])
        m = json.loads((run / "metrics.json").read_text())
        g = json.loads(loop.read_text())["by_gamma"][str(a.gamma)]
        rows.append((n, m.get("heldout_tau_tf"), g["tau"], g["acceptance_per_position"][:3], g["tau_by_kind"],
                     g["lossless_mismatches"]))
    per = f"{a.steps_per_mtok} training steps" if a.steps_per_mtok else f"{a.minutes_per_mtok:g} training minutes"
    lines = [f"Data → τ ({_stamp()}); γ = K = {a.gamma}, {per} per 1M answer tokens, held-out prompts, greedy", "",
             "| answer tokens | τ teacher-forced (held-out split) | loop τ | acceptance 1–3 | loop τ by kind "
             "| lossless |",
             "|---|---|---|---|---|---|"]
    for n, tf, tau, acc, kinds, bad in rows:
        lines.append(f"| {n / 1e6:g}M | {tf if tf is None else round(tf, 3)} | {tau} | {acc} | {kinds} | "
                     f"{'yes' if bad == 0 else f'{bad} mismatches'} |")
    (a.out / "curve.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r[0] / 1e6 for r in rows], [r[2] for r in rows], "o-", label="loop τ (held-out prompts)")
    ax.plot([r[0] / 1e6 for r in rows], [r[1] or 0 for r in rows], "s--", label="teacher-forced τ (held-out split)")
    ax.set_xlabel("answer tokens (M)")
    ax.set_ylabel(f"τ at K = {a.gamma}")
    ax.grid(alpha=.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "curve.png", dpi=120)
    log.info("\n%s", "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
