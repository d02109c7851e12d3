#!/usr/bin/env python3
"""Load check for the OpenAI-compatible API: N concurrent streaming clients (the official `openai` SDK, async),
each sending requests back to back for T seconds; reports ok / errors, requests/s, output tokens/s (from the
streamed `usage`), time to first token and latency percentiles. Exit status 1 if any request failed. Sends
$DSPARK_API_KEY as the API key when set (a frontend started with --api-key).

    .venv/bin/python scripts/openai_load.py --base-url http://127.0.0.1:9000/v1 --concurrency 8 --duration 60
    dspark-trt serve --repo build/default/model_repo --openai-port 9000   # the server it talks to
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("openai_load")

PROMPTS = ["Write a Python function that checks whether a number is prime.", "Explain what a hash map is.",
           "List three uses of the os module.", "def fibonacci(n):", "Summarize the rules of chess briefly.",
           "Write a haiku about compilers.", "How do I reverse a list in Python?", "What is speculative decoding?"]


@dataclass
class Tally:
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def one_request(client, args: argparse.Namespace, model: str, i: int, tally: Tally) -> None:  # noqa: ANN001
    prompt = PROMPTS[i % len(PROMPTS)]
    t0 = time.perf_counter()
    first: float | None = None
    usage = None
    common = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                  stream_options={"include_usage": True})
    if args.completions:
        stream = await client.completions.create(prompt=prompt, **common)
    else:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    async for chunk in stream:
        if chunk.choices and first is None:
            piece = chunk.choices[0].text if args.completions else chunk.choices[0].delta.content
            if piece:
                first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    done = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk (stream_options.include_usage)")
    tally.ok += 1
    tally.tokens += usage.completion_tokens
    tally.ttft.append((first or done) - t0)
    tally.latency.append(done - t0)


async def worker(client, args: argparse.Namespace, model: str, w: int, deadline: float, tally: Tally) -> None:  # noqa: ANN001
    i = w
    while time.perf_counter() < deadline:
        try:
            await one_request(client, args, model, i, tally)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            tally.errors[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
        i += args.concurrency


async def main_async(args: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=os.environ.get("DSPARK_API_KEY") or "x",
                                max_retries=0, timeout=args.timeout)
    model = args.model or (await client.models.list()).data[0].id
    tally = Tally()
    t0 = time.perf_counter()
    deadline = t0 + args.duration
    await asyncio.gather(*(worker(client, args, model, w, deadline, tally) for w in range(args.concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    n_err = sum(tally.errors.values())
    return {"base_url": args.base_url, "model": model, "endpoint": "completions" if args.completions else "chat",
            "concurrency": args.concurrency, "duration_s": round(wall, 2), "ok": tally.ok, "errors": n_err,
            "error_kinds": dict(tally.errors), "requests_per_s": round(tally.ok / wall, 3),
            "output_tokens": tally.tokens, "output_tokens_per_s": round(tally.tokens / wall, 2),
            "ttft_ms_p50": round(1e3 * percentile(tally.ttft, 50), 1),
            "ttft_ms_p99": round(1e3 * percentile(tally.ttft, 99), 1),
            "latency_ms_p50": round(1e3 * percentile(tally.latency, 50), 1),
            "latency_ms_p99": round(1e3 * percentile(tally.latency, 99), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base-url", default="http://127.0.0.1:9000/v1", help="OpenAI base URL (default: %(default)s)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streams (default: %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to run (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s = greedy)")
    p.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s (default: %(default)s)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    log.info("%d concurrent streams for %.0f s against %s", args.concurrency, args.duration, args.base_url)
    report = asyncio.run(main_async(args))
    print(json.dumps(report, indent=2))
    return 1 if report["errors"] or not report["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
