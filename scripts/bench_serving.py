#!/usr/bin/env python
"""Serving speed, measured so it can be rerun on a quiet machine: tokens/s and TTFT through Triton by client
concurrency, against the same build decoding in process, for several torch-thread counts and batch caps.

Every configuration (threads × batch cap) gets its own server, all started first and measured interleaved —
round by round, level by level, each configuration in turn, in-process runs among them — so a change of machine
load hits every configuration alike; the table reports medians over --rounds. Served clients stream through
`ensemble_stream` (gRPC); in process is spec_decode.loop.generate on a SpecBackend of the same build with the
same thread count (batch 1). The header records the machine and its load average before and after.
Usage (the numbers in docs/serving.md):
  .venv/bin/python scripts/bench_serving.py --repo build/default/model_repo --concurrency 1 8 --threads 1 2 \\
      --batch-caps 8 --inprocess --rounds 3 --max-tokens 96 --policy plain
  .venv/bin/python scripts/bench_serving.py --repo build/default/model_repo --concurrency 16 --batch-caps 4 8 16
With --grid: the concurrency × K-policy grid under load (scripts/bench_serving_grid.py; `--grid --help`):
  .venv/bin/python scripts/bench_serving.py --grid --quick --repo build/default/model_repo
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_trt.serve.clients.client import generate_remote  # noqa: E402
from dspark_trt.serve.server import TritonServer  # noqa: E402

log = logging.getLogger("bench_serving")

PROMPTS = ["def main(argv):", "import os\nimport sys\n", "class Queue:\n    def __init__(self", "# Copyright",
           "for i in range(10):", "return self._", "with open(path) as f:", "if __name__ == '__main__':",
           "try:\n    import", "def __repr__(self):", "raise ValueError(", "x = [i * i for i in", "while True:",
           "lambda x:", "print(", "from collections import"]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{platform.node()} · {cpu} · {os.cpu_count()} cores visible · {platform.system()} {platform.release()} · "
            f"Python {platform.python_version()} · {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC")


@dataclass(frozen=True)
class Config:
    threads: str  # DSPARK_THREADS of the server ("auto" or N)
    cap: int | None  # KV slots (MAX_BATCH_SIZE of the dspark model); None = the build's


def repo_with_cap(repo: Path, cap: int | None, tmp: Path) -> Path:
    """`repo`, or a copy whose dspark model holds `cap` KV slots."""
    if cap is None:
        return repo
    out = tmp / f"cap{cap}" / "model_repo"
    if not out.exists():
        shutil.copytree(repo, out)
        cfg = out / "dspark" / "config.pbtxt"
        text = re.sub(r'(key: "MAX_BATCH_SIZE" value: \{ string_value: ")\d+', rf"\g<1>{cap}", cfg.read_text())
        cfg.write_text(text)
    return out


def served_level(url: str, concurrency: int, requests: int, max_tokens: int, policy: str | None) -> dict[str, Any]:
    """`concurrency` clients, each streaming `requests` requests back to back; tok/s over the wall, client TTFT."""
    results: list[tuple[int, float]] = []  # (tokens, ttft s)
    errors: list[str] = []
    taus: list[float] = []
    batches: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            prompt = PROMPTS[(c * 7 + r) % len(PROMPTS)]
            first: list[float] = []
            t0 = time.perf_counter()
            try:
                out = generate_remote(url, prompt, max_tokens=max_tokens, protocol="grpc", stream=True, policy=policy,
                                      on_text=lambda _t: first.append(time.perf_counter()) if not first else None)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append((len(out["token_ids"]), (first[0] if first else time.perf_counter()) - t0))
                taus.append(float(out["stats"].get("tau", 0.0)))
                batches.append(float(out["stats"].get("batch", {}).get("mean", 0.0)))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(x[1] for x in results)
    return {"tok_s": sum(x[0] for x in results) / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else 0.0,
            "ttft_max_ms": 1e3 * ttfts[-1] if ttfts else 0.0, "errors": len(errors),
            "tau": statistics.mean(taus) if taus else 0.0, "batch": statistics.mean(batches) if batches else 0.0}


class InProcess:
    """The same build decoding in this process, batch 1 (what `dspark-trt generate --build-dir` runs)."""

    def __init__(self, build_dir: Path, max_tokens: int, policy: str | None) -> None:
        from dspark_trt.builder.artifacts import load_built_pair  # noqa: PLC0415
        from dspark_trt.runtime.backend import SpecBackend  # noqa: PLC0415

        self.pair = load_built_pair(build_dir)
        self.gamma = int(self.pair.options.max_draft_len)
        self.backend = SpecBackend(self.pair.target, self.pair.drafter, max_batch=1,
                                   max_seq=int(self.pair.options.max_seq_len))
        self.eos = tuple(int(e) for e in getattr(self.pair.target.config, "eos_token_ids", ()) or ())
        self.max_tokens, self.policy = max_tokens, policy or self.pair.options.policy

    def level(self, threads: str, requests: int) -> dict[str, Any]:
        import torch  # noqa: PLC0415

        from dspark_trt.spec_decode.loop import LoopConfig, generate  # noqa: PLC0415
        from dspark_trt.spec_decode.scheduler import PolicyConfig  # noqa: PLC0415

        torch.set_num_threads(int(threads) if threads.isdigit() else torch.get_num_threads())
        opts = self.pair.options  # the served defaults (serve.worker.policy_config: fixed verifies max_k)
        pol = PolicyConfig(policy=self.policy, k=opts.effective_max_k, min_k=opts.min_k, max_k=opts.effective_max_k)
        tokens, t0 = 0, time.perf_counter()
        for r in range(requests):
            ids = self.pair.tokenizer(PROMPTS[(7 * r) % len(PROMPTS)])["input_ids"]
            res = generate(self.backend, ids, max_new_tokens=self.max_tokens, policy=pol, eos_ids=self.eos,
                           config=LoopConfig(gamma=self.gamma))
            tokens += len(res.tokens)
        return {"tok_s": tokens / (time.perf_counter() - t0), "ttft_p50_ms": 0.0, "ttft_max_ms": 0.0, "errors": 0,
                "tau": 0.0, "batch": 1.0}


def main() -> int:
    if "--grid" in sys.argv[1:]:  # the policy grid under load: its own script, its own flags
        from bench_serving_grid import main as grid_main  # noqa: PLC0415 - scripts/ is sys.path[0]

        return grid_main([a for a in sys.argv[1:] if a != "--grid"])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, required=True, help="model repository (build/NAME/model_repo)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=2, help="requests per client per level and round")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--policy", default=None, help="K policy (default: the build's)")
    p.add_argument("--threads", nargs="+", default=["auto"], help="server DSPARK_THREADS values (N or auto)")
    p.add_argument("--batch-caps", type=int, nargs="+", default=None, help="KV slots of the dspark model to compare")
    p.add_argument("--inprocess", action="store_true", help="also decode in process (batch 1) at concurrency 1")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load_before = os.getloadavg()
    configs = [Config(t, c) for t in args.threads for c in (args.batch_caps or [None])]
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    servers: dict[Config, TritonServer] = {}
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        local = InProcess(args.repo.resolve().parent, args.max_tokens, args.policy) if args.inprocess else None
        for cfg in configs:
            env = dict(os.environ, DSPARK_THREADS=cfg.threads)
            servers[cfg] = TritonServer(repo_with_cap(args.repo, cfg.cap, tmp), env=env).start()
            generate_remote(servers[cfg].grpc_url, PROMPTS[0], max_tokens=8, protocol="grpc", stream=True)  # warm
        for rnd in range(args.rounds):
            for c in args.concurrency:
                for cfg, srv in servers.items():
                    name = f"served threads={cfg.threads} cap={cfg.cap or 'build'}"
                    rows.setdefault((name, c), []).append(served_level(srv.grpc_url, c, args.requests,
                                                                       args.max_tokens, args.policy))
                    if local is not None and c == 1 and cfg.cap == configs[0].cap:
                        rows.setdefault((f"in process threads={cfg.threads}", 1), []).append(
                            local.level(cfg.threads, args.requests))
                log.info("round %d, concurrency %d done", rnd + 1, c)
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in rows.items()}
    lines = [f"Machine: {machine()}", f"Load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
             f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on "
             f"{os.cpu_count()} cores" + (" — LOADED machine: compare rows, not absolute numbers"
                                          if max(load_before[0], load_after[0]) > 0.5 * (os.cpu_count() or 1) else ""),
             f"Repo: {args.repo} · policy {args.policy or 'build default'} · max_tokens {args.max_tokens} · "
             f"{args.requests} request(s)/client/round · {args.rounds} interleaved rounds (medians)", "",
             "| configuration | concurrency | tokens/s | TTFT p50 ms | TTFT max ms | mean τ | mean batch | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for (name, c), m in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {name} | {c} | {m['tok_s']:.1f} | {m['ttft_p50_ms']:.0f} | {m['ttft_max_ms']:.0f} | "
                     f"{m['tau']:.2f} | {m['batch']:.2f} | {m['errors']:.0f} |")
    for t in args.threads:
        served = med.get((f"served threads={t} cap={configs[0].cap or 'build'}", 1))
        inproc = med.get((f"in process threads={t}", 1))
        if served and inproc:
            ratio = served["tok_s"] / inproc["tok_s"]
            lines.append(f"\nthreads={t}: served / in process at concurrency 1 = {ratio:.2f}")
        for c in args.concurrency:
            hi = med.get((f"served threads={t} cap={configs[0].cap or 'build'}", c))
            if served and hi and c > 1:
                lines.append(f"threads={t}: concurrency {c} / concurrency 1 = {hi['tok_s'] / served['tok_s']:.2f}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if all(m["errors"] == 0 for m in med.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
