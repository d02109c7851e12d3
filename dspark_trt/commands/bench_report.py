"""The `dspark-trt bench` report: markdown (docs/benchmarks-<CPU family>.md) and a PNG plot next to it.

Owns the machine/commit stamp, the tables (tok/s and ratios by engine; τ, acceptance and drafted-round share;
acceptance per position j; τ by prompt kind; the measured cost table) and the plot (tok/s by engine, acceptance
by position). Knows the bench's result shapes, nothing about running models.
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger("dspark_trt.bench")


def machine_stamp() -> dict[str, Any]:
    """CPU model, vector flags and kernel engine (runtime.native.cpu_summary), cores, torch, commit, date."""
    import torch

    from dspark_trt.runtime import native

    cpu = native.cpu_summary()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"cpu": cpu["cpu"], "flags": " ".join(cpu["flags"]), "engine": cpu["engine"], "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _temperature(args: argparse.Namespace) -> float:
    return float(getattr(args, "temperature", 0.0) or 0.0)


def _length_label(args: Any, results: dict[str, Any]) -> str:
    """How long each run's answer is: --max-new-tokens with EOS ignored, or the answer's own length (--stop-at-eos:
    plain's answers' mean, min and max)."""
    if getattr(args, "stop_at_eos", False):
        lens = [s.committed_tokens for s in results["ours plain"].stats] or [0]
        return (f"answers end at EOS as requests do (at most {args.max_new_tokens} new tokens; plain's answers "
                f"{statistics.mean(lens):.1f} tokens on average, {min(lens)}–{max(lens)}; tok/s over each answer's "
                f"own tokens, 1-token answers skipped)")
    return f"EOS ignored, {args.max_new_tokens} new tokens per run"


def _sampling_label(args: argparse.Namespace) -> str:
    t = _temperature(args)
    return (f"sampled at temperature {t:g} (prompt i seeded {args.seed} + i, the same seed for every engine: a suffix "
            f"round commits plain sampling's tokens, a DSpark round keeps the distribution, not the seed's tokens)"
            if t > 0 else "greedy")


def _sampling_flags(args: argparse.Namespace) -> str:
    t = _temperature(args)
    return f" --temperature {t:g} --seed {args.seed}" if t > 0 else ""


def _corpus_label(spec: str) -> str:
    if spec == "none":
        return "none (the request's own tokens only)"
    if spec == "auto":
        return ("the shipped one (the target's greedy answers to the drafter's training prompts; no benchmark prompt "
                "among them) when the target is the embedded default")
    return spec


def _set_label(args: argparse.Namespace) -> str:
    name = getattr(args, "prompt_set", "held-out")
    return "held-out set: never used in training" if name == "held-out" else f"prompt set {name}"


def _merged(stats: list[Any]) -> Any:
    return stats[0].merge(stats[1:])


def write_report(args: argparse.Namespace, results: dict[str, Any], gamma: int, n_prompts: int, draft_dir: Path,
                 table: Any) -> str:
    """Markdown report → args.out, plot → args.out with suffix .png; returns the markdown."""
    stamp = machine_stamp()
    med = {k: statistics.median(v.rates) for k, v in results.items() if v.rates}
    plain = med.get("ours plain", 0.0)
    hf = next((v for k, v in med.items() if k.startswith("HF generate")), None)  # its dtype in its name
    lines = [
        "# Benchmarks", "",
        f"Machine: {stamp['cpu']}, {stamp['cores']} cores (torch threads {stamp['torch_threads']}), "
        f"torch {stamp['torch']}, commit {stamp['commit']}, {stamp['date']}. Kernel engine: **{stamp['engine']}** "
        f"(CPU flags: {stamp['flags']}).", "",
        f"Target: {args.target or 'embedded SmolLM2-135M-Instruct'} ({args.dtype}); drafter: {draft_dir.name} "
        f"(γ = {gamma}). {n_prompts} prompts ({args.prompts or _set_label(args)}), {_sampling_label(args)}, "
        f"{_length_label(args, results)}, {args.repeats} interleaved round(s). Decode tok/s "
        f"excludes prompt processing (a 1-token run of the same prompt is subtracted); median over prompts × rounds. "
        f"Command: `dspark-trt bench --max-new-tokens {args.max_new_tokens} --repeats {args.repeats} --threads "
        f"{stamp['torch_threads']}"
        f"{'' if getattr(args, 'fixed_k', 'all') == 'all' else ' --fixed-k ' + str(args.fixed_k)}"
        f"{' --no-hf' if getattr(args, 'no_hf', False) else ''}"
        f"{' --prompt-set ' + args.prompt_set if getattr(args, 'prompt_set', 'held-out') != 'held-out' else ''}"
        f"{' --max-prompts ' + str(args.max_prompts) if getattr(args, 'max_prompts', 0) else ''}"
        f"{' --corpus ' + str(args.corpus) if getattr(args, 'corpus', 'auto') != 'auto' else ''}"
        f"{' --stop-at-eos' if getattr(args, 'stop_at_eos', False) else ''}"
        f"{_sampling_flags(args)}`. Suffix corpus "
        f"(the suffix rows): {_corpus_label(getattr(args, 'corpus', 'auto'))}.", "",
        "| engine | decode tok/s | vs ours plain | vs HF | τ | acceptance α | drafted rounds | "
        f"first-token reject | output = {'plain sampling (same seed)' if _temperature(args) > 0 else 'plain greedy'} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    per_pos: list[str] = []
    kinds = sorted({k for r in results.values() for k in r.kinds})
    per_kind: list[str] = []
    per_proposer: list[str] = []
    for name, r in med.items():
        vs_plain = f"{r / plain:.2f}×" if plain else "–"
        vs_hf = f"{r / hf:.2f}×" if hf else "–"
        res = results[name]
        if not res.stats:
            lines.append(f"| {name} | {r:.1f} | {vs_plain} | {vs_hf} | 1.00 | – | – | – | reference |")
            continue
        s = _merged(res.stats)
        same = "reference" if name == "ours plain" else (
            "yes" if res.mismatches == 0 else f"other draws in {res.mismatches} runs" if _temperature(args) > 0
            else f"NO ({res.mismatches} runs differ)")
        rounds = max(s.verify_calls, 1)
        alpha, ftr = ((f"{s.acceptance_rate:.2f}", f"{s.first_token_rejection_rate:.2f}") if s.drafted_tokens
                      else ("–", "–"))
        drafted = f"{s.draft_calls / rounds:.0%}" if name != "ours plain" else "–"
        lines.append(f"| {name} | {r:.1f} | {vs_plain} | {vs_hf} | {s.tau:.2f} | {alpha} | {drafted} | {ftr} | "
                     f"{same} |")
        if s.drafted_tokens:
            cells = [f"{x:.2f}" for x in s.acceptance_per_position()][:gamma]
            per_pos.append(f"| {name} | " + " | ".join(cells + ["–"] * (gamma - len(cells))) + " |")
        for prop, ps in sorted(s.by_proposer.items()):
            pos = " ".join(f"{a / v:.2f}" for a, v in list(zip(ps.pos_accepted, ps.pos_verified))[:gamma])
            share = ps.accepted_tokens / max(s.committed_tokens, 1)
            label = prop if prop != "suffix" or not s.suffix_sources else prop + " (" + ", ".join(
                f"{src} {a}" for src, (_, a) in sorted(s.suffix_sources.items())) + ")"  # accepted tokens by source
            per_proposer.append(f"| {name} | {label} | {ps.rounds} | {ps.accepted_tokens} ({share:.0%}) | "
                                f"{ps.accepted_tokens / max(ps.drafted_tokens, 1):.2f} | {pos} |")
        if name != "ours plain":
            taus = [_merged([st for st, k in zip(res.stats, res.kinds) if k == kind]).tau for kind in kinds]
            per_kind.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    if per_pos:
        lines += ["", "Acceptance per position j (rounds with accepted ≥ j / rounds that verified ≥ j tokens):", "",
                  "| engine | " + " | ".join(f"j={j}" for j in range(1, gamma + 1)) + " |", "|---|" + "---|" * gamma]
        lines += per_pos
    if per_proposer:
        lines += ["", "By proposer (rounds it supplied the verified tokens; accepted tokens and their share of all "
                  "generated tokens; α; α per position j; the suffix proposer's accepted tokens by where its match "
                  "was found: own tokens, recent outputs, corpus):", "",
                  "| engine | proposer | rounds | accepted tokens | α | α_j |", "|---|---|---|---|---|---|"]
        lines += per_proposer
    if per_kind and kinds:
        lines += ["", "τ by prompt kind:", "", "| engine | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        lines += per_kind
    base = table.seconds[0]
    lines += ["", "Measured costs (batch 1, shared by every policy): target step by tokens in one pass "
              + ", ".join(f"{n}: {s / base:.2f}×" for n, s in zip(table.tokens, table.seconds))
              + f" (1 token = {base * 1e3:.1f} ms); drafter pass {table.draft_seconds(1) / base:.2f}× a decode step"
              + f" (a sampled row's drafting and its acceptance +{table.sampled_t1 / base:.2f}×).",
              "", "τ = generated tokens / target forwards (prefill included, bonus included). \"drafted rounds\": share "
              "of rounds in which the drafter ran (the survival policy skips it while it does not pay).", ""]
    png = args.out.with_suffix(".png")
    if _plot(png, med, results, gamma, stamp):
        lines += [f"![tok/s by engine and acceptance by position]({png.name})", ""]
    if args.note:
        lines += ["## Notes", ""] + [f"- {n}" for n in args.note] + [""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return text


def _plot(path: Path, med: dict[str, float], results: dict[str, Any], gamma: int, stamp: dict[str, Any]) -> bool:
    """tok/s by engine (bars) and acceptance by position j (lines); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install 'dspark_trt[dev]')")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    names = list(med)
    ax1.barh(names, [med[n] for n in names], color=["tab:gray" if "DSpark" not in n else "tab:blue" for n in names])
    ax1.set_xlabel("decode tok/s (median)")
    ax1.invert_yaxis()
    ax1.tick_params(axis="y", labelsize=7)
    for name, res in results.items():
        if res.stats and "DSpark" in name:
            acc = _merged(res.stats).acceptance_per_position()[:gamma]
            if acc:
                ax2.plot(range(1, len(acc) + 1), acc, marker="o", label=name.replace("ours DSpark ", ""))
    ax2.set_xlabel("draft position j")
    ax2.set_ylabel("acceptance (accepted ≥ j | verified ≥ j)")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=6)
    fig.suptitle(f"dspark-trt bench — {stamp['cpu']}, engine {stamp['engine']}, {stamp['torch_threads']} threads, "
                 f"{stamp['commit']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
