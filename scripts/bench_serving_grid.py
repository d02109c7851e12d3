#!/usr/bin/env python
"""DSpark under load: a concurrency × K-policy grid through the real Triton deployment, every answer checked.

Each cell is `concurrency` clients, each its own gRPC stream to `ensemble_stream`, sending --requests-per-cell
greedy requests back to back from a mixed prompt set (short chat prompts through the chat template, and long
code contexts cut from this repository's sources, so long prefills and decoding share rounds). Per cell: output
tok/s and req/s over the cell's wall time, TTFT and ITL p50/p99 (ITL per token: the gap between two streamed
responses over the tokens in the later one, as `dspark-trt load`), mean K and τ, and the K each policy chose per
round by the batch size of that round (the `stats` of each request: k_per_round, batch_per_round). Every answer
is compared with the same prompt's single-stream answer (plain policy, one request at a time, through the same
server, before the grid); mismatches are counted and the first differences reported; exit status 1 on any
mismatch or error. Policies: plain, fixed0 (the DSpark path, K ≡ 0), fixed3 (fixed K = 3), fixedg (fixed K = γ),
confidence, survival, and survival+suffix. Every row names its proposers in each request (the `proposers` input,
serve.validate check_proposers), so all rows run on one server, started here with --repo or named with --url: plain
none (the plain policy proposes nothing), the K-policy rows "dspark" (DSpark alone, as their names say: a
greedy request naming none would get both by default), survival+suffix "dspark,suffix". Each cell also reports the
proposers its requests were allowed (stats proposers_allowed) and the rounds / offered tokens per proposer (stats
proposers). Cells run level by level, each policy in turn, so machine load drifts hit every policy alike.
Results: grid.json, grid.md (the tables, the machine, commit and load average) and grid.png (throughput vs
concurrency per policy; ITL vs throughput) under --out.

  .venv/bin/python scripts/bench_serving.py --grid --quick --repo build/default/model_repo           # ~2 min
  .venv/bin/python scripts/bench_serving.py --grid --repo build/default/model_repo \\
      --concurrency 1 2 4 8 16 32 64 --policies plain fixed3 fixedg confidence survival survival+suffix \\
      --requests-per-cell 4 --max-tokens 128                                       # the docs/serving.md grid
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_grid_report import write_outputs  # noqa: E402

from dspark_trt.commands.load_client import StreamClient as LoadStreamClient  # noqa: E402
from dspark_trt.errors import InvalidArgumentError, ServeError  # noqa: E402

log = logging.getLogger("bench_serving_grid")

MODEL = "ensemble_stream"
HYBRID = "survival+suffix"
DSPARK, BOTH = "dspark", "dspark,suffix"  # the rows' `proposers` fields: DSpark alone, DSpark block + suffix match
POLICY_NAMES = ("plain", "fixed0", "fixed3", "fixedg", "confidence", "survival", HYBRID, "suffix", "default")
QUICK = {"concurrency": [1, 4], "policies": ["plain", "survival"], "requests_per_cell": 2, "max_tokens": 32,
         "long_tokens": 256}
CHAT = ("Write a Python function that checks whether a number is prime.", "Explain what a hash map is.",
        "List three uses of the os module in Python.", "What is speculative decoding?",
        "Write a haiku about compilers.", "How do I reverse a list in Python?",
        "Summarize the rules of chess in three sentences.", "Give two tips for writing readable code.")
CODE_SOURCES = ("dspark_trt/spec_decode/accept.py", "dspark_trt/spec_decode/suffix.py",
                "dspark_trt/runtime/kv_cache.py", "dspark_trt/serve/text.py")


@dataclass(frozen=True)
class Job:
    """One prompt of the mixed set."""

    kind: str  # "chat" (short, chat template) | "code" (long context, raw text)
    prompt: str
    chat: bool
    max_tokens: int


@dataclass(frozen=True)
class PolicySpec:
    """A grid row: the request's policy inputs, its proposers among them (the `proposers` field; None: not sent)."""

    name: str
    policy: str
    min_k: int | None = None
    max_k: int | None = None
    proposers: str | None = None  # "dspark" | "suffix" | "dspark,suffix" (serve.validate.check_proposers); None:
    # not sent (plain, or the server's default: both when greedy, the suffix alone for a seeded sampled request)
    temperature: float = 0.0  # > 0: every request samples, job i with seed seed_base + i (references alike)
    seed_base: int = 0

    @property
    def exact(self) -> bool:
        """Whether its answers must equal the single-stream plain answers token for token: always when greedy;
        when sampling, unless DSpark drafts its rounds (a DSpark round keeps the distribution, not the seed's
        tokens; a suffix round commits plain sampling's tokens)."""
        return self.temperature <= 0 or self.max_k == 0 or "dspark" not in (self.proposers or "suffix")


@dataclass
class Sample:
    """One request of a cell: what came back and when (monotonic seconds)."""

    job: int
    ids: list[int] = field(default_factory=list)
    t_send: float = 0.0
    t_first: float | None = None
    t_done: float = 0.0
    gaps: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def policy_specs(names: Sequence[str], gamma: int, min_k: int, temperature: float = 0.0,
                 seed_base: int = 0) -> list[PolicySpec]:
    """Grid rows for `names` (POLICY_NAMES) on a build with draft block γ and default MIN_K; temperature > 0: every
    row samples (job i seeded seed_base + i)."""
    table = {"plain": PolicySpec("plain", "plain"),
             # fixed0: the DSpark request path with K ≡ 0 (no draft, one token a round): its overhead against plain
             "fixed0": PolicySpec("fixed0", "fixed", 0, 0, proposers=DSPARK),
             "fixed3": PolicySpec("fixed3", "fixed", min(min_k, 3), min(3, gamma), proposers=DSPARK),
             "fixedg": PolicySpec("fixedg", "fixed", min(min_k, gamma), gamma, proposers=DSPARK),
             "confidence": PolicySpec("confidence", "confidence", proposers=DSPARK),
             "survival": PolicySpec("survival", "survival", proposers=DSPARK),
             HYBRID: PolicySpec(HYBRID, "survival", proposers=BOTH),
             "suffix": PolicySpec("suffix", "survival", proposers="suffix"),
             # default: no `proposers` field, the server's choice
             "default": PolicySpec("default", "survival")}
    bad = [n for n in names if n not in table]
    if bad:
        raise InvalidArgumentError(f"--policies: unknown {bad}; choose from {', '.join(POLICY_NAMES)}")
    return [replace(table[n], temperature=temperature, seed_base=seed_base) for n in names]


def serve_config(url: str | None = None, repo: Path | None = None) -> Any:
    """The `dspark` model's limits (serve.config.ServeConfig) from the running server at `url`, or from the
    repository's dspark/config.pbtxt."""
    from dspark_trt.serve.config import ServeConfig  # noqa: PLC0415

    if repo is not None:
        from google.protobuf import json_format, text_format  # noqa: PLC0415
        from tritonclient.grpc import model_config_pb2  # noqa: PLC0415

        path = Path(repo) / "dspark" / "config.pbtxt"
        if not path.is_file():
            raise ServeError(f"{path} is missing: pass the model repository written by `dspark-trt build`")
        msg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        return ServeConfig.from_model_config(json_format.MessageToDict(msg, preserving_proto_field_name=True))
    import tritonclient.grpc as grpcclient  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(url)
    try:
        raw = client.get_model_config("dspark", as_json=True, client_timeout=30.0)
    finally:
        client.close()
    return ServeConfig.from_model_config(dict(raw.get("config", raw)))


def export_aiperf(path: Path, jobs: list[Job]) -> None:
    """The mixed prompt set as an AIPerf single_turn dataset (one {"text": ...} per line; AIPerf's chat endpoint
    sends every one as a user message, so the code contexts go through the chat template too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": j.prompt}) + "\n" for j in jobs), encoding="utf-8")
    log.info("wrote %d prompts (%d chat, %d code) to %s", len(jobs), sum(j.kind == "chat" for j in jobs),
             sum(j.kind == "code" for j in jobs), path)


def make_jobs(tokenizer: Any, room: int, max_tokens: int, long_tokens: int) -> list[Job]:
    """8 short chat prompts and 4 long code contexts, interleaved chat, code, chat (so every level mixes them); a
    code context is the first `long_tokens` tokens of a source file (clipped to fit room − max_tokens)."""
    root = Path(__file__).resolve().parents[1]
    n_code = max(8, min(long_tokens, room - max_tokens - 16))
    codes = []
    for src in CODE_SOURCES:
        ids = tokenizer((root / src).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:n_code]
        codes.append(tokenizer.decode(ids))
    jobs: list[Job] = []
    for i, chat in enumerate(CHAT):
        jobs.append(Job("chat", chat, True, max_tokens))
        if i % 2 == 0:
            jobs.append(Job("code", codes[(i // 2) % len(codes)], False, max_tokens))
    return jobs


class StreamClient(LoadStreamClient):
    """One gRPC stream to `ensemble_stream` (commands.load_client's); requests one after another on it, asking for
    output_ids and stats."""

    def run(self, index: int, job: Job, spec: PolicySpec) -> Sample:
        from dspark_trt.serve.clients.client import GenerationRequest  # noqa: PLC0415

        req = GenerationRequest(prompt=job.prompt, max_tokens=job.max_tokens, stream=True, policy=spec.policy,
                                min_k=spec.min_k, max_k=spec.max_k, apply_chat_template=job.chat,
                                return_stats=True, temperature=spec.temperature, proposers=spec.proposers,
                                random_seed=spec.seed_base + index if spec.temperature > 0 else None)
        return self.send(Sample(index), req, stats=True)


def cell_jobs(concurrency: int, requests: int, n_jobs: int) -> list[list[int]]:
    """Per client, the job indices it sends: client c's r-th request is job (c + r·concurrency) mod n_jobs."""
    return [[(c + r * concurrency) % n_jobs for r in range(requests)] for c in range(concurrency)]


def run_cell(url: str, jobs: list[Job], spec: PolicySpec, concurrency: int, requests: int,
             timeout: float) -> tuple[list[Sample], float]:
    """`concurrency` clients on their own streams, `requests` each back to back → (samples, wall seconds)."""
    samples: list[Sample] = []
    lock = threading.Lock()
    start = threading.Barrier(concurrency + 1)
    plan = cell_jobs(concurrency, requests, len(jobs))

    def worker(c: int) -> None:
        try:
            client = StreamClient(url, timeout)
        except Exception as exc:  # noqa: BLE001
            with lock:
                samples.extend(Sample(i, error=f"cannot open a stream: {exc}") for i in plan[c])
            start.wait()
            return
        start.wait()
        try:
            for i in plan[c]:
                s = client.run(i, jobs[i], spec)
                with lock:
                    samples.append(s)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(c,), name=f"grid-{c}", daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    return samples, time.monotonic() - t0


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, -(-int(q * len(v)) // 100) - 1))]


def batch_bucket(b: int) -> str:
    """Batch size → its power-of-two bucket label ("1", "2-3", "4-7", …)."""
    lo = 1 << (max(1, b).bit_length() - 1)
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


def summarize_cell(samples: list[Sample], wall: float, refs: dict[int, list[int]], jobs: list[Job],
                   exact: bool = True) -> dict[str, Any]:
    """One cell's numbers; `refs`: job index → its single-stream answer; exact: a different answer is wrong (else
    counted as `other_draws`: a sampled row whose rounds DSpark drafts)."""
    good = [s for s in samples if s.error is None]
    differ = [s for s in good if s.ids != refs[s.job]]
    wrong = differ if exact else []
    ms = lambda v: None if v is None else round(1e3 * v, 2)  # noqa: E731
    ttft = [s.t_first - s.t_send for s in good if s.t_first is not None]
    itl = [g for s in good for g in s.gaps]
    tokens = sum(len(s.ids) for s in good)
    k_by_batch: dict[str, list[float]] = {}
    ks: list[int] = []
    taus = []
    allowed: set[str] = set()
    by_proposer: dict[str, dict[str, int]] = {}
    for s in good:
        if "proposers_allowed" in s.stats:
            allowed.add(",".join(s.stats["proposers_allowed"]) or "none")
        for name, ps in s.stats.get("proposers", {}).items():
            acc_p = by_proposer.setdefault(name, {"rounds": 0, "proposed_tokens": 0, "accepted_tokens": 0})
            for key in acc_p:
                acc_p[key] += int(ps.get(key, 0))
        k_rounds = s.stats.get("k_per_round", [])
        b_rounds = s.stats.get("batch_per_round", [])
        ks.extend(k_rounds)
        for k, b in zip(k_rounds, b_rounds):
            acc = k_by_batch.setdefault(batch_bucket(int(b)), [0.0, 0])
            acc[0] += k
            acc[1] += 1
        if "tau" in s.stats:
            taus.append(float(s.stats["tau"]))
    first_wrong = []
    for s in wrong[:5]:
        ref = refs[s.job]
        at = next((j for j, (a, b) in enumerate(zip(s.ids, ref)) if a != b), min(len(s.ids), len(ref)))
        first_wrong.append({"job": s.job, "kind": jobs[s.job].kind, "first_difference_at": at, "got": len(s.ids),
                            "want": len(ref)})
    return {"requests": len(samples), "ok": len(good) - len(differ), "wrong": len(wrong),
            "other_draws": len(differ) - len(wrong),
            "errors": len(samples) - len(good), "wall_s": round(wall, 3), "tokens": tokens,
            "prompt_kinds": {k: sum(jobs[s.job].kind == k for s in samples) for k in ("chat", "code")},
            "tok_s": round(tokens / wall, 2) if wall else 0.0, "req_s": round(len(good) / wall, 3) if wall else 0.0,
            "ttft_ms": {"p50": ms(pct(ttft, 50)), "p99": ms(pct(ttft, 99))},
            "ttft_ms_by_kind": {k: {"p50": ms(pct(v, 50)), "p99": ms(pct(v, 99))} for k, v in (
                (kind, [s.t_first - s.t_send for s in good if s.t_first is not None and jobs[s.job].kind == kind])
                for kind in ("chat", "code")) if v},
            "itl_ms": {"p50": ms(pct(itl, 50)), "p99": ms(pct(itl, 99))},
            "mean_k": round(sum(ks) / len(ks), 3) if ks else 0.0, "rounds": len(ks),
            "tau": round(sum(taus) / len(taus), 3) if taus else 0.0,
            "proposers_allowed": sorted(allowed), "by_proposer": dict(sorted(by_proposer.items())),
            "k_by_batch": {b: {"mean_k": round(v[0] / v[1], 3), "rounds": int(v[1])}
                           for b, v in sorted(k_by_batch.items(), key=lambda kv: int(kv[0].split("-")[0]))},
            "first_errors": sorted({s.error or "" for s in samples if s.error})[:3], "first_wrong": first_wrong}


def reference_answers(url: str, jobs: list[Job], needed: set[int], timeout: float,
                      plain: PolicySpec = PolicySpec("plain", "plain")) -> dict[int, list[int]]:
    """Each needed job's answer alone (plain policy — sampled as `plain` says —, one request at a time) through the
    server at `url`."""
    client = StreamClient(url, timeout)
    try:
        out = {}
        for i in sorted(needed):
            s = client.run(i, jobs[i], plain)
            if s.error:
                raise ServeError(f"the single-stream answer of job {i} ({jobs[i].kind}) failed: {s.error}; check the "
                                 "server log")
            out[i] = s.ids
        return out
    finally:
        client.close()


def run_grid(url: str, specs: list[PolicySpec], levels: list[int], requests: int, jobs: list[Job],
             timeout: float, rounds: int = 1) -> dict[str, Any]:
    """The references, then every (concurrency, policy) cell, level by level, policies in turn, all through the
    server at `url` (each row's proposers travel in its requests). rounds > 1: each level runs the policies `rounds`
    times, the order rotated every round (so no row is always first after a level change); a cell pools its rounds'
    requests over their summed wall time and keeps each round's tok/s (`tok_s_rounds`: the spread)."""
    needed = {i for c in levels for plan in cell_jobs(c, requests, len(jobs)) for i in plan}
    log.info("reference: %d prompts alone through %s", len(needed), url)
    refs = reference_answers(url, jobs, needed, timeout, replace(specs[0], name="plain", policy="plain", min_k=None,
                                                                 max_k=None, proposers=None))
    cells: list[dict[str, Any]] = []
    n = len(specs)
    for c in levels:
        pooled: list[tuple[list[Sample], list[float], list[float]]] = [([], [], []) for _ in specs]
        for r in range(rounds):
            for j in [(r + i) % n for i in range(n)]:
                samples, wall = run_cell(url, jobs, specs[j], c, requests, timeout)
                pooled[j][0].extend(samples)
                pooled[j][1].append(wall)
                pooled[j][2].append(round(sum(len(x.ids) for x in samples if x.error is None) / max(wall, 1e-9), 2))
                if rounds > 1:
                    log.info("c=%d %s round %d: %.1f tok/s", c, specs[j].name, r + 1, pooled[j][2][-1])
        for spec, (samples, walls, per_round) in zip(specs, pooled):
            cell = dict(policy=spec.name, concurrency=c, **summarize_cell(samples, sum(walls), refs, jobs, spec.exact))
            if rounds > 1:
                cell["tok_s_rounds"] = per_round
            log.info("c=%d %s: %.1f tok/s, TTFT p50 %s ms, ITL p50 %s ms, mean K %.2f, wrong %d, errors %d", c,
                     spec.name, cell["tok_s"], cell["ttft_ms"]["p50"], cell["itl_ms"]["p50"], cell["mean_k"],
                     cell["wrong"], cell["errors"])
            cells.append(cell)
    return {"cells": cells, "jobs": [{"kind": j.kind, "chars": len(j.prompt), "max_tokens": j.max_tokens}
                                     for j in jobs],
            "references": {str(i): v for i, v in refs.items()}}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--repo", type=Path, help="model repository (build/NAME/model_repo): start its server here")
    where.add_argument("--url", help="gRPC HOST:PORT of a running server (every row; each request names its "
                                     "proposers, so the server's DSPARK_PROPOSERS does not matter)")
    p.add_argument("--quick", action="store_true", help=f"a ~2-minute smoke grid: {QUICK} (flags given override)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="client counts (default 1 2 4 8 16 32 64)")
    p.add_argument("--policies", nargs="+", default=None, help=f"rows, of {' '.join(POLICY_NAMES)} (default all)")
    p.add_argument("--requests-per-cell", type=int, default=None, help="requests per client per cell (default 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of every request (default 128)")
    p.add_argument("--long-tokens", type=int, default=None,
                   help="tokens of a long code context (default 1024, clipped to the build's room)")
    p.add_argument("--threads", default=None, help="with --repo: the server's DSPARK_THREADS (default: auto)")
    p.add_argument("--suffix-recent-tokens", type=int, default=None,
                   help="with --repo: the server's DSPARK_SUFFIX_RECENT_TOKENS; 0 = no cross-request suffix index, so the "
                        "grid's repeated prompts cannot copy earlier answers (the suffix rows then measure new traffic)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every request at this temperature (default 0: greedy); job i seeded --seed + i in "
                        "every row and in the references")
    p.add_argument("--seed", type=int, default=1, help="the first job's sampling seed (with --temperature)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each level's policies this many times, order rotated; cells pool their rounds")
    p.add_argument("--out", type=Path, default=None, help="results folder (default runs/bench_serving/<UTC stamp>)")
    p.add_argument("--no-plot", action="store_true", help="skip grid.png (no matplotlib needed)")
    p.add_argument("--export-aiperf", type=Path, default=None, metavar="JSONL",
                   help="only write the mixed prompt set as an AIPerf single_turn dataset and exit (no server started)")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else {"concurrency": [1, 2, 4, 8, 16, 32, 64], "policies": list(POLICY_NAMES),
                                         "requests_per_cell": 4, "max_tokens": 128, "long_tokens": 1024}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if any(c < 1 or c > 256 for c in args.concurrency) or args.requests_per_cell < 1 or args.max_tokens < 1 or \
            args.rounds < 1:
        raise InvalidArgumentError("need 1 ≤ --concurrency ≤ 256, --requests-per-cell ≥ 1, --max-tokens ≥ 1 and "
                                   "--rounds ≥ 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_trt.runtime.hf_loader import load_tokenizer  # noqa: PLC0415
    from dspark_trt.serve.server import TritonServer  # noqa: PLC0415

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.export_aiperf is not None:
        cfg = serve_config(args.url, args.repo)
        export_aiperf(args.export_aiperf, make_jobs(load_tokenizer(cfg.build / "tokenizer"), cfg.room,
                                                    args.max_tokens, args.long_tokens))
        return 0
    load_before = os.getloadavg()
    t_start = time.monotonic()
    server: Any = None
    try:
        if args.repo is not None:
            env = dict(os.environ, **({"DSPARK_THREADS": str(args.threads)} if args.threads else {}))
            if args.suffix_recent_tokens is not None:
                env["DSPARK_SUFFIX_RECENT_TOKENS"] = str(args.suffix_recent_tokens)
            server = TritonServer(args.repo, env=env).start()
            url = server.grpc_url
        else:
            url = args.url
        cfg = serve_config(url)
        specs = policy_specs(args.policies, cfg.gamma, cfg.min_k, args.temperature, args.seed)
        jobs = make_jobs(load_tokenizer(cfg.build / "tokenizer"), cfg.room, args.max_tokens, args.long_tokens)
        log.info("grid: concurrency %s × %s, %d request(s)/client/cell, max_tokens %d, γ %d, %d KV slots",
                 args.concurrency, [s.name for s in specs], args.requests_per_cell, args.max_tokens, cfg.gamma,
                 cfg.max_batch)
        result = run_grid(url, specs, args.concurrency, args.requests_per_cell, jobs, args.request_timeout,
                          rounds=args.rounds)
    finally:
        if server is not None:
            server.stop()
    result["setup"] = {"repo": str(args.repo or args.url), "gamma": cfg.gamma, "kv_slots": cfg.max_batch,
                       "max_seq_len": cfg.max_seq_len, "max_queue": cfg.max_queue, "threads": args.threads or "auto",
                       "requests_per_cell": args.requests_per_cell, "rounds": args.rounds, "max_tokens": args.max_tokens,
                       "long_tokens": args.long_tokens, "concurrency": args.concurrency,
                       "temperature": args.temperature, "seed": args.seed if args.temperature > 0 else None,
                       "policies": [asdict(s) for s in specs], "quick": args.quick,
                       "load_before": [round(x, 2) for x in load_before],
                       "load_after": [round(x, 2) for x in os.getloadavg()],
                       "wall_s": round(time.monotonic() - t_start, 1)}
    out = args.out or Path("runs/bench_serving") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    text = write_outputs(result, out, plot_png=not args.no_plot)
    sys.stdout.write(text)
    bad = sum(c["wrong"] + c["errors"] for c in result["cells"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
