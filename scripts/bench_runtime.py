#!/usr/bin/env python
"""Benchmark the runtime's plain greedy decoding against HF transformers generate() on this CPU.

Side by side in one run, same prompts (code + chat), N new tokens with EOS ignored, median of R
interleaved rounds: HF generate fp32/bf16 vs ours fp32/bf16, decode tok/s excluding prefill, % of the
memory-bandwidth speed of light, and the cost of a verify pass of K+1 tokens relative to 1 token
(K = 1..8) — the number that decides speculation's speed-up. Prints a markdown table stamped with the
machine and writes it to docs/benchmarks-runtime.md. A benchmark, never a test.

    .venv/bin/python scripts/bench_runtime.py [--new 128] [--reps 3] [--threads 2] [--prompts 2]
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dspark_trt.runtime.default_model import default_target_dir  # noqa: E402
from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer  # noqa: E402
from dspark_trt.runtime.model import CausalLM  # noqa: E402

log = logging.getLogger("bench_runtime")
ROOT = Path(__file__).resolve().parent.parent
CODE = ["def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
        "import json\n\nclass Config:\n    def __init__(self, path):\n",
        "// binary search in a sorted array\nint search(const int *a, int n, int key) {\n"]
CHAT = ["Explain why the sky is blue in simple words.", "Give me three tips to sleep better.",
        "What is the difference between a list and a tuple in Python?"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        model = platform.processor() or "unknown CPU"
    load = os.getloadavg()
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"load average {load[0]:.1f}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")


def read_bandwidth() -> float:
    """GB/s reading a 1 GiB tensor (best of 5)."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes_per_token(model: CausalLM) -> int:
    """Bytes of weights one decode step reads: every projection + lm_head + norms (embedding row ignored)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or "vocab_embedding" in name:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    lm = model.lm_head_weight
    if id(lm) not in seen:  # tied: the embedding matrix is read by lm_head every token
        total += lm.numel() * lm.element_size()
    return total


def prompts(tok, n: int) -> list[tuple[str, list[int]]]:  # noqa: ANN001
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(("code", tok(CODE[(i // 2) % len(CODE)]).input_ids))
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": CHAT[(i // 2) % len(CHAT)]}],
                                          add_generation_prompt=True, tokenize=True)
            out.append(("chat", list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    return out


def hf_decode(hf, ids: list[int], new: int) -> tuple[float, list[int]]:  # noqa: ANN001
    """Decode tok/s of HF generate excluding prefill: (t(new) − t(1)) / (new − 1)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        t1 = _timed(lambda: hf.generate(x, max_new_tokens=1, do_sample=False))
        out = {}
        tn = _timed(lambda: out.setdefault("y", hf.generate(x, max_new_tokens=new, min_new_tokens=new,
                                                            do_sample=False)))
    return (new - 1) / max(tn - t1, 1e-9), out["y"][0, len(ids):].tolist()


def ours_decode(model: CausalLM, cache, ids: list[int], new: int) -> tuple[float, list[int]]:  # noqa: ANN001
    slots = torch.tensor([0])
    cache.reset(0)
    nxt = int(model(torch.tensor([ids]), cache, slots, logits="last").logits[0, -1].argmax())
    toks = [nxt]
    buf = torch.empty(1, 1, dtype=torch.long)
    t = time.perf_counter()
    for _ in range(new - 1):
        buf.fill_(nxt)
        nxt = int(model(buf, cache, slots, logits="last").logits[0, -1].argmax())
        toks.append(nxt)
    return (new - 1) / (time.perf_counter() - t), toks


def verify_costs(model: CausalLM, cache, ids: list[int], kmax: int = 8, reps: int = 5) -> list[float]:  # noqa: ANN001
    """Time of one forward of K+1 tokens / time of 1 token, at the prompt's context length, K = 1..kmax."""
    slots = torch.tensor([0])
    cache.reset(0)
    model(torch.tensor([ids + list(range(100, 164))]), cache, slots, logits="none")
    base = int(cache.lengths[0])

    def one(k: int) -> float:
        x = torch.arange(200, 201 + k).reshape(1, k + 1)
        best = 1e9
        for _ in range(reps):
            t = time.perf_counter()
            model(x, cache, slots, logits="all")
            best = min(best, time.perf_counter() - t)
            cache.truncate(slots, [base])
        return best

    one(0)
    t0 = one(0)
    return [one(k) / t0 for k in range(1, kmax + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="number of prompts, alternating code/chat (≤ 6)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate (ours only)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-runtime.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    d = default_target_dir()
    tok = load_tokenizer(d)
    ps = prompts(tok, args.prompts)
    bw = read_bandwidth()
    rows, costs = [], {}
    hf_fp32 = None
    for dname in args.dtypes.split(","):
        dt = DTYPES[dname]
        ours = load_hf_checkpoint(d, dtype=dt)
        cache = ours.new_cache(1, max(len(p) for _, p in ps) + args.new + 80)
        hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(d, dtype=dt).eval()
        if hf is not None:
            hf.generation_config.eos_token_id = None  # EOS ignored: always `new` tokens
        mb = weight_bytes_per_token(ours) / 1e6
        sol = bw * 1e3 / mb  # tok/s at the bandwidth limit
        res = {"hf": [], "ours": []}
        same = []
        for r in range(args.reps):  # interleaved rounds
            for kind, ids in ps:
                if hf is not None:
                    s, ref = hf_decode(hf, ids, args.new)
                    res["hf"].append(s)
                s2, mine = ours_decode(ours, cache, ids, args.new)
                res["ours"].append(s2)
                if hf is not None and r == 0:
                    same.append(mine == ref)
                log.info("%s round %d %s: hf %.1f ours %.1f tok/s", dname, r, kind,
                         res["hf"][-1] if res["hf"] else float("nan"), s2)
        for eng in ("hf", "ours"):
            if not res[eng]:
                continue
            med = statistics.median(res[eng])
            if eng == "hf" and dname == "fp32":
                hf_fp32 = med
            name = f"HF transformers generate, {dname}" if eng == "hf" else f"dspark_trt runtime, {dname}"
            agree = "reference" if eng == "hf" else (f"identical {sum(same)}/{len(same)}" if same else "–")
            rows.append((name, med, mb, 100 * med / sol, agree))
        costs[dname] = verify_costs(ours, cache, ps[0][1])
        del hf, ours, cache

    lines = [f"# Runtime benchmark: plain greedy decoding, SmolLM2-135M-Instruct", "",
             f"Machine: {machine()}.", f"Read bandwidth {bw:.1f} GB/s (torch.sum over 1 GiB). "
             f"{args.new} new tokens, EOS ignored, decode tok/s excluding prefill, median of {args.reps} interleaved "
             f"rounds over {len(ps)} prompts ({', '.join(k for k, _ in ps)}). SoL = bandwidth / weight bytes per token.",
             "", "| engine | tok/s | vs HF fp32 | MB/token | % SoL | output vs HF greedy |", "|---|---|---|---|---|---|"]
    for name, med, mb, pct, agree in rows:
        rel = f"{med / hf_fp32:.2f}" if hf_fp32 else "–"
        lines.append(f"| {name} | {med:.1f} | {rel} | {mb:.0f} | {pct:.0f}% | {agree} |")
    lines += ["", "Cost of one verify pass of K+1 tokens relative to a 1-token decode step (ours, at the prompt's "
              "context + 64 tokens):", "", "| dtype | " + " | ".join(f"K={k}" for k in range(1, 9)) + " |",
              "|---|" + "---|" * 8]
    for dname, c in costs.items():
        lines.append(f"| {dname} | " + " | ".join(f"{x:.2f}" for x in c) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    footer = ("\nGenerated by `scripts/bench_runtime.py`. On a shared machine the load average above matters: "
              "compare rows of one run, not runs. Design notes and what was tried: docs/runtime.md.\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table + footer)
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
