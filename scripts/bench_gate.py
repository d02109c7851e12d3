#!/usr/bin/env python
"""Benchmark the survival gate's settings against each other in ONE process, on this CPU's kernel engine.

Rows, interleaved per prompt (rotated order) on the held-out prompts, greedy, EOS ignored, decode tok/s (a 1-token
run subtracted), median over prompts, ratio to ours plain of the same run: fixed K=2, the default survival policy
(drafter cost profiled as a round pays it, the shipped gate), the earlier gate (hysteresis 0.03, probes of the full
cap) under that cold drafter cost and under the hot one (fastest of back-to-back drafter passes), and the default
with no memory across requests. Prints a markdown table stamped with the CPU and engine. A benchmark, never a test.

    DSPARK_NATIVE_ENGINE=avx2 .venv/bin/python scripts/bench_gate.py [--new 96] [--prompts 18]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    import torch

    from dspark_trt.engine import SpeculativeDecodingEngine, build_backend, to_runtime_model
    from dspark_trt.runtime import native
    from dspark_trt.runtime.default_model import default_target_dir
    from dspark_trt.runtime.drafters import default_drafter_dir, load_drafter
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.runtime.profile import _fastest, profile_costs
    from dspark_trt.spec_decode.protocols import SamplingParams
    from dspark_trt.spec_decode.scheduler import GateMemory
    from dspark_trt.train.prompts import HELD_OUT_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=96, help="tokens decoded per run")
    ap.add_argument("--prompts", type=int, default=len(HELD_OUT_PROMPTS), help="held-out prompts used")
    args = ap.parse_args()
    td = default_target_dir()
    tok = load_tokenizer(td)
    target = to_runtime_model(td, torch.bfloat16)
    drafter = load_drafter(default_drafter_dir(), target, dtype=torch.bfloat16, target_dir=Path(td))
    gamma = int(drafter.gamma)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=False)) for _, p in HELD_OUT_PROMPTS[:args.prompts]]
    max_len = max(map(len, ids)) + args.new + 2
    be = build_backend(target, drafter, 2, max_len + gamma + 2)
    cold = profile_costs(be, gamma + 1, reps=5)
    be.prefill([0, 1], [ids[0], ids[0]])
    greedy = SamplingParams()
    h1 = _fastest(lambda: be.draft([0], torch.tensor([42]), gamma, [greedy]), 5)
    h2 = _fastest(lambda: be.draft([0, 1], torch.tensor([42, 42]), gamma, [greedy] * 2), 5)
    hot = dataclasses.replace(cold, draft_t0=max(2 * h1 - h2, 0.0), draft_t1=max(h2 - h1, 0.0))

    def engine(policy: str, table: object, **kw: object) -> SpeculativeDecodingEngine:
        e = SpeculativeDecodingEngine(target, drafter if policy != "plain" else None, tok, max_len, gamma,
                                      policy=policy, cost_table=table)
        e.policy = dataclasses.replace(e.policy, **kw)
        e.eos_ids = ()
        return e

    engines = {"ours plain": engine("plain", None),
               "fixed K=2": engine("fixed", cold, k=2),
               "survival (default)": engine("survival", cold),
               "survival, earlier gate, cold cost": engine("survival", cold, gate_hysteresis=0.03, probe_k=gamma),
               "survival, earlier gate, hot cost": engine("survival", hot, gate_hysteresis=0.03, probe_k=gamma),
               "survival (default), no memory across requests": engine("survival", cold)}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    drafted = {k: [0, 0] for k in engines}
    for pi, prompt in enumerate(ids):
        names = list(engines)
        names = names[pi % len(names):] + names[:pi % len(names)]
        for name in names:
            e = engines[name]
            if "no memory" in name:
                e.gate = GateMemory()
            t = time.perf_counter()
            e.run(prompt, 1, greedy)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            res = e.run(prompt, args.new, greedy)
            rates[name].append((args.new - 1) / max(time.perf_counter() - t - ttft, 1e-9))
            drafted[name][0] += res.stats.draft_calls
            drafted[name][1] += res.stats.verify_calls
    info = native.cpu_summary()
    print(f"CPU {info['cpu']} ({info['family']}), kernel engine **{native.engine()}**; {len(ids)} held-out prompts, "
          f"{args.new} tokens, greedy; drafter pass {cold.draft_seconds(1) * 1e3:.2f} ms as a round pays it, "
          f"{hot.draft_seconds(1) * 1e3:.2f} ms hot; target step {cold.seconds[0] * 1e3:.2f} ms\n")
    print("| engine | decode tok/s | vs ours plain | drafted rounds |\n|---|---|---|---|")
    base = statistics.median(rates["ours plain"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:.1f} | {med / base:.3f}× | {drafted[name][0]}/{drafted[name][1]} |")


if __name__ == "__main__":
    main()
