#!/usr/bin/env python3
"""Mixed-traffic soak of a served build (hours, 64 clients): greedy and seeded sampled requests, stop strings,
cancels and client disconnects, chat and long code prompts, through the OpenAI frontend and the `dspark` model's
gRPC stream of one real `dspark-trt serve` (tritonserver + the frontend, under the supervisor).

Owns: the request mix (per request, drawn from a seeded RNG: `greedy`, `stop` — greedy with a stop string cut
from its reference answer —, `seeded` — temperature 0.8, top_p 0.95, a fixed seed per prompt, the fixed K policy
and the DSpark proposer only, so the answer depends on nothing but the request —, `cancel` — a gRPC stream to
`dspark` stopped with tensorrtllm_backend's `stop` request after two responses —, `disconnect` — an OpenAI stream
whose client closes the connection after two chunks), the reference phase (each prompt × kind answered alone,
one at a time, before the load), the checks, the resource samples and the report:

- greedy / stop answers equal their reference text exactly; seeded answers equal theirs when neither ran a round
  with speculation off (the overload switch; counted apart otherwise); a cancelled stream's ids are a prefix of
  the prompt's greedy ids and end with finish_reason `stopped` (or the answer finished first); a disconnect's
  chunks are a prefix of the reference text;
- errors by cause (any exception or status; a `stall`: no chunk for --stall s once streaming; a `hang`: no answer
  within --request-timeout, queueing for a KV slot included); 0 is the pass mark; latency per kind (p50/p99/max);
- RSS and open file descriptors of the serve process (frontend), tritonserver and each python stub, sampled every
  --sample-every s; growth = last sample − the first after --warmup s;
- after the load: `dspark_active_requests` is 0 (no KV slot held); after the stop: nothing of the server left
  (serve.server.leftovers: processes, /dev/shm regions, run directory).

    .venv/bin/python scripts/soak_mixed.py --repo build/default/model_repo --clients 64 --minutes 60 \\
        --json docs/soak-mixed-64x3600.json

Exit 1 on a wrong answer, an error, a held KV slot or a leftover.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("soak_mixed")

KINDS = {"greedy": 0.45, "stop": 0.15, "seeded": 0.20, "cancel": 0.10, "disconnect": 0.10}
CHAT = ["Write a haiku about the sea.", "Explain what a hash map is, briefly.", "List three uses of Python's os module.",
        "What is speculative decoding?", "Give me a recipe for pancakes.", "Summarize the rules of chess.",
        "How do I reverse a list in Python?", "Write a short poem about autumn leaves.",
        "What are the benefits of unit tests?", "Explain recursion to a child."]
SOURCES = ["json/decoder.py", "textwrap.py", "heapq.py", "argparse.py", "functools.py", "shutil.py"]
CODE_CHARS = (80, 400, 1500, 4000)  # prompt lengths: ~25 to ~1,200 tokens
SEED_BASE = 7_000


@dataclass(frozen=True)
class Prompt:
    """One prompt of the set: a chat message (chat endpoint) or a code prefix (completions endpoint)."""

    key: int
    text: str
    chat: bool
    max_tokens: int


class Stalled(Exception):
    """A request that stopped moving (cause "stall") or never finished (cause "hang")."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)  # (kind, outcome) → n
    errors: Counter = field(default_factory=Counter)  # cause → n
    examples: list[str] = field(default_factory=list)
    tokens: int = 0
    seconds: dict[str, list[float]] = field(default_factory=dict)  # kind → latency of each answered request

    def took(self, kind: str, s: float) -> None:
        self.seconds.setdefault(kind, []).append(s)

    def latency(self) -> dict[str, dict[str, float]]:
        out = {}
        for kind, xs in sorted(self.seconds.items()):
            xs = sorted(xs)
            out[kind] = {"n": len(xs), "p50": round(xs[len(xs) // 2], 1),
                         "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1), "max": round(xs[-1], 1)}
        return out

    def fail(self, kind: str, cause: str, detail: str) -> None:
        self.errors[f"{kind}: {cause}"] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {cause}: {detail[:300]}")


def prompt_set(code_prompts: int) -> list[Prompt]:
    """CHAT messages and code prefixes of varied length cut from the standard library's sources."""
    import sysconfig  # noqa: PLC0415

    lib = Path(sysconfig.get_paths()["stdlib"])
    out = [Prompt(i, t, True, (32, 48, 64, 96)[i % 4]) for i, t in enumerate(CHAT)]
    for j in range(code_prompts):
        src = (lib / SOURCES[j % len(SOURCES)]).read_text()
        n = CODE_CHARS[j % len(CODE_CHARS)]
        start = src.find("\ndef ", (j * 997) % max(1, len(src) - n)) + 1
        out.append(Prompt(len(out), src[start:start + n], False, (24, 48, 64, 80)[j % 4]))
    return out


class Soak:
    """The clients and checks against one running server (OpenAI base URL + Triton gRPC URL)."""

    def __init__(self, base_url: str, grpc_url: str, repo: Path, prompts: list[Prompt], timeout: float,
                 stall_s: float) -> None:
        import openai  # noqa: PLC0415

        from dspark_trt.serve.clients.aio_client import DsparkAioClient  # noqa: PLC0415
        from dspark_trt.runtime.hf_loader import load_tokenizer  # noqa: PLC0415

        self.oai = openai.AsyncOpenAI(base_url=base_url, api_key=os.environ.get("DSPARK_API_KEY") or "x",
                                      max_retries=0, timeout=timeout)
        self.aio = DsparkAioClient(grpc_url, timeout=timeout)
        self.tok = load_tokenizer(repo.resolve().parent / "tokenizer")
        self.prompts, self.timeout, self.stall_s, self.model = prompts, timeout, stall_s, ""
        self.ref: dict[tuple[str, int], Any] = {}  # (kind, prompt key) → reference answer
        self.tally = Tally()
        self.records: list[dict[str, Any]] = []  # one per request of the load: kind, prompt, start, first, total
        self.t_load = 0.0

    # ---- one request of each kind: returns (text or ids, stats) ----
    async def openai_text(self, p: Prompt, extra: dict[str, Any], stop: str | None = None,
                          close_after: int | None = None, trace: list[float] | None = None,
                          ) -> tuple[str, dict[str, Any] | None]:
        common: dict[str, Any] = dict(model=self.model, max_tokens=p.max_tokens, stream=True, extra_body=extra,
                                      stop=[stop] if stop else None)
        if p.chat:
            stream = await self.oai.chat.completions.create(messages=[{"role": "user", "content": p.text}], **common)
        else:
            stream = await self.oai.completions.create(prompt=p.text, **common)
        parts: list[str] = []
        stats = None
        n = 0
        try:
            async for chunk in stream:
                stats = (chunk.model_extra or {}).get("dspark_stats") or stats
                if trace is not None:
                    trace.append(time.monotonic())
                if chunk.choices:
                    piece = chunk.choices[0].delta.content if p.chat else chunk.choices[0].text
                    parts.append(piece or "")
                    n += 1
                    if close_after is not None and n >= close_after:
                        break
        finally:
            await stream.close()  # a disconnect: the connection goes away mid-body
        return "".join(parts), stats

    def ids_of(self, p: Prompt) -> list[int]:
        from dspark_trt.serve.text import encode_prompt  # noqa: PLC0415 - the `dspark` model's own tokenization

        return encode_prompt(self.tok, p.text, p.chat, 1 << 20)

    async def grpc_ids(self, p: Prompt, cancel_after: int | None, trace: list[float] | None = None,
                       ) -> tuple[list[int], str | None]:
        from dspark_trt.serve.clients.client import GenerationRequest  # noqa: PLC0415

        rid = f"soak-{uuid.uuid4().hex[:12]}"
        req = GenerationRequest(prompt="", max_tokens=p.max_tokens, temperature=0.0, return_stats=False)
        ids: list[int] = []
        reason = None
        n = 0
        async for chunk in self.aio.stream(self.ids_of(p), req, rid):
            if trace is not None:
                trace.append(time.monotonic())
            ids += chunk.ids
            n += 1
            reason = chunk.finish_reason
            if cancel_after is not None and n == cancel_after and not chunk.final:
                await self.aio.stop(rid)
        return ids, reason

    async def ask(self, kind: str, p: Prompt, trace: list[float] | None = None) -> Any:
        seeded = {"temperature": 0.8, "top_p": 0.95, "seed": SEED_BASE + p.key, "policy": "fixed",
                  "proposers": "dspark", "return_stats": True}
        greedy = {"temperature": 0.0}
        if kind == "greedy":
            return (await self.openai_text(p, greedy, trace=trace))[0]
        if kind == "stop":
            return (await self.openai_text(p, greedy, stop=self.ref[("stop_word", p.key)], trace=trace))[0]
        if kind == "seeded":
            return await self.openai_text(p, {k: v for k, v in seeded.items() if k != "seed"} | {"seed": seeded["seed"]},
                                          trace=trace)
        if kind == "cancel":
            return await self.grpc_ids(p, cancel_after=2, trace=trace)
        if kind == "disconnect":
            return (await self.openai_text(p, greedy, close_after=2, trace=trace))[0]
        raise ValueError(kind)

    async def references(self) -> None:
        """Every prompt's answers alone, one request at a time."""
        self.model = (await self.oai.models.list()).data[0].id
        for p in self.prompts:
            text = await self.ask("greedy", p)
            self.ref[("greedy", p.key)] = text
            words = [w for w in text.split() if len(w) >= 3]
            self.ref[("stop_word", p.key)] = words[len(words) // 2] if words else "\n"
            self.ref[("stop", p.key)] = await self.ask("stop", p)
            self.ref[("seeded", p.key)] = await self.ask("seeded", p)
            self.ref[("ids", p.key)] = (await self.grpc_ids(p, None))[0]
        log.info("references: %d prompts × greedy / stop / seeded / ids", len(self.prompts))

    def check(self, kind: str, p: Prompt, got: Any) -> None:
        t = self.tally
        if kind in ("greedy", "stop"):
            ok = got == self.ref[(kind, p.key)]
        elif kind == "seeded":
            (text, stats), (rtext, rstats) = got, self.ref[("seeded", p.key)]
            off = (stats or {}).get("speculation_off_rounds", 0) or (rstats or {}).get("speculation_off_rounds", 0)
            if off:
                t.counts[(kind, "speculation_off")] += 1
                return
            ok = text == rtext
        elif kind == "cancel":
            ids, reason = got
            ref = self.ref[("ids", p.key)]
            ok = ids == ref[:len(ids)] and (reason == "stopped" or ids == ref)
        else:  # disconnect
            ok = self.ref[("greedy", p.key)].startswith(got)
        t.counts[(kind, "ok" if ok else "wrong")] += 1
        if not ok:
            t.fail(kind, "wrong answer", f"prompt {p.key}: got {str(got)[:120]!r}")

    async def client(self, w: int, deadline: float, rng: random.Random) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            p = rng.choice(self.prompts)
            trace: list[float] = []
            t0 = time.monotonic()
            try:
                got = await self.watched(self.ask(kind, p, trace), trace, t0)
            except Stalled as exc:
                self.tally.fail(kind, exc.cause, f"{exc} (prompt {p.key}, {len(trace)} chunks)")
                continue
            except Exception as exc:  # noqa: BLE001 - counted by cause and reported
                self.tally.fail(kind, type(exc).__name__, str(exc))
                continue
            self.tally.took(kind, time.monotonic() - t0)
            self.records.append({"kind": kind, "prompt": p.key, "start": round(t0 - self.t_load, 2),
                                 "first": round(trace[0] - t0, 2) if trace else None,
                                 "total": round(time.monotonic() - t0, 2), "chunks": len(trace)})
            self.check(kind, p, got)

    async def watched(self, coro: Any, trace: list[float], t0: float) -> Any:
        """Await one request, watching its progress: no chunk for `stall_s` after one arrived → Stalled("stall");
        no answer within `self.timeout` → Stalled("hang"). A request queued for a KV slot may wait long for its
        first chunk under overload (slots < clients); once streaming, a gap of stall_s means it stopped moving."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=5.0)
                if done:
                    return task.result()
                now = time.monotonic()
                if trace and now - trace[-1] > self.stall_s:
                    raise Stalled("stall", f"no chunk for {now - trace[-1]:.0f} s after chunk {len(trace)} "
                                           f"(first at {trace[0] - t0:.0f} s)")
                if now - t0 > self.timeout:
                    first = f"first chunk at {trace[0] - t0:.0f} s" if trace else "no chunk"
                    raise Stalled("hang", f"no answer within {self.timeout:.0f} s ({first})")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def run(self, clients: int, seconds: float, seed: int) -> float:
        t0 = self.t_load = time.monotonic()
        await asyncio.gather(*(self.client(w, t0 + seconds, random.Random(seed * 1000 + w)) for w in range(clients)))
        return time.monotonic() - t0

    async def close(self) -> None:
        await self.oai.close()
        await self.aio.close()


def first_chunk(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """kind → p50 / p99 / max seconds to the first chunk (queueing for a KV slot and prefill)."""
    out = {}
    for kind in sorted({r["kind"] for r in records}):
        xs = sorted(r["first"] for r in records if r["kind"] == kind and r["first"] is not None)
        if xs:
            out[kind] = {"p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max": xs[-1]}
    return out


# ---- the server and its resources --------------------------------------------------------------------------------
def proc_sample(pid: int) -> tuple[float, int]:
    """(RSS MiB, open fds) of one process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def sample(serve_pid: int, grpc_port: int) -> dict[str, tuple[float, int]]:
    from dspark_trt.serve.server import find_server, stubs  # noqa: PLC0415

    out: dict[str, tuple[float, int]] = {}
    try:
        out["serve (frontend)"] = proc_sample(serve_pid)
        tpid = find_server(grpc_port)
        if tpid is not None:
            out["tritonserver"] = proc_sample(tpid)
            for s in stubs(tpid):
                out[f"stub {s.model}"] = proc_sample(s.pid)
    except OSError as exc:
        log.warning("resource sample failed: %s", exc)
    return out


def active_requests(metrics_url: str) -> float:
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    vals = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith("dspark_active_requests")]
    return sum(vals)


async def sampler(serve_pid: int, grpc_port: int, every: float, stop: asyncio.Event,
                  samples: list[tuple[float, dict[str, tuple[float, int]]]]) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - t0, sample(serve_pid, grpc_port)))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


def growth(samples: list[tuple[float, dict[str, tuple[float, int]]]], warmup: float) -> dict[str, dict[str, float]]:
    base = next((s for t, s in samples if t >= warmup), samples[0][1])
    last = samples[-1][1]
    return {name: {"rss_mib_after_warmup": round(base[name][0], 1), "rss_mib_end": round(last[name][0], 1),
                   "rss_growth_mib": round(last[name][0] - base[name][0], 1), "fds_after_warmup": base[name][1],
                   "fds_end": last[name][1]} for name in base if name in last}


def rss_series(samples: list[tuple[float, dict[str, tuple[float, int]]]], points: int = 13) -> dict[str, list]:
    """The RSS of each process at up to `points` evenly spaced samples: [[t s, MiB], ...] (flat, a plateau or a
    climb tell apart what one growth number cannot)."""
    if not samples:
        return {}
    step = max(1, (len(samples) - 1) // (points - 1))
    picked = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    names = sorted({n for _, s in samples for n in s})
    return {n: [[round(t), round(s[n][0], 1)] for t, s in picked if n in s] for n in names}


def start_server(repo: Path, threads: str | None) -> tuple[subprocess.Popen, dict[str, str]]:
    from dspark_trt.serve.server import free_port  # noqa: PLC0415

    ports = {k: str(free_port()) for k in ("http", "grpc", "metrics", "openai")}
    cmd = [sys.executable, "-m", "dspark_trt.cli", "serve", "--repo", str(repo), "--http-port", ports["http"],
           "--grpc-port", ports["grpc"], "--metrics-port", ports["metrics"], "--openai-port", ports["openai"],
           *(["--threads", threads] if threads else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY"):
            log.info("%s", line.strip())
            return proc, ports
    raise SystemExit(f"dspark-trt serve exited ({proc.wait()}) before READY")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from dspark_trt.serve.server import find_server, footprint, leftovers  # noqa: PLC0415

    proc, ports = start_server(args.repo, args.threads)
    report: dict[str, Any] = {"repo": str(args.repo), "clients": args.clients, "minutes": args.minutes, "mix": KINDS}
    try:
        fp = footprint(find_server(int(ports["grpc"])) or 0)
        prompts = prompt_set(args.code_prompts)
        soak = Soak(f"http://127.0.0.1:{ports['openai']}/v1", f"127.0.0.1:{ports['grpc']}", args.repo, prompts,
                    args.request_timeout, args.stall)
        t_ref = time.monotonic()
        await soak.references()
        report["reference_s"] = round(time.monotonic() - t_ref, 1)
        samples: list[tuple[float, dict[str, tuple[float, int]]]] = []
        stop = asyncio.Event()
        task = asyncio.create_task(sampler(proc.pid, int(ports["grpc"]), args.sample_every, stop, samples))
        wall = await soak.run(args.clients, args.minutes * 60, args.seed)
        stop.set()
        await task
        await asyncio.sleep(2.0)  # the last cancels' stop requests land
        held = active_requests(f"http://127.0.0.1:{ports['metrics']}/metrics")
        await soak.close()
        t = soak.tally
        if args.requests_log:
            args.requests_log.write_text("".join(json.dumps(r) + "\n" for r in soak.records))
        report.update({
            "prompts": len(prompts), "prompt_chars": [min(len(p.text) for p in prompts), max(len(p.text) for p in prompts)],
            "wall_s": round(wall, 1), "requests": sum(t.counts.values()) + sum(t.errors.values()),
            "by_kind": {f"{k} {o}": n for (k, o), n in sorted(t.counts.items())},
            "wrong": sum(n for (k, o), n in t.counts.items() if o == "wrong"), "errors": dict(t.errors),
            "latency_s": t.latency(), "first_chunk_s": first_chunk(soak.records), "examples": t.examples, "kv_slots_held": held, "resources": growth(samples, args.warmup),
            "samples": len(samples), "rss_series_mib": rss_series(samples)})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    report["leftovers"] = leftovers(fp)
    report["requests_per_s"] = round(report.get("requests", 0) / max(report.get("wall_s", 1), 1e-9), 2)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, required=True, help="built model repository to serve")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--minutes", type=float, default=60.0, help="minutes of load (default 60)")
    p.add_argument("--code-prompts", type=int, default=14, help="code prompts beside the 10 chat ones (default 14)")
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds a request may take, queueing for a KV slot included (default 1800)")
    p.add_argument("--stall", type=float, default=120.0,
                   help="seconds without a chunk, once streaming, that count as a stalled request (default 120)")
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds between resource samples (default 30)")
    p.add_argument("--warmup", type=float, default=300.0, help="growth is measured from this many s in (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    p.add_argument("--mix", default=None, help="KIND=WEIGHT,... replacing the default mix "
                                               f"({','.join(f'{k}={w}' for k, w in KINDS.items())})")
    p.add_argument("--threads", default=None, help="the server's --threads (default: auto)")
    p.add_argument("--json", type=Path, default=None, help="also write the report to this file")
    p.add_argument("--requests-log", type=Path, default=None,
                   help="write one JSON line per answered request (kind, prompt, start, first chunk, total s)")
    args = p.parse_args(argv)
    if args.mix:
        mix = {k.strip(): float(w) for k, w in (part.split("=") for part in args.mix.split(","))}
        if set(mix) - set(KINDS) or not any(mix.values()):
            p.error(f"--mix: kinds are {', '.join(KINDS)} with weights > 0")
        KINDS.clear()
        KINDS.update(mix)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    bad = report.get("wrong", 1) or report.get("errors") or report.get("kv_slots_held", 1) or report["leftovers"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
