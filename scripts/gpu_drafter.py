#!/usr/bin/env python
"""One prepared drafter-training run on a GPU host (run by scripts/gpu_drafter.sh on the lent H200).

Owns the plan and its deadline; the work itself is the product's own code (train.features, `dspark-trt
train-drafter`, train.evaluate):
1. target: the embedded SmolLM2-135M GGUF → HF bf16 dir (runtime.default_model.convert_gguf);
2. teacher: one pass over the committed corpus (data/chatgen) with the HF teacher on CUDA → WORK/teacher
   (taps + top-16 log-probs; ~7.4M tokens, ~43 GB, placed where there is room);
3. runs: parallel `train-drafter` processes on that one store, all with the GPU recipe (batch 32 × 64 anchors):
   the data → τ curve (1M, 2.5M, 5M answer tokens, the same training minutes per token) and, at 5M with the
   5M point's minutes, the architecture sweep (decoder layers 3 / 4, Markov rank 256, draft vocabulary 32k) and
   the on-policy phase after the supervised one;
4. loop: held-out loop τ at K = γ of every drafter (train.evaluate on CUDA, bf16; the lossless count there is
   CUDA's, whose verify and decode kernels differ, so it is reported, not asserted);
5. pack: OUT/results.tar.gz (metrics, loop τ, logs, report.md) and the drafters named by --bring as ≤ 15 MiB parts
   (OUT/<run>.tar.partNN; `cat` them back together).
Every stage records its seconds or its error in OUT/report.json; a failed run never stops the others.

    python scripts/gpu_drafter.py --gguf T.gguf --corpus A.jsonl.gz B.jsonl.gz --work DIR --out OUT [--deadline-s 500]
    DSPARK_GPU_DRAFTER_SMOKE=1 …  (CPU, a slice of the corpus, a few steps: tests this script)
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("gpu_drafter")
ROOT = Path(__file__).resolve().parents[1]
SMOKE = os.environ.get("DSPARK_GPU_DRAFTER_SMOKE") == "1"
T0 = time.monotonic()
PART = 15 * 2**20
RECIPE = ["--batch-seqs", "32", "--anchors", "64", "--gamma", "7", "--threads", "2"]
SMOKE_RECIPE = ["--batch-seqs", "2", "--anchors", "4", "--gamma", "7", "--threads", "1"]
# name → (answer-token budget, extra train-drafter arguments); the sweep runs at the largest budget
RUNS: dict[str, tuple[int, list[str]]] = {
    "curve-1M": (1_000_000, []),
    "curve-2.5M": (2_500_000, []),
    "curve-5M": (5_000_000, []),
    "sweep-L3": (5_000_000, ["--num-layers", "3"]),
    "sweep-L4": (5_000_000, ["--num-layers", "4"]),
    "sweep-r256": (5_000_000, ["--markov-rank", "256"]),
    "sweep-v32k": (5_000_000, ["--draft-vocab", "32768"]),
    "onpolicy-5M": (5_000_000, ["--onpolicy-every", "150", "--onpolicy-start-frac", "0.5", "--onpolicy-frac", "0.5"]),
}


def elapsed() -> float:
    return time.monotonic() - T0


def stage(report: dict[str, Any], name: str, fn, *args) -> Any:  # noqa: ANN001, ANN401
    t = time.monotonic()
    try:
        out = fn(*args)
        report[name] = {"status": "ok", "seconds": round(time.monotonic() - t, 1)}
        if isinstance(out, dict):
            report[name].update({k: v for k, v in out.items() if k != "value"})
            out = out.get("value", out)
        return out
    except Exception as exc:  # noqa: BLE001 - the report must survive any failure
        log.exception("stage %s failed", name)
        report[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                        "seconds": round(time.monotonic() - t, 1)}
        return None
    finally:
        log.info("[%6.1fs] %s: %s", elapsed(), name, report[name])
        (OUT / "report.json").write_text(json.dumps(report, indent=1, default=str))


def convert(gguf: Path, work: Path) -> dict[str, Any]:
    from dspark_trt.runtime.default_model import convert_gguf

    out = work / "target"
    if not (out / ".complete").exists():
        convert_gguf(gguf, out)
    return {"value": out}


def corpus(paths: list[Path], work: Path, records: int) -> dict[str, Any]:
    """Unzip the chat JSONL files (the corpus loader reads .jsonl); SMOKE keeps the first `records` lines."""
    outs, n = [], 0
    for p in paths:
        dst = work / p.name.removesuffix(".gz")
        with gzip.open(p, "rt") as f, open(dst, "w") as g:
            for i, line in enumerate(f):
                if records and i >= records:
                    break
                g.write(line)
                n += 1
        outs.append(dst)
    return {"value": outs, "records": n}


def pick_store(work: Path, per_token: int, n_tok: int) -> tuple[Path, int]:
    """The folder with the most room for the feature store (/dev/shm, RAM, or the work disk) and how many tokens
    fit there (all of them, or what 90% of its free space holds)."""
    best, free = work, -1
    for d in (Path("/dev/shm"), work):
        try:
            f = shutil.disk_usage(d).free
        except OSError:
            continue
        if f > free:
            best, free = d, f
    return best / "dspark_teacher", min(n_tok, int(0.9 * free / per_token))


def teacher(target: Path, jsonls: list[Path], work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from dspark_trt.train.corpus import load_corpus
    from dspark_trt.train.features import HFTarget, cache_features
    from dspark_trt.train.model_init import default_layer_ids
    from dspark_trt.train.trainer import TrainConfig

    cfg = TrainConfig()
    tok = AutoTokenizer.from_pretrained(target)
    seqs, starts = load_corpus(jsonls, tok, 10**10, window=cfg.max_len, seed=cfg.seed)
    n_tok = sum(len(s) for s in seqs)
    taps = default_layer_ids(int(json.loads((target / "config.json").read_text())["num_hidden_layers"]))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    per_token = len(taps) * int(json.loads((target / "config.json").read_text())["hidden_size"]) * 2 + cfg.topk * 6 + 4
    store, fits = pick_store(work, per_token, n_tok)
    kept = n_tok
    if fits < n_tok:  # keep whole sequences, in corpus order, up to what fits
        acc, keep = 0, 0
        while keep < len(seqs) and acc + len(seqs[keep]) <= fits:
            acc += len(seqs[keep])
            keep += 1
        seqs, starts, kept = seqs[:keep], starts[:keep], acc
        log.warning("feature store: room for %d of %d tokens in %s", kept, n_tok, store.parent)
    # bf16 on the GPU; fp32 on a CPU (a smoke run: CPUs without AVX-512 BF16 have no fast bf16 products)
    t = HFTarget.load(target, taps, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
    t0 = time.monotonic()
    cache_features(t, seqs, starts, store, topk=cfg.topk, max_len=cfg.max_len,
                   batch_tokens=2048 if SMOKE else 24576, max_rows=256)
    dt = time.monotonic() - t0
    del t
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"value": store, "tokens": n_tok, "tokens_kept": kept, "sequences": len(seqs), "taps": list(taps), "store": str(store),
            "tok_per_s": round(kept / max(dt, 1e-9)), "device": dev}


def _train_cmd(name: str, target: Path, jsonls: list[Path], runs: Path, minutes_per_mtok: float,
               steps_cap: int) -> list[str]:
    n, extra = RUNS[name]
    minutes = minutes_per_mtok * n / 1e6
    cmd = [sys.executable, "-m", "dspark_trt.cli", "train-drafter", "--target", str(target), "--corpus",
           *map(str, jsonls), "--out", str(runs / name), "--train-tokens", str(n), "--max-minutes", f"{minutes:.2f}",
           *(SMOKE_RECIPE if SMOKE else RECIPE), *extra]
    if steps_cap:
        cmd += ["--max-steps", str(steps_cap)]
    return cmd


def train_all(target: Path, jsonls: list[Path], store: Path, work: Path, train_s: float) -> dict[str, Any]:
    """All runs at once on the one GPU, each its own process (the data gathering is per-process CPU work)."""
    runs = work / "runs"
    minutes_per_mtok = train_s / 60 / 5.0  # the 5M runs take the whole window
    procs = {}
    for name in RUNS:
        d = runs / name
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "features").exists():
            os.symlink(store, d / "features")
        cmd = _train_cmd(name, target, jsonls, runs, minutes_per_mtok, 3 if SMOKE else 0)
        logf = open(d / "train.log", "w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT), logf)
        log.info("started %s: %s", name, " ".join(cmd[3:]))
    status = {}
    for name, (p, logf) in procs.items():
        try:
            rc = p.wait(timeout=max(10.0, train_s + 90 - (time.monotonic() - T_TRAIN)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "killed"
        logf.close()
        m = runs / name / "metrics.json"
        status[name] = {"rc": rc, "metrics": m.exists()}
        if m.exists():
            j = json.loads(m.read_text())
            status[name].update({k: j.get(k) for k in ("steps", "wall_minutes", "heldout_tau_tf", "heldout_alpha_tf",
                                                        "trainable_params", "train_tokens")})
    return {"value": runs, "runs": status, "minutes_per_mtok": round(minutes_per_mtok, 3)}


def loop_all(target: Path, runs: Path, limit_s: float) -> dict[str, Any]:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    procs = {}
    for name in RUNS:
        d = runs / name / "drafter"
        if not (d / "config.json").exists():
            continue
        cmd = [sys.executable, "-m", "dspark_trt.train.evaluate", "--target", str(target), "--drafter", str(d),
               "--gammas", "7", "--max-new", "96", "--device", dev, "--json", str(runs / name / "loop.json"),
               "--dtype", "bfloat16" if dev == "cuda" else "float32"]
        if SMOKE:
            cmd += ["--n-prompts", "3", "--max-new", "8"]
        logf = open(runs / name / "loop.log", "w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT), logf)
    t0, out = time.monotonic(), {}
    for name, (p, logf) in procs.items():
        try:
            p.wait(timeout=max(5.0, limit_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
        logf.close()
        j = runs / name / "loop.json"
        if j.exists():
            g = json.loads(j.read_text())["by_gamma"]["7"]
            out[name] = {k: g[k] for k in ("tau", "acceptance_per_position", "tau_by_kind", "draft_ms",
                                           "draft_cost_vs_decode_step", "lossless_mismatches")}
    return {"value": out, "loop": out}


def pack(runs: Path | None, bring: list[str], loop: dict[str, Any], max_parts: int = 4) -> dict[str, Any]:
    """results.tar.gz with every small file (and the host's nvidia-smi); the best drafter by loop τ, then the ones
    named, as ≤ 15 MiB parts while they fit in max_parts (the tool returns 8 files: 4 go to reports and logs)."""
    with tarfile.open(OUT / "results.tar.gz", "w:gz") as tar:
        if (work_dir() / "nvidia-smi.txt").exists():
            tar.add(work_dir() / "nvidia-smi.txt", arcname="nvidia-smi.txt")
        if runs is not None:
            for f in sorted(runs.rglob("*")):
                if f.is_file() and f.suffix in (".json", ".log", ".md") and f.stat().st_size < 8 * 2**20:
                    tar.add(f, arcname=str(f.relative_to(runs)))
    if loop:
        bring = [max(loop, key=lambda k: loop[k]["tau"]), *bring]
    parts: list[str] = []
    for name in dict.fromkeys(bring):
        d = runs / name / "drafter" if runs is not None else None
        if d is None or not (d / "config.json").exists():
            continue
        blob = work_dir() / f"{name}.tar"
        with tarfile.open(blob, "w") as tar:
            tar.add(d, arcname=f"{name}/drafter")
            for extra in ("metrics.json", "loop.json"):
                if (runs / name / extra).exists():
                    tar.add(runs / name / extra, arcname=f"{name}/{extra}")
        data = blob.read_bytes()
        n = -(-len(data) // PART)
        if len(parts) + n > max_parts:
            continue
        for i in range(n):
            (OUT / f"{name}.tar.part{i:02d}").write_bytes(data[i * PART:(i + 1) * PART])
            parts.append(f"{name}.tar.part{i:02d}")
    return {"parts": parts}


_WORK: Path | None = None


def work_dir() -> Path:
    assert _WORK is not None
    return _WORK


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU drafter run ({report.get('host', {}).get('gpu')}, commit {report.get('commit')})", ""]
    loop = (report.get("loop") or {}).get("loop") or {}
    runs = (report.get("train") or {}).get("runs") or {}
    lines += ["| run | steps | minutes | τ teacher-forced | loop τ (K = 7) | acceptance 1–3 | by kind | draft/step |",
              "|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        r, lp = runs.get(name, {}), loop.get(name, {})
        lines.append(f"| {name} | {r.get('steps')} | {r.get('wall_minutes')} | {r.get('heldout_tau_tf')} | "
                     f"{lp.get('tau')} | {(lp.get('acceptance_per_position') or [])[:3]} | {lp.get('tau_by_kind')} | "
                     f"{lp.get('draft_cost_vs_decode_step')} |")
    lines += ["", "```json", json.dumps({k: v for k, v in report.items() if k not in ("loop",)}, indent=1,
                                        default=str)[:6000], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    global OUT, _WORK, T_TRAIN
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--corpus", type=Path, nargs="+", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deadline-s", type=float, default=500.0, help="the whole run, packing included")
    p.add_argument("--loop-s", type=float, default=75.0, help="seconds kept for the loop τ stage")
    p.add_argument("--bring", default="curve-5M,onpolicy-5M", help="drafters returned as parts (plus the best)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    OUT, _WORK = a.out, a.work
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                        capture_output=True, text=True).stdout.strip(),
                              "smoke": SMOKE, "deadline_s": a.deadline_s}
    try:
        import torch
        report["host"] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                          "cpus": os.cpu_count(), "shm_free_gb": round(shutil.disk_usage("/dev/shm").free / 1e9, 1),
                          "work_free_gb": round(shutil.disk_usage(a.work).free / 1e9, 1)}
        import transformers
        report["host"]["transformers"] = transformers.__version__
    except Exception as exc:  # noqa: BLE001
        report["host"] = {"error": repr(exc)}
    target = stage(report, "target", convert, a.gguf, a.work)
    jsonls = stage(report, "corpus", corpus, a.corpus, a.work, 16 if SMOKE else 0)
    store = stage(report, "teacher", teacher, target, jsonls, a.work) if target and jsonls else None
    runs, loop = None, {}
    if store is not None:
        T_TRAIN = time.monotonic()
        train_s = a.deadline_s - elapsed() - a.loop_s - 40
        report["train_window_s"] = round(train_s, 1)
        runs = stage(report, "train", train_all, target, jsonls, store, a.work, max(30.0, train_s))
        if runs is not None:
            loop = stage(report, "loop", loop_all, target, runs, max(20.0, a.deadline_s - elapsed() - 25)) or {}
    stage(report, "pack", pack, runs, [x for x in a.bring.split(",") if x], loop)
    report["total_s"] = round(elapsed(), 1)
    (a.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (a.out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if loop else 1


OUT = Path(".")
T_TRAIN = 0.0

if __name__ == "__main__":
    raise SystemExit(main())
