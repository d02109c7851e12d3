#!/usr/bin/env python
"""Benchmark the runtime's decode / verify / draft hot path on this CPU, in one run, and plot it.

Reports, side by side: plain greedy decode tok/s of ours in bf16 and quantized (W8A16 by default; round-to-nearest
weights from testing.quantize.rtn_quantize) with weight MB per token and % of the measured read bandwidth; the
cost of one verify pass of K+1 tokens relative to one token (K = 1..kmax) per model; the drafter's pass (γ = 4, 8)
relative to a target decode step; llama.cpp (llama-cpp-python) on given GGUF files with the same prompt token ids,
when `llama_cpp` is importable; optionally HF transformers generate. Writes a markdown table (stamped with the
machine and load) and a PNG plot (matplotlib, the `bench` extra). A benchmark, never a test.

    .venv/bin/python scripts/bench_runtime.py [--new 128] [--reps 3] [--threads 2] [--quants W8A16,W8A8_SQ_PER_CHANNEL]
        [--llama-gguf bf16=/path/smollm2-bf16.gguf --llama-gguf q8_0=/path/smollm2-q8_0.gguf] [--hf]
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer  # noqa: E402
from dspark_trt.runtime.model import CausalLM, iter_linears  # noqa: E402

log = logging.getLogger("bench_runtime")
ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "dspark_trt" / "assets" / "dspark-smollm2-135m"
CODE = ["def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
        "import json\n\nclass Config:\n    def __init__(self, path):\n",
        "// binary search in a sorted array\nint search(const int *a, int n, int key) {\n"]
CHAT = ["Explain why the sky is blue in simple words.", "Give me three tips to sleep better.",
        "What is the difference between a list and a tuple in Python?"]


@dataclass
class Row:
    engine: str
    tok_s: float
    mb_per_token: float | None = None
    pct_bw: float | None = None
    agree: str = "–"


@dataclass
class Report:
    machine: str
    bandwidth_gbs: float
    rows: list[Row] = field(default_factory=list)
    verify: dict[str, list[float]] = field(default_factory=dict)  # engine → cost(K+1) / cost(1), K = 1..kmax
    floor: dict[str, list[float]] = field(default_factory=dict)  # engine → compute floor of K+1 tokens / cost(1)
    peak_gflops: float = 0.0  # the engine's bf16 product on a hot [64, 576] x [3072, 576]^T
    drafter: dict[int, tuple[float, float]] = field(default_factory=dict)  # γ → (draft ms, ratio to a target step)
    notes: list[str] = field(default_factory=list)


def machine() -> str:
    from dspark_trt.runtime import native

    cpu = native.cpu_summary()
    model = f"{cpu['cpu']} (flags: {' '.join(cpu['flags'])}; kernel engine **{cpu['engine']}**)"
    load = os.getloadavg()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        commit = "unknown"
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"load average {load[0]:.1f}, commit {commit}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _fastest(fn: Callable[[], Any], reps: int) -> float:
    return min(_timed(fn) for _ in range(reps))


def read_bandwidth(mib: int = 512) -> float:
    """GB/s reading a `mib` MiB tensor with torch.sum (fastest of 5)."""
    x = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    x.sum()
    return x.numel() * 4 / _fastest(lambda: x.sum(), 5) / 1e9


def weight_bytes_per_token(model: CausalLM) -> int:
    """Bytes one decode step reads: every projection (quantized storage included) + lm_head + norms."""
    seen: set[int] = set()
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or "vocab_embedding" in name or name.endswith("inv_freq"):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    lm = model.lm_head_weight
    if id(lm) not in seen:  # tied: the embedding matrix is read by lm_head every token
        total += lm.numel() * lm.element_size()
    return total


def prompts(tok: Any, n: int) -> list[tuple[str, list[int]]]:
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(("code", list(tok(CODE[(i // 2) % len(CODE)]).input_ids)))
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": CHAT[(i // 2) % len(CHAT)]}],
                                          add_generation_prompt=True, tokenize=True)
            out.append(("chat", list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    return out


def ours_decode(model: CausalLM, ids: list[int], new: int) -> tuple[float, list[int]]:
    """Greedy decode tok/s excluding prefill, and the tokens."""
    cache = model.new_cache(1, len(ids) + new + 1)
    slots = torch.tensor([0])
    nxt = int(model(torch.tensor([ids]), cache, slots, logits="last").logits[0, -1].argmax())
    toks = [nxt]
    buf = torch.empty(1, 1, dtype=torch.long)
    t = time.perf_counter()
    for _ in range(new - 1):
        buf.fill_(nxt)
        nxt = int(model(buf, cache, slots, logits="last").logits[0, -1].argmax())
        toks.append(nxt)
    return (new - 1) / (time.perf_counter() - t), toks


def product_peak(dtype: torch.dtype = torch.bfloat16, reps: int = 20) -> float:
    """GFLOP/s of the runtime's product (runtime.ops.product: the engine in use) on a hot [64, 576] x [3072, 576]^T,
    the default target's MLP shape: about the best rate any multi-token pass can reach on this machine."""
    from dspark_trt.runtime import ops

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=g).to(dtype), torch.randn(3072, 576, generator=g).to(dtype)
    ops.product(x, w)
    return 2 * 64 * 576 * 3072 / _fastest(lambda: ops.product(x, w), reps) / 1e9


def product_flops(model: CausalLM) -> int:
    """Multiply-add FLOPs of one token through the model's projections and lm_head (2 per weight element)."""
    total = 0
    for name, m in iter_linears(model):
        w = model.lm_head_weight if name == "lm_head" else m.weight
        total += 2 * w.shape[0] * w.shape[1]
    return total


def verify_costs(model: CausalLM, ids: list[int], kmax: int, reps: int = 7) -> tuple[list[float], float]:
    """Fastest forward of K+1 tokens / fastest forward of 1 token at the prompt's context + 64, K = 1..kmax, and that
    one-token time (s); the sizes interleaved within each of `reps` rounds, so a drift in the machine's speed hits
    every K alike."""
    ctx = ids + [(100 + i) % model.config.vocab_size for i in range(64)]
    cache = model.new_cache(1, len(ctx) + kmax + 2)
    slots = torch.tensor([0])
    model(torch.tensor([ctx]), cache, slots, logits="none")
    base = int(cache.lengths[0])

    def run(k: int) -> None:
        model(torch.arange(200, 201 + k).reshape(1, k + 1), cache, slots, logits="all")
        cache.truncate(slots, [base])

    run(0)
    best = [min(_timed(lambda: run(k)) for _ in range(2)) for k in range(kmax + 1)]  # warm every size
    for _ in range(reps):
        for k in range(kmax + 1):
            best[k] = min(best[k], _timed(lambda: run(k)))
    return [best[k] / best[0] for k in range(1, kmax + 1)], best[0]


def drafter_costs(target: CausalLM, path: Path, ids: list[int], reps: int = 7) -> dict[int, tuple[float, float]]:
    """γ → (ms of one drafter pass, ratio to one target decode step with the drafter's taps)."""
    from dspark_trt.runtime.backend import SpecBackend
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.spec_decode.protocols import SamplingParams

    drafter = load_drafter(path, target, dtype=target.dtype)
    be = SpecBackend(target, drafter, max_batch=1, max_seq=len(ids) + 64)
    be.prefill([0], [ids])
    slot = torch.tensor([0])
    start = int(be.cache.lengths[0])

    def step() -> None:
        target(torch.tensor([[42]]), be.cache, slot, taps=be.taps, logits="all")
        be.cache.truncate(slot, [start])

    gammas = (4, int(getattr(drafter, "gamma", 8)))

    def draft(g: int) -> None:
        be.draft([0], torch.tensor([42]), g, [SamplingParams()])

    step(), [draft(g) for g in gammas]  # warm
    t_step, t_draft = float("inf"), {g: float("inf") for g in gammas}
    for _ in range(reps):  # the step and the passes interleaved, so a drift in the machine's speed hits all alike
        t_step = min(t_step, _timed(step))
        for g in gammas:
            t_draft[g] = min(t_draft[g], _timed(lambda: draft(g)))
    return {g: (t * 1e3, t / t_step) for g, t in t_draft.items()}


def llama_cpp_decode(gguf: Path, ids: list[int], new: int, threads: int) -> tuple[float, list[int]] | None:
    """llama.cpp greedy decode tok/s (excluding prefill) of the same prompt ids, or None without llama_cpp."""
    try:
        from llama_cpp import Llama  # type: ignore[import-not-found]
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + new + 8, n_threads=threads, n_batch=512, verbose=False)
    llm.reset()
    llm.eval(ids)

    def argmax_last() -> int:
        scores = llm.scores[llm.n_tokens - 1]
        return int(max(range(len(scores)), key=scores.__getitem__)) if not hasattr(scores, "argmax") else int(scores.argmax())

    nxt = argmax_last()
    toks = [nxt]
    t = time.perf_counter()
    for _ in range(new - 1):
        llm.eval([nxt])
        nxt = argmax_last()
        toks.append(nxt)
    return (new - 1) / (time.perf_counter() - t), toks


def hf_decode(hf: Any, ids: list[int], new: int) -> tuple[float, list[int]]:
    x = torch.tensor([ids])
    with torch.no_grad():
        t1 = _timed(lambda: hf.generate(x, max_new_tokens=1, do_sample=False))
        out: dict[str, torch.Tensor] = {}
        tn = _timed(lambda: out.setdefault("y", hf.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)))
    return (new - 1) / max(tn - t1, 1e-9), out["y"][0, len(ids):].tolist()


def run(args: argparse.Namespace) -> Report:
    from dspark_trt.testing.quantize import rtn_quantize

    d = Path(args.model) if args.model else _default_dir()
    tok = load_tokenizer(d)
    ps = prompts(tok, args.prompts)
    rep = Report(machine(), read_bandwidth())
    base = load_hf_checkpoint(d, dtype=torch.bfloat16)
    models: dict[str, CausalLM] = {"ours bf16": base}
    for q in [q for q in args.quants.split(",") if q]:
        models[f"ours {q}"] = rtn_quantize(base, q)
    ref_tokens: dict[int, list[int]] = {}
    for name, model in models.items():
        speeds, same = [], 0
        for r in range(args.reps):
            for i, (_, ids) in enumerate(ps):
                s, toks = ours_decode(model, ids, args.new)
                speeds.append(s)
                if r == 0:
                    if name == "ours bf16":
                        ref_tokens[i] = toks
                    same += toks == ref_tokens.get(i)
        mb = weight_bytes_per_token(model) / 1e6
        med = statistics.median(speeds)
        agree = "reference" if name == "ours bf16" else f"= bf16 on {same}/{len(ps)} prompts"
        rep.rows.append(Row(name, med, mb, 100 * med * mb / 1e3 / rep.bandwidth_gbs, agree))
        rep.verify[name], t1 = verify_costs(model, ps[0][1], args.kmax)
        if name == "ours bf16":
            rep.peak_gflops = product_peak()
        rep.floor[name] = [max(1.0, product_flops(base) * (k + 1) / (rep.peak_gflops * 1e9) / t1)
                           for k in range(1, args.kmax + 1)]
        log.info("%s: %.1f tok/s, verify %s", name, med, [round(c, 2) for c in rep.verify[name]])
    drafter = Path(args.drafter) if args.drafter else (DRAFTER if not args.model else None)
    if drafter is not None and drafter.exists():
        rep.drafter = drafter_costs(base, drafter, ps[0][1])
    for spec in args.llama_gguf:
        label, _, path = spec.partition("=") if "=" in spec else (Path(spec).stem, "", spec)
        speeds, same, res = [], 0, None
        for r in range(args.reps):
            for i, (_, ids) in enumerate(ps):
                res = llama_cpp_decode(Path(path), ids, args.new, torch.get_num_threads())
                if res is None:
                    break
                speeds.append(res[0])
                same += r == 0 and res[1] == ref_tokens.get(i)
            if res is None:
                break
        if res is None:
            rep.notes.append(f"llama.cpp {label}: not measured (`llama_cpp` is not importable; pip install "
                             f"llama-cpp-python builds llama.cpp from source)")
            continue
        rep.rows.append(Row(f"llama.cpp {label}", statistics.median(speeds), agree=f"= ours bf16 on {same}/{len(ps)}"))
    if not args.llama_gguf:
        rep.notes.append("llama.cpp: not measured (pass --llama-gguf LABEL=PATH with llama-cpp-python installed)")
    if args.hf:
        from transformers import AutoModelForCausalLM

        from dspark_trt.runtime.ops import bf16_matmul_fast

        fast = bf16_matmul_fast()  # no fast bf16 GEMM on this CPU (AVX2 only): HF in fp32, its faster dtype here
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16 if fast else torch.float32).eval()
        hf.generation_config.eos_token_id = None
        speeds = [hf_decode(hf, ids, args.new)[0] for _ in range(args.reps) for _, ids in ps]
        rep.rows.append(Row(f"HF transformers generate {'bf16' if fast else 'fp32 (bf16 products are slow here)'}",
                            statistics.median(speeds)))
    return rep


def _default_dir() -> Path:
    from dspark_trt.runtime.default_model import default_target_dir

    return default_target_dir()


def markdown(rep: Report, args: argparse.Namespace) -> str:
    lines = ["# Runtime benchmark: plain greedy decoding, verify cost, drafter cost", "",
             f"Machine: {rep.machine}. Read bandwidth {rep.bandwidth_gbs:.1f} GB/s (torch.sum). {args.new} new "
             f"tokens, EOS ignored, decode tok/s excluding prefill, median of {args.reps} rounds × {args.prompts} "
             f"prompts. % BW = tok/s × MB/token / bandwidth.", "",
             "| engine | tok/s | MB/token | % BW | greedy tokens |", "|---|---|---|---|---|"]
    for r in rep.rows:
        mb = f"{r.mb_per_token:.0f}" if r.mb_per_token else "–"
        bw = f"{r.pct_bw:.0f}%" if r.pct_bw else "–"
        lines.append(f"| {r.engine} | {r.tok_s:.1f} | {mb} | {bw} | {r.agree} |")
    k = len(next(iter(rep.verify.values()), []))
    lines += ["", "Verify pass of K+1 tokens / one-token step (context = prompt + 64):", "",
              "| engine | " + " | ".join(f"K={i}" for i in range(1, k + 1)) + " |", "|---|" + "---|" * k]
    for name, c in rep.verify.items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in c) + " |")
    for name, c in rep.floor.items():
        lines.append(f"| compute floor, {name} | " + " | ".join(f"{x:.2f}" for x in c) + " |")
    if rep.floor:
        lines += ["", f"Compute floor: the K+1 tokens' product FLOPs at {rep.peak_gflops:.0f} GFLOP/s (this engine's "
                  "bf16 product on a hot 64 x 576 x 3072 block, measured in this run) over the one-token step: no "
                  "verify pass can cost less here (attention, norms and staging come on top)."]
    if rep.drafter:
        lines += ["", "| drafter pass | ms | / target decode step |", "|---|---|---|"]
        lines += [f"| γ = {g} | {ms:.2f} | {ratio:.3f} |" for g, (ms, ratio) in rep.drafter.items()]
    lines += [""] + [f"- {n}" for n in rep.notes]
    return "\n".join(lines) + "\n"


def plot(rep: Report, path: Path) -> bool:
    """tok/s bars and verify-cost lines; False when matplotlib is missing (pip install -e .[bench])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed (pip install -e .[bench]); no plot")
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.barh([r.engine for r in rep.rows], [r.tok_s for r in rep.rows], color="tab:blue")
    a.set_xlabel("decode tok/s (batch 1)")
    a.invert_yaxis()
    for name, c in rep.verify.items():
        b.plot(range(1, len(c) + 1), c, marker="o", label=name)
    b.axhline(1.3, color="grey", linestyle="--", linewidth=1, label="1.3× target")
    b.set_xlabel("K (verify K+1 tokens)")
    b.set_ylabel("cost / one-token step")
    b.legend()
    fig.suptitle(rep.machine, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="number of prompts, alternating code/chat (≤ 6)")
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--quants", default="W8A16", help="comma list of W8A16, W8A8_SQ_PER_CHANNEL, FP8 ('' = none)")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded SmolLM2-135M)")
    ap.add_argument("--drafter", default=None, help="drafter dir (default: the shipped one, with the default model)")
    ap.add_argument("--llama-gguf", action="append", default=[], metavar="LABEL=PATH",
                    help="GGUF for llama.cpp (repeatable), e.g. bf16=smollm2-bf16.gguf q8_0=smollm2-q8_0.gguf")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    ap.add_argument("--engine", default=None, help="force the native engine (amx | avx512 | avx2 | torch), as "
                    "DSPARK_NATIVE_ENGINE")
    ap.add_argument("--llama-isa", default=None, help="use the llama.cpp build of scripts/setup_llama_cpp.sh for this "
                    "ISA (runs/gguf/llama-ISA: avx512, avx2, native)")
    ap.add_argument("--out", type=Path, default=None,
                    help="markdown report (default docs/benchmarks-runtime-<CPU family>[-engine-<e>].md)")
    ap.add_argument("--plot", type=Path, default=None, help="plot (default: the report's name with .png)")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    if args.engine:
        os.environ["DSPARK_NATIVE_ENGINE"] = args.engine
    if args.out is None:
        from dspark_trt.runtime import native

        args.out = ROOT / "docs" / f"benchmarks-runtime-{native.report_suffix()}.md"
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    if args.llama_isa:
        import sys

        sys.path.insert(0, str(ROOT / "runs" / "gguf" / f"llama-{args.llama_isa}"))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    rep = run(args)
    text = markdown(rep, args)
    if not args.no_plot and plot(rep, args.plot):
        text += f"\n![runtime benchmark]({args.plot.name})\n"
    text += ("\nGenerated by `scripts/bench_runtime.py`. On a shared machine the load average above matters: compare "
             "rows of one run, not runs. Design notes and what was tried: docs/runtime.md.\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    log.info("%s\nwrote %s", text, args.out)
    return rep


if __name__ == "__main__":
    main()
