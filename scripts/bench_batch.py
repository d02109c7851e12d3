#!/usr/bin/env python
"""Benchmark DSpark's policies under in-process continuous batching, on this CPU's kernel engine.

One RoundScheduler per policy over one SpecBackend with B KV slots: N held-out prompts (or, with `--mix grid`, the
served grid's chat prompts and long code contexts) queued at once (greedy, EOS ignored, `--new` tokens each), so B
requests decode together and a finished one's slot takes the next. Rows: ours plain (speculate off), DSpark alone
(survival), the default proposers (DSpark + suffix, cross-request index off: the prompts repeat across reps), fixed
K = 3. Each row keeps its gate memory and suffix confidences across its
reps, as a server does. Reps interleave the rows (rotated order); per row the median over reps of output tokens /
wall seconds (prefills included) and of output tokens / seconds outside prefill passes (plain's rows finish in
lockstep and batch their next prompts' prefill, speculative rows finish apart and prefill one by one: a cost of
this closed-loop workload, not of decoding), ratio to plain of the same run; drafted rows per row-round, tokens
verified and accepted per drafted row-round. Every answer is checked against plain's. Prints a markdown
table stamped with the CPU and engine. A benchmark, never a test.

    .venv/bin/python scripts/bench_batch.py --batch 1,2,4 [--requests 8] [--new 64] [--reps 3] [--mix grid]
        [--slots 32 --prefill-chunk 256]   # a server's slots, cost profile and prefill budget, `batch` in flight
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    import torch

    from dspark_trt.engine import build_backend, to_runtime_model
    from dspark_trt.runtime import native
    from dspark_trt.runtime.default_model import default_target_dir
    from dspark_trt.runtime.drafters import default_drafter_dir, load_drafter
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.runtime.profile import profile_costs
    from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
    from dspark_trt.spec_decode.scheduler import GateMemory, PolicyConfig
    from dspark_trt.spec_decode.suffix import SuffixConfig, SuffixProposer
    from dspark_trt.train.prompts import HELD_OUT_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,2,4", help="KV slots (requests decoding together), comma list")
    ap.add_argument("--requests", type=int, default=8, help="held-out prompts queued per run")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median)")
    ap.add_argument("--rows", default="plain,survival,hybrid,fixed3",
                    help="rows to run (comma list of plain, survival, hybrid, suffix, nogate, solo, fixed0/1/2/3/5/7)")
    ap.add_argument("--mix", choices=("held-out", "grid"), default="held-out",
                    help="prompts: the held-out chat prompts, or the served grid's mix (short chat prompts and long "
                         "code contexts, scripts/bench_serving_grid.make_jobs, --long-tokens each)")
    ap.add_argument("--long-tokens", type=int, default=1024, help="--mix grid: tokens of a code context")
    ap.add_argument("--slots", type=int, default=0,
                    help="KV slots allocated (0: the batch). More slots than the batch keep `batch` requests in flight "
                         "(a closed loop, as that many clients: the next is queued when one finishes) on a backend "
                         "and cost profile the size of a server's (32 slots by default there)")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="prompt tokens prefilled per step (0: whole prompts; a server's default is 256)")
    args = ap.parse_args()
    td = default_target_dir()
    tok = load_tokenizer(td)
    target = to_runtime_model(td, torch.bfloat16)
    drafter = load_drafter(default_drafter_dir(), target, dtype=torch.bfloat16, target_dir=Path(td))
    gamma = int(drafter.gamma)
    if args.mix == "grid":  # the served grid's jobs, in its order: chat, code, chat, chat, code, ...
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_serving_grid import make_jobs  # noqa: PLC0415

        jobs = make_jobs(tok, 2048 - gamma - 4, args.new, args.long_tokens)
        texts = [(j.prompt, j.chat) for j in jobs[:args.requests]]
    else:
        texts = [(HELD_OUT_PROMPTS[i % len(HELD_OUT_PROMPTS)][1], True) for i in range(args.requests)]
    ids = [tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=False)) if chat else tok.encode(p))
           for p, chat in texts]
    max_seq = max(map(len, ids)) + args.new + gamma + 4
    policies = {"plain": PolicyConfig(policy="plain"), "survival": PolicyConfig(),
                "hybrid": PolicyConfig(proposers=("dspark", "suffix")),
                "suffix": PolicyConfig(proposers=("suffix",)),
                "nogate": PolicyConfig(gate=False),  # survival with the drafting gate off (always drafts)
                "solo": PolicyConfig(share_pass=False),  # survival, each row pricing a whole drafter pass
                **{f"fixed{k}": PolicyConfig(policy="fixed", k=k) for k in (0, 1, 2, 3, 5, 7)}}
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    info = native.cpu_summary()
    print(f"CPU {info['cpu']} ({info['family']}), kernel engine **{native.engine()}**; {len(ids)} {args.mix} "
          f"prompts queued, {args.new} tokens each, greedy, EOS ignored, {args.reps} interleaved reps (median)\n")
    for b in (int(x) for x in args.batch.split(",")):
        slots = max(args.slots, b)
        be = build_backend(target, drafter, slots, max_seq)
        table = profile_costs(be, gamma + 1, reps=3, pass_tokens=min(slots * (gamma + 1), 512))
        cfg = LoopConfig(gamma=gamma, cost_table=table, prefill_chunk=args.prefill_chunk)
        rates: dict[str, list[float]] = {r: [] for r in rows}
        decode: dict[str, list[float]] = {r: [] for r in rows}  # prefill passes excluded
        drafted = {r: [0, 0, 0, 0] for r in rows}  # drafted row-rounds, row-rounds, accepted, verified draft tokens
        answers: dict[str, list[tuple[int, ...]]] = {}
        # one gate memory and one suffix proposer per row across its reps, as a server keeps them (the learned
        # confidences carry over; the cross-request index is off, else a repeated prompt copies its earlier answer)
        gates = {r: GateMemory() for r in rows}
        suffixes = {r: SuffixProposer(SuffixConfig().with_recent_tokens(0)) for r in rows}
        for rep in range(args.reps):
            order = rows[rep % len(rows):] + rows[:rep % len(rows)]
            for name in order:
                sched = RoundScheduler(be, cfg, speculate=name != "plain", gate=gates[name], suffix=suffixes[name])
                queue = [Request(p, args.new, policy=policies[name]) for p in ids]
                rids = [sched.add(r) for r in queue[:b]]  # `b` in flight; with spare slots the next joins as one ends
                queue = queue[b:]
                pre = [0.0]  # seconds in prefill passes (the admissions: lockstep rows batch theirs, ragged rows not)
                ex_prefill = sched.executor.prefill

                def timed_prefill(*a: object, _f=ex_prefill, _acc=pre, **k: object) -> object:  # noqa: ANN001
                    t0 = time.perf_counter()
                    try:
                        return _f(*a, **k)
                    finally:
                        _acc[0] += time.perf_counter() - t0

                sched.executor.prefill = timed_prefill  # type: ignore[method-assign]
                out: dict[int, list[int]] = {r: [] for r in rids}
                stats = {}
                t = time.perf_counter()
                while sched.active or sched.pending:
                    for ev in sched.step():
                        out[ev.request_id].extend(ev.new_tokens)
                        if ev.finished:
                            stats[ev.request_id] = ev.stats
                            if queue:
                                rids.append(sched.add(queue.pop(0)))
                                out[rids[-1]] = []
                wall = time.perf_counter() - t
                rates[name].append(sum(map(len, out.values())) / wall)
                decode[name].append(sum(map(len, out.values())) / (wall - pre[0]))
                answers.setdefault(name, [tuple(out[r]) for r in rids])
                for s in stats.values():
                    for rec in s.rounds:
                        drafted[name][1] += 1
                        if any(src == "dspark" for src, _ in rec.offered):  # paid a drafter pass
                            drafted[name][0] += 1
                        if rec.proposer != "none":
                            drafted[name][2] += rec.accepted
                            drafted[name][3] += rec.k
        base = statistics.median(rates["plain"]) if "plain" in rates else float("nan")
        dbase = statistics.median(decode["plain"]) if "plain" in decode else float("nan")
        extra = (f", {slots} KV slots (a closed loop of {b} in flight)" if slots > b else "") + \
            (f", prefill chunk {args.prefill_chunk}" if args.prefill_chunk else "")
        print(f"### batch {b}{extra}: target step {table.seconds[0] * 1e3:.2f} ms, step({b}) "
              f"{table.step_seconds(b) * 1e3:.2f} ms, drafter pass {table.draft_seconds(1) * 1e3:.2f} ms (1 row)\n")
        print("| row | output tok/s | vs plain | decode tok/s (prefill passes out) | vs plain | drafted row-rounds | "
              "verified / accepted per drafted row-round | = plain |\n|---|---|---|---|---|---|---|---|")
        for name in rows:
            med, dmed = statistics.median(rates[name]), statistics.median(decode[name])
            d, n, acc, kk = drafted[name]
            same = answers[name] == answers.get("plain", answers[name])
            print(f"| {name} | {med:.1f} | {med / base:.3f}× | {dmed:.1f} | {dmed / dbase:.3f}× | {d}/{n} | "
                  f"{kk / max(d, 1):.2f} / {acc / max(d, 1):.2f} | {same} |")
        print()


if __name__ == "__main__":
    main()
