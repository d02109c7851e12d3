#!/usr/bin/env python
"""Where a decode round's time goes, per proposer set, in ONE process on this CPU's kernel engine: a measurement,
never a test.

Rows (the engines `dspark-trt bench` runs, built the same way): ours plain, DSpark alone (survival), fixed K = 3,
the suffix alone, DSpark + suffix (the default proposers), DSpark alone and DSpark + suffix with a useless drafter,
interleaved per prompt in a rotated order, greedy, EOS ignored (`--stop-at-eos`: answers end at EOS, as requests
do), `--new` tokens a run (a 1-token run subtracted). Per row: decode tok/s (median over runs, and all tokens over
all seconds), tokens a round (τ without the prefill), and a round's seconds split into the target pass
(`backend.verify`: 1 + K tokens), the drafter pass (`backend.draft`, its backlog flush included) and the rest — the
loop's own work (acceptance, commit, the suffix lookup, the scheduler, calibration, stats). Every row's output is
checked against plain's. Prints a markdown table stamped with the CPU and engine.

    .venv/bin/python scripts/round_anatomy.py [--prompt-set held-out] [--new 96] [--reps 2] [--rows plain,dspark,...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROWS = ("plain", "dspark", "fixed3", "suffix", "hybrid", "useless", "hybrid-useless")


def engines(names: list[str], prompt_set: str, new: int, stop_at_eos: bool = False
            ) -> tuple[dict[str, Any], list[list[int]]]:
    """name → SpeculativeDecodingEngine (EOS ignored unless stop_at_eos), and the prompts' ids (chat template where
    the set says so)."""
    import torch

    from dspark_trt.commands.bench import load_prompts, useless_drafter
    from dspark_trt.engine import SpeculativeDecodingEngine, build_backend, to_runtime_model
    from dspark_trt.runtime.default_model import default_target_dir
    from dspark_trt.runtime.drafters import default_drafter_dir, load_drafter
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.runtime.profile import profile_costs

    target_dir, draft_dir = default_target_dir(), default_drafter_dir()
    tok = load_tokenizer(target_dir)
    target = to_runtime_model(target_dir, torch.bfloat16)
    drafter = load_drafter(draft_dir, target, dtype=torch.bfloat16, target_dir=Path(target_dir))
    gamma = int(drafter.gamma)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                              tokenize=False) if p.chat else p.text)
           for p in load_prompts(None, prompt_set)]
    max_len = max(map(len, ids)) + new + 2
    table = profile_costs(build_backend(target, drafter, 2, max_len + gamma + 2), gamma + 1, reps=5)

    def spec(draft: Any, proposers: str, policy: str = "survival") -> Any:
        return SpeculativeDecodingEngine(target, draft, tok, max_len, gamma, policy=policy, cost_table=table,
                                         proposers=proposers, corpus="auto")

    make: dict[str, Callable[[], Any]] = {
        "plain": lambda: SpeculativeDecodingEngine(target, None, tok, max_len, gamma, policy="plain"),
        "dspark": lambda: spec(drafter, "dspark"),
        "fixed3": lambda: spec(drafter, "dspark", "fixed").with_policy(k=3),
        "suffix": lambda: spec(None, "suffix"),
        "hybrid": lambda: spec(drafter, "dspark,suffix"),
        "useless": lambda: spec(useless_drafter(draft_dir, target, torch.bfloat16, Path(target_dir)), "dspark"),
        "hybrid-useless": lambda: spec(useless_drafter(draft_dir, target, torch.bfloat16, Path(target_dir)),
                                       "dspark,suffix"),
    }
    out = {}
    for name in names:
        out[name] = make[name]()
        if not stop_at_eos:
            out[name].eos_ids = ()
    return out, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-set", default="held-out", choices=["held-out", "code-edit", "text", "all"])
    ap.add_argument("--new", type=int, default=96, help="tokens decoded a run (EOS ignored)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved rounds over the prompts")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stop-at-eos", action="store_true", help="answers end at EOS as requests do (--new: the most)")
    a = ap.parse_args()
    import torch

    from dspark_trt.runtime import native

    names = [r for r in a.rows.split(",") if r]
    bad = [r for r in names if r not in ROWS]
    if bad or "plain" not in names:
        raise SystemExit(f"--rows: unknown {bad} (plain is required: the reference); valid: {', '.join(ROWS)}")
    torch.set_num_threads(a.threads)
    engs, ids = engines(names, a.prompt_set, a.new, a.stop_at_eos)
    sums: dict[str, dict[str, float]] = {n: defaultdict(float) for n in engs}
    rates: dict[str, list[float]] = {n: [] for n in engs}
    wrong: dict[str, int] = {n: 0 for n in engs}
    for rep in range(a.reps):
        for pi, prompt in enumerate(ids):
            shift = (pi + rep * len(ids)) % len(names)
            answers = {}
            for name in names[shift:] + names[:shift]:
                eng = engs[name]
                eng.suffix.forget_outputs()  # no run copies an earlier run's answer to the same prompt
                t0 = time.perf_counter()
                eng.run(prompt, 1)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                res = eng.run(prompt, a.new)
                wall = time.perf_counter() - t0 - first
                b, s = eng._backend, sums[name]  # TimedBackend: the passes' seconds of this run
                s["wall"] += wall
                s["tokens"] += len(res.tokens) - 1
                s["rounds"] += b.calls["verify"]
                s["verify"] += b.seconds["verify"]
                s["draft"] += b.seconds["draft"]
                s["passes"] += b.calls["draft"]
                rates[name].append((len(res.tokens) - 1) / max(wall, 1e-9))
                answers[name] = res.tokens
            wrong.update({n: wrong[n] + (answers[n] != answers["plain"]) for n in names})
    base = statistics.median(rates["plain"])
    print(f"{native.cpu_model()}, engine {native.engine()}, torch threads {a.threads}; prompt set {a.prompt_set}, "
          f"{len(ids)} prompts × {a.new} tokens{' (at most: answers end at EOS)' if a.stop_at_eos else ''} × "
          f"{a.reps} reps, interleaved\n")
    pooled = sums["plain"]["tokens"] / max(sums["plain"]["wall"], 1e-9)
    print("| row | decode tok/s (median) | × plain | pooled (all tokens / all s) × plain | tokens a round "
          "| target pass ms | drafter ms a round (passes) | loop's own work ms a round | output = plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        s, r = sums[n], max(sums[n]["rounds"], 1.0)
        rest = (s["wall"] - s["verify"] - s["draft"]) / r
        med = statistics.median(rates[n])
        print(f"| {n} | {med:.1f} | {med / base:.2f}× | {s['tokens'] / max(s['wall'], 1e-9) / pooled:.2f}× | "
              f"{s['tokens'] / r:.3f} | {1e3 * s['verify'] / r:.2f} | "
              f"{1e3 * s['draft'] / r:.2f} ({int(s['passes'])}) | {1e3 * rest:.2f} | "
              f"{'yes' if not wrong[n] else f'NO ({wrong[n]} runs)'} |")


if __name__ == "__main__":
    main()
