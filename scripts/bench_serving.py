#!/usr/bin/env python
"""Serving throughput benchmark: tokens/s through the Triton ensemble at several client concurrencies.

Starts its own server on --repo (or uses --url), runs C concurrent gRPC streaming clients (each sends
--requests requests back to back, prompts drawn from a fixed list, varied lengths), and reports generated
tokens/s, requests/s, mean τ and mean round batch size (from the per-request stats), as a markdown table stamped
with the machine. Usage:
  .venv/bin/python scripts/bench_serving.py --repo build/NAME/model_repo --concurrency 1 4 8 16
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_trt.serve.client import generate_remote  # noqa: E402
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


def run_level(url: str, concurrency: int, requests: int, max_tokens: int, policy: str | None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            prompt = PROMPTS[(c * 7 + r) % len(PROMPTS)]
            n = max(8, max_tokens - 8 * ((c + r) % 3))
            try:
                out = generate_remote(url, prompt, max_tokens=n, protocol="grpc", stream=True, policy=policy)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in results)
    taus = [r["stats"].get("tau", 0.0) for r in results if r["stats"]]
    batches = [r["stats"].get("batch", {}).get("mean", 0.0) for r in results if r["stats"]]
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors), "tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall if wall else 0.0, "req_s": len(results) / wall if wall else 0.0,
            "tau": statistics.mean(taus) if taus else 0.0, "batch": statistics.mean(batches) if batches else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, help="model repository to serve (starts and stops a server)")
    p.add_argument("--url", help="gRPC HOST:PORT of a running server (instead of --repo)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=2, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy", default=None, help="K policy (default: the build's)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.repo and not args.url:
        p.error("pass --repo build/NAME/model_repo or --url HOST:GRPC_PORT")
    server = TritonServer(args.repo) if args.repo else None
    try:
        url = server.start().grpc_url if server else args.url
        for _ in range(args.warmup):
            generate_remote(url, PROMPTS[0], max_tokens=8, protocol="grpc", stream=True, policy=args.policy)
        rows = []
        for c in args.concurrency:
            row = run_level(url, c, args.requests, args.max_tokens, args.policy)
            log.info("concurrency %d: %.1f tokens/s (%d requests, %d errors, mean batch %.2f)", c, row["tok_s"],
                     row["requests"], row["errors"], row["batch"])
            rows.append(row)
    finally:
        if server:
            server.stop()
    lines = [f"Machine: {machine()}",
             f"Repo: {args.repo or args.url} · policy {args.policy or 'build default'} · max_tokens {args.max_tokens} "
             f"· {args.requests} request(s)/client · gRPC streaming", "",
             "| concurrency | requests | errors | tokens | wall s | tokens/s | requests/s | mean τ | mean round batch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {r['tokens']} | {r['wall_s']:.2f} | "
                     f"{r['tok_s']:.1f} | {r['req_s']:.2f} | {r['tau']:.2f} | {r['batch']:.2f} |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
