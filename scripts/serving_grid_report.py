"""Reporting of scripts/bench_serving_grid.py: grid.json, grid.md (stamped with machine, commit and load average:
the cell table, K per round by batch size, the issue #23 criteria) and grid.png (output tok/s vs concurrency per
policy; ITL p50 vs output tok/s). Pure functions of the grid's result dict; matplotlib only for the plot.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger("bench_serving_grid")

FIXED = ("fixed3", "fixedg")


def machine() -> str:
    """Host · CPU model · cores · OS · Python · UTC time."""
    cpu = "unknown CPU"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.node()} · {cpu} · {os.cpu_count()} cores visible · {platform.system()} {platform.release()} · "
            f"Python {platform.python_version()} · {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC")


def commit() -> str:
    """The checkout's short commit, "+dirty" when tracked files differ from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _cell(cells: list[dict[str, Any]], policy: str, c: int) -> dict[str, Any] | None:
    return next((x for x in cells if x["policy"] == policy and x["concurrency"] == c), None)


def criteria(cells: list[dict[str, Any]]) -> list[str]:
    """The issue's done-when checks that this grid can answer (PASS / FAIL, or n/a when a row is missing)."""
    levels = sorted({x["concurrency"] for x in cells})
    out = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        out.append(f"- {'n/a' if ok is None else 'PASS' if ok else 'FAIL'}: {name} ({detail})")

    ratios, fixed_ratios, low = [], [], []
    for c in levels:
        s, p = _cell(cells, "survival", c), _cell(cells, "plain", c)
        if s and p and p["tok_s"]:
            ratios.append((c, s["tok_s"] / p["tok_s"]))
        fixed = [x["tok_s"] for f in FIXED if (x := _cell(cells, f, c))]
        if s and fixed and c >= 16:
            fixed_ratios.append((c, s["tok_s"] / max(fixed)))
    low = [(c, r) for c, r in ratios if c <= 2]
    fmt = lambda rs: ", ".join(f"c={c}: {r:.2f}×" for c, r in rs) or "no cells"  # noqa: E731
    check("survival ≥ 0.97 × plain output tok/s at every concurrency",
          all(r >= 0.97 for _, r in ratios) if ratios else None, fmt(ratios))
    check("survival ≥ best fixed K at concurrency ≥ 16", all(r >= 1.0 for _, r in fixed_ratios) if fixed_ratios
          else None, fmt(fixed_ratios))
    check("survival ≥ 1.1 × plain at concurrency 1–2", all(r >= 1.1 for _, r in low) if low else None, fmt(low))
    wrong = sum(x["wrong"] for x in cells)
    errors = sum(x["errors"] for x in cells)
    other = sum(x.get("other_draws", 0) for x in cells)
    check("every answer under load equals its single-stream answer", wrong == 0 and errors == 0,
          f"{sum(x['ok'] for x in cells)} equal, {wrong} different, {errors} errors"
          + (f"; {other} sampled answers of rows the DSpark drafter drafts drew other tokens (not checked)"
             if other else ""))
    return out


def markdown(result: dict[str, Any]) -> str:
    """grid.md: header, the cell table, K by batch size per policy, the criteria."""
    st, cells = result["setup"], result["cells"]
    kinds = [j["kind"] for j in result["jobs"]]
    lines = [f"Machine: {result.get('machine', machine())}", f"Commit: {result.get('commit', commit())}",
             f"Load average (1/5/15 min) before {'/'.join(map(str, st['load_before']))}, after "
             f"{'/'.join(map(str, st['load_after']))} on {os.cpu_count()} cores",
             f"Repo: {st['repo']} · γ {st['gamma']} · {st['kv_slots']} KV slots · max_seq_len {st['max_seq_len']} · "
             f"MAX_QUEUE {st['max_queue']} · threads {st['threads']} · {st['requests_per_cell']} request(s)/client/"
             f"cell · max_tokens {st['max_tokens']} · prompts: {kinds.count('chat')} chat + {kinds.count('code')} "
             f"code of ≤ {st['long_tokens']} tokens · "
             f"{'sampled at T ' + str(st['temperature']) + ', job i seeded ' + str(st['seed']) + ' + i' if st.get('temperature') else 'greedy'}"
             f" · gRPC streaming through ensemble_stream · "
             f"{st['wall_s']} s in all", ""]
    lines += [f"Note: {n}" for n in st.get("notes", [])]
    if st.get("policies"):  # each row's `proposers` field (sent in every request of the row; plain sends none)
        lines += ["Proposers per request: " + " · ".join(f"{r['name']} {r.get('proposers') or '(not sent)'}"
                                                        for r in st["policies"]), ""]
    lines += ["| policy | concurrency | output tok/s | × plain | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
              "mean K | τ | requests (chat/code) | wrong | errors |", "|" + "---|" * 12]
    for x in sorted(cells, key=lambda x: (x["concurrency"], x["policy"])):
        p = _cell(cells, "plain", x["concurrency"])
        rel = f"{x['tok_s'] / p['tok_s']:.2f}" if p and p["tok_s"] else "—"
        t, i = x["ttft_ms"], x["itl_ms"]
        lines.append(f"| {x['policy']} | {x['concurrency']} | {x['tok_s']:.1f} | {rel} | {x['req_s']:.2f} | "
                     f"{t['p50']} / {t['p99']} | {i['p50']} / {i['p99']} | {x['mean_k']:.2f} | {x['tau']:.2f} | "
                     f"{x['requests']} ({x['prompt_kinds']['chat']}/{x['prompt_kinds']['code']}) | {x['wrong']}"
                     f"{' (+' + str(x['other_draws']) + ' other draws)' if x.get('other_draws') else ''} | "
                     f"{x['errors']} |")
    buckets = sorted({b for x in cells for b in x["k_by_batch"]}, key=lambda b: int(b.split("-")[0]))
    lines += ["", "Mean K per request per round by the round's batch size (all cells of a policy):", "",
              "| policy | " + " | ".join(f"batch {b}" for b in buckets) + " |", "|" + "---|" * (len(buckets) + 1)]
    for pol in dict.fromkeys(x["policy"] for x in cells):
        row = []
        for b in buckets:
            ks = [(x["k_by_batch"][b]["mean_k"], x["k_by_batch"][b]["rounds"]) for x in cells
                  if x["policy"] == pol and b in x["k_by_batch"]]
            n = sum(r for _, r in ks)
            row.append(f"{sum(k * r for k, r in ks) / n:.2f} ({n})" if n else "—")
        lines.append(f"| {pol} | " + " | ".join(row) + " |")
    lines += ["", "(rounds in parentheses)", "", "Issue #23 criteria on this grid:"] + criteria(cells)
    for x in cells:
        for w in x["first_wrong"]:
            lines.append(f"- mismatch: {x['policy']} c={x['concurrency']}: job {w['job']} ({w['kind']}) differs from "
                         f"its single-stream answer at token {w['first_difference_at']} ({w['got']} vs {w['want']})")
        for e in x["first_errors"]:
            lines.append(f"- error: {x['policy']} c={x['concurrency']}: {e}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """grid.png: output tok/s vs concurrency per policy (left), ITL p50 vs output tok/s (right)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cells = result["cells"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for pol in dict.fromkeys(x["policy"] for x in cells):
        xs = sorted((x for x in cells if x["policy"] == pol), key=lambda x: x["concurrency"])
        ax1.plot([x["concurrency"] for x in xs], [x["tok_s"] for x in xs], marker="o", label=pol)
        pts = [(x["tok_s"], x["itl_ms"]["p50"], x["concurrency"]) for x in xs if x["itl_ms"]["p50"] is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
        for tok, itl, c in pts:
            ax2.annotate(str(c), (tok, itl), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput vs concurrency")
    ax2.set_xlabel("output tokens/s")
    ax2.set_ylabel("ITL p50 (ms per token)")
    ax2.set_title("inter-token latency vs throughput (labels: clients)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"DSpark served grid · {result.get('commit', '')} · {result['setup']['repo']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path, plot_png: bool = True) -> str:
    """grid.json, grid.md (+ grid.png) under `out` → the markdown text."""
    out.mkdir(parents=True, exist_ok=True)
    result.setdefault("machine", machine())
    result.setdefault("commit", commit())
    text = markdown(result)
    (out / "grid.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "grid.md").write_text(text)
    if plot_png:
        plot(result, out / "grid.png")
    log.info("results in %s", out)
    return text + f"\nresults: {out}/grid.json, grid.md" + (", grid.png" if plot_png else "") + "\n"
