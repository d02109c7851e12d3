"""`dspark-trt bench`: ours DSpark (each K policy) vs ours plain vs Hugging Face generate, side by side, one run.

Owns the benchmark protocol and the report (docs/benchmarks.md): the same prompts (code, chat, math-like) for
every engine, greedy, EOS ignored so every run decodes the same number of tokens; decode tok/s excludes
prompt processing (time of a 1-token run of the same prompt is subtracted); runs are interleaved per prompt
and the median over repeats is reported; speculative output is checked token for token against ours plain.
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from dspark_trt.errors import InvalidArgumentError

log = logging.getLogger("dspark_trt.bench")

PROMPTS: dict[str, list[str]] = {
    "code": ["Write a Python function that checks whether a string is a palindrome.",
             "Implement binary search in Python and explain its complexity.",
             "Write a JavaScript function that debounces another function."],
    "chat": ["What are three tips for staying focused while studying?",
             "Explain why the sky is blue to a ten-year-old.",
             "Suggest a short weekend itinerary for a rainy city trip."],
    "math": ["Solve step by step: a train travels 120 km in 1.5 hours. What is its average speed?",
             "What is 17 times 23? Show your work.",
             "If x + 2x + 3x = 36, what is x? Explain each step."],
}
SPEC_POLICIES = ("fixed", "confidence", "survival")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded per run (EOS ignored; default 64)")
    p.add_argument("--prompts-per-kind", type=int, default=2, help="prompts per category (code/chat/math; ≤ 3)")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats per prompt (median reported)")
    p.add_argument("--policies", default=",".join(SPEC_POLICIES),
                   help="DSpark K policies to run (comma list; \"seed\" = confidence)")
    p.add_argument("--k", type=int, default=4, help="K for the fixed policy (default 4)")
    p.add_argument("--target", type=Path, default=None, help="target HF dir (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", type=Path, default=None, help="draft dir (default: the shipped DSpark drafter)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baseline")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--note", action="append", default=[], help="a line added to the report's notes (repeatable)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown report path")


def machine_stamp() -> dict[str, Any]:
    import torch

    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def profile_cost_table(target: Any, max_tokens: int, context: int = 64, reps: int = 5) -> Any:
    """Measure one target step over n = 1..max_tokens new tokens (batch 1, `context` tokens cached; fastest of reps,
    the least noisy estimate on a shared host)
    → spec_decode.scheduler.CostTable for the survival policy."""
    import torch

    from dspark_trt.spec_decode.scheduler import CostTable

    cache = target.new_cache(1, context + max_tokens + 1)
    slot = torch.tensor([0])
    target(torch.arange(100, 100 + context).unsqueeze(0), cache, slot, logits="last")
    secs = []
    for n in range(1, max_tokens + 1):
        times = []
        for _ in range(reps):
            x = torch.arange(200, 200 + n).unsqueeze(0)  # [1, n]
            t = time.perf_counter()
            target(x, cache, slot, logits="all")
            times.append(time.perf_counter() - t)
            cache.truncate(slot, torch.tensor([context]))
        secs.append(min(times))
    for i in range(1, len(secs)):  # a cost table must not fall with more tokens (timer noise)
        secs[i] = max(secs[i], secs[i - 1] * 1.0001)
    return CostTable(tuple(range(1, max_tokens + 1)), tuple(secs))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_trt.engine import SpeculativeDecodingEngine, to_runtime_model
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.spec_decode.protocols import SamplingParams
    from dspark_trt.spec_decode.policies import POLICIES, resolve_policy_alias

    policies = [resolve_policy_alias(p) for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES or p == "plain"]
    if bad or not 1 <= args.prompts_per_kind <= 3 or args.max_new_tokens < 2 or args.repeats < 1:
        raise InvalidArgumentError(f"--policies must be from {SPEC_POLICIES} (got {bad}); --prompts-per-kind in "
                                   f"[1, 3]; --max-new-tokens ≥ 2; --repeats ≥ 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.target is None:
        from dspark_trt.runtime.default_model import default_target_dir

        target_dir = default_target_dir()
    else:
        target_dir = args.target
    draft_dir = args.draft
    if draft_dir is None:
        from dspark_trt.runtime.drafters import default_drafter_dir

        draft_dir = default_drafter_dir()
    tok = load_tokenizer(target_dir)
    target = to_runtime_model(target_dir, dtype)
    from dspark_trt.runtime.drafters import load_drafter

    drafter = load_drafter(Path(draft_dir), target, dtype=dtype, target_dir=Path(target_dir))
    gamma = int(drafter.gamma)
    prompts = [(kind, tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False) if getattr(tok, "chat_template", None) else text)
               for kind, texts in PROMPTS.items() for text in texts[: args.prompts_per_kind]]
    ids = [[int(t) for t in tok.encode(p)] for _, p in prompts]
    max_len = max(len(i) for i in ids) + args.max_new_tokens + 2
    greedy = SamplingParams()
    table = profile_cost_table(target, gamma + 1)
    log.info("cost table (s per step by tokens): %s", [round(x, 4) for x in table.seconds])
    engines: dict[str, Any] = {"ours plain": SpeculativeDecodingEngine(target, None, tok, max_len, gamma, policy="plain")}
    for pol in policies:
        eng = SpeculativeDecodingEngine(target, drafter, tok, max_len, gamma, policy=pol, cost_table=table)
        if pol == "fixed":
            eng.with_policy(k=min(args.k, gamma))
        engines[f"ours DSpark ({pol})"] = eng
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    n = args.max_new_tokens
    rates: dict[str, list[float]] = {name: [] for name in engines}
    if hf is not None:
        rates["HF generate (bf16)"] = []
    spec_stats: dict[str, list[Any]] = {name: [] for name in engines}
    mismatches: dict[str, int] = {name: 0 for name in engines}
    for pi, prompt in enumerate(ids):
        log.info("prompt %d/%d (%s, %d tokens)", pi + 1, len(ids), prompts[pi][0], len(prompt))
        plain_tokens = None
        for _ in range(args.repeats):
            for name, eng in engines.items():
                eng.eos_ids = ()  # EOS ignored: every run decodes exactly n tokens
                ttft, _ = _timed(lambda: eng.run(prompt, 1, greedy))
                wall, res = _timed(lambda: eng.run(prompt, n, greedy))
                rates[name].append((n - 1) / max(wall - ttft, 1e-9))
                spec_stats[name].append(res.stats)
                if name == "ours plain":
                    plain_tokens = res.tokens
                elif plain_tokens is not None and res.tokens != plain_tokens:
                    mismatches[name] += 1
            if hf is not None:
                x = torch.tensor([prompt])
                kw = dict(do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id or 0)
                with torch.no_grad():
                    ttft, _ = _timed(lambda: hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw))
                    wall, _ = _timed(lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw))
                rates["HF generate (bf16)"].append((n - 1) / max(wall - ttft, 1e-9))
    report = _report(args, machine_stamp(), rates, spec_stats, mismatches, gamma, len(ids), Path(draft_dir), table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0


def _report(args: argparse.Namespace, stamp: dict[str, Any], rates: dict[str, list[float]],
            spec_stats: dict[str, list[Any]], mismatches: dict[str, int], gamma: int, n_prompts: int,
            draft_dir: Path, table: Any) -> str:
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    plain = med.get("ours plain", 0.0)
    hf = med.get("HF generate (bf16)")
    lines = [
        "# Benchmarks", "",
        f"Machine: {stamp['cpu']}, {stamp['cores']} cores (torch threads {stamp['torch_threads']}), "
        f"torch {stamp['torch']}, {stamp['date']}.", "",
        f"Target: {args.target or 'embedded SmolLM2-135M-Instruct'} ({args.dtype}); drafter: {draft_dir.name} "
        f"(γ = {gamma}). {n_prompts} prompts (code, chat, math-like; chat template applied), greedy, EOS ignored, "
        f"{args.max_new_tokens} new tokens per run, {args.repeats} repeat(s). Decode tok/s excludes prompt "
        f"processing (a 1-token run of the same prompt is subtracted); median over prompts × repeats. "
        f"Command: `dspark-trt bench --max-new-tokens {args.max_new_tokens} --prompts-per-kind "
        f"{args.prompts_per_kind} --repeats {args.repeats} --threads {stamp['torch_threads']}`.", "",
        "| engine | decode tok/s | vs ours plain | vs HF bf16 | τ | acceptance α | first-token reject | "
        "output = plain greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    per_pos: list[str] = []
    for name, r in med.items():
        vs_plain = f"{r / plain:.2f}×" if plain else "–"
        vs_hf = f"{r / hf:.2f}×" if hf else "–"
        if name in spec_stats:
            s = spec_stats[name][0].merge(spec_stats[name][1:])
            same = "yes" if mismatches[name] == 0 else f"NO ({mismatches[name]} runs differ)"
            alpha, ftr = ((f"{s.acceptance_rate:.2f}", f"{s.first_token_rejection_rate:.2f}") if s.drafted_tokens
                          else ("–", "–"))
            lines.append(f"| {name} | {r:.1f} | {vs_plain} | {vs_hf} | {s.tau:.2f} | {alpha} | {ftr} | {same} |")
            if s.drafted_tokens:
                cells = [f"{x:.2f}" for x in s.acceptance_per_position()][:gamma]
                cells += ["–"] * (gamma - len(cells))
                per_pos.append(f"| {name} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"| {name} | {r:.1f} | {vs_plain} | {vs_hf} | 1.00 | – | – | reference |")
    if per_pos:
        lines += ["", "Acceptance per position j (rounds with accepted ≥ j / rounds that verified ≥ j tokens):", "",
                  "| engine | " + " | ".join(f"j={j}" for j in range(1, gamma + 1)) + " |",
                  "|---|" + "---|" * gamma]
        lines += per_pos
    base = table.seconds[0]
    lines += ["", "Target step cost by tokens verified (profiled at start, batch 1; used by the survival policy): "
              + ", ".join(f"{n}: {s / base:.2f}×" for n, s in zip(table.tokens, table.seconds)) + ".",
              "", "τ = generated tokens / target forwards (prefill included, bonus included).", ""]
    if args.note:
        lines += ["## Notes", ""] + [f"- {n}" for n in args.note] + [""]
    return "\n".join(lines)
