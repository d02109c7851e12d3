"""`dspark-trt load`: a soak / load check of a served build — N concurrent streaming clients for T seconds, every
answer checked against its prompt's single-stream answer, then a leak check once the server has stopped.

Owns the command: its bounds (loopback servers only, at most MAX_CLIENTS clients for MAX_DURATION_S), the
reference phase (each prompt's answer streamed alone, one at a time, through the same server), the load phase
(gRPC stream_infer on `ensemble_stream`, one stream per client, requests back to back), the report (ok / wrong /
errors, requests/s, tokens/s, TTFT and inter-token latency p50/p99) and the leak check (serve.server.leftovers:
no process of the server's group, no /dev/shm region it mapped, no dspark_triton_* run directory left).
With --repo it starts and stops its own server; with --url it drives a running one and, given --wait-stop,
waits for it to stop before checking. Exit 0 only when every answer was right, nothing failed, nothing leaked.
`--faults` (with --repo) runs commands.load_faults instead: faults injected under load, each measured.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dspark_trt.commands.load_client import Sample, StreamClient, load_prompts, make_jobs, reference_answers
from dspark_trt.errors import InvalidArgumentError, ServeError

log = logging.getLogger("dspark_trt.load")

MAX_CLIENTS = 256
MAX_DURATION_S = 3600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="gRPC HOST:PORT of a running `dspark-trt serve` on this machine (loopback)")
    where.add_argument("--repo", type=Path, help="a built model repository: start a server on it, load it, stop it")
    p.add_argument("--clients", type=int, default=8, help=f"concurrent streaming clients, 1..{MAX_CLIENTS} (default 8)")
    p.add_argument("--duration", type=float, default=30.0,
                   help=f"seconds of load, ≤ {MAX_DURATION_S:.0f} (default 30); requests in flight then finish")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request at most (default 64; varied -0/8/16)")
    p.add_argument("--policy", default=None, help="K policy of every request (default: the build's)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="prompts, one per line, or JSONL with a \"prompt\" key (default: a built-in set of 16)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--wait-stop", type=float, default=0.0,
                   help="with --url: after the load, wait up to this many seconds for the server to stop, then "
                        "check it left nothing behind (default 0 = no leak check)")
    p.add_argument("--threads", default=None, help="with --repo: the server's --threads (default: auto)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    from dspark_trt.commands.load_faults import add_fault_arguments  # noqa: PLC0415

    add_fault_arguments(p)


def _check_loopback(url: str) -> None:
    host = url.rsplit(":", 1)[0].strip("[]")
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise InvalidArgumentError(f"--url {url!r}: cannot resolve {host!r} ({exc})") from exc
    if not addrs or not all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs):
        raise InvalidArgumentError(f"--url {url!r} is not a loopback address: `dspark-trt load` only drives servers on "
                                   "this machine (127.0.0.1 / localhost)")


def _check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise InvalidArgumentError(f"--clients must be in 1..{MAX_CLIENTS}, got {args.clients}")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise InvalidArgumentError(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds, got {args.duration}")
    if not 1 <= args.max_tokens <= 4096:
        raise InvalidArgumentError(f"--max-tokens must be in 1..4096, got {args.max_tokens}")
    if args.url:
        _check_loopback(args.url)
    if args.wait_stop and not args.url:
        raise InvalidArgumentError("--wait-stop is for --url (with --repo the command stops its own server)")


def run_load(url: str, jobs: list[tuple[str, int]], clients: int, duration: float, policy: str | None,
             timeout: float) -> tuple[list[Sample], float]:
    """`clients` threads, each on its own stream, send requests back to back until `duration` has passed."""
    samples: list[Sample] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration
    start = threading.Barrier(clients + 1)

    def worker(c: int) -> None:
        try:
            client = StreamClient(url, timeout)
        except Exception as exc:  # noqa: BLE001
            with lock:
                samples.append(Sample(-1, error=f"cannot open a stream: {exc}"))
            start.wait()
            return
        start.wait()
        k = c
        try:
            while time.monotonic() < deadline:
                i = k % len(jobs)
                s = client.run(Sample(i), jobs[i][0], jobs[i][1], policy)
                with lock:
                    samples.append(s)
                k += clients
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(c,), name=f"load-{c}", daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    return samples, time.monotonic() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)  # nearest rank
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def summarize(samples: list[Sample], wall: float, refs: list[list[int]], clients: int) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None and s.ids == refs[s.prompt]]
    wrong = [s for s in samples if s.error is None and s.ids != refs[s.prompt]]
    errors = [s for s in samples if s.error is not None]
    ttft = [1e3 * (s.t_first - s.t_send) for s in samples if s.error is None and s.t_first is not None]
    itl = [1e3 * g for s in samples if s.error is None for g in s.gaps]
    tokens = sum(len(s.ids) for s in samples if s.error is None)
    ms = lambda v: None if v is None else round(v, 2)  # noqa: E731
    first_wrong = []
    for s in wrong[:5]:
        ref = refs[s.prompt]
        at = next((j for j, (a, b) in enumerate(zip(s.ids, ref)) if a != b), min(len(s.ids), len(ref)))
        first_wrong.append({"prompt": s.prompt, "first_difference_at": at, "got": len(s.ids), "want": len(ref)})
    return {"clients": clients, "wall_s": round(wall, 2), "requests": len(samples), "ok": len(ok),
            "wrong": len(wrong), "errors": len(errors), "req_per_s": round(len(samples) / wall, 3) if wall else 0.0,
            "tok_per_s": round(tokens / wall, 1) if wall else 0.0, "tokens": tokens,
            "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p99": ms(_pct(ttft, 99))},
            "itl_ms": {"p50": ms(_pct(itl, 50)), "p99": ms(_pct(itl, 99))},
            "first_errors": sorted({s.error or "" for s in errors})[:5], "first_wrong": first_wrong}


def _report(rep: dict[str, Any]) -> str:
    t, i = rep["ttft_ms"], rep["itl_ms"]
    lines = [f"load: {rep['clients']} streaming clients for {rep['wall_s']} s on {rep['target']}",
             "| ok | wrong | errors | requests/s | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | leaks |",
             "|---|---|---|---|---|---|---|---|",
             f"| {rep['ok']} | {rep['wrong']} | {rep['errors']} | {rep['req_per_s']} | {rep['tok_per_s']} | "
             f"{t['p50']} / {t['p99']} | {i['p50']} / {i['p99']} | {rep['leak_check']} |"]
    lines += [f"error: {e}" for e in rep["first_errors"]]
    lines += [f"wrong: prompt {w['prompt']} differs from its single-stream answer at token {w['first_difference_at']} "
              f"({w['got']} vs {w['want']} tokens)" for w in rep["first_wrong"]]
    lines += [f"leak: {x}" for x in rep.get("leaks", [])]
    return "\n".join(lines) + "\n"


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.5)
    return not Path(f"/proc/{pid}").exists()


def run(args: argparse.Namespace) -> int:
    import os  # noqa: PLC0415

    from dspark_trt.serve.server import TritonServer, find_server, footprint, leftovers  # noqa: PLC0415

    _check_args(args)
    if getattr(args, "faults", None) is not None:
        from dspark_trt.commands.load_faults import run_faults  # noqa: PLC0415

        return run_faults(args)
    prompts = load_prompts(args.prompts)
    jobs = make_jobs(prompts, args.max_tokens)
    server = None
    if args.repo:
        env = dict(os.environ, DSPARK_THREADS=str(args.threads)) if args.threads else None
        server = TritonServer(args.repo, env=env).start()
    url = server.grpc_url if server else args.url
    try:
        log.info("reference: %d prompts, one at a time, through %s", len(jobs), url)
        refs = reference_answers(url, jobs, args.policy, args.request_timeout)
        log.info("load: %d clients for %.0f s", args.clients, args.duration)
        samples, wall = run_load(url, jobs, args.clients, args.duration, args.policy, args.request_timeout)
        rep = summarize(samples, wall, refs, args.clients)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    rep["target"] = str(args.repo or args.url)
    rep["leak_check"] = "skipped"
    fp = None
    if server is not None:
        fp = server.footprint()
        server.stop()
    elif args.wait_stop > 0:
        pid = find_server(int(url.rsplit(":", 1)[1]))
        if pid is None:
            log.warning("no tritonserver with --grpc-port=%s found on this machine: leak check skipped", url)
        else:
            fp = footprint(pid)
            log.info("waiting up to %.0f s for the server (pid %d) to stop; stop it now", args.wait_stop, pid)
            if not _wait_gone(pid, args.wait_stop):
                rep["leaks"] = [f"the server (pid {pid}) did not stop within {args.wait_stop:.0f} s"]
                fp = None
                rep["leak_check"] = "failed"
    if fp is not None:
        time.sleep(0.5)  # stubs exit right after the server
        rep["leaks"] = leftovers(fp)
        rep["leak_check"] = "leaks" if rep["leaks"] else "clean"
    sys.stdout.write(json.dumps(rep) + "\n" if args.json else _report(rep))
    bad = rep["wrong"] or rep["errors"] or rep.get("leaks") or not rep["ok"]
    return 1 if bad else 0
