#!/usr/bin/env python
"""How much a better choice between the DSpark block and the suffix match could gain, offline: a measurement of
headroom, not a benchmark.

The hybrid (survival, proposers dspark + suffix, the shipped corpus) decodes each prompt with both proposers asked
every round: the drafting gate and the before-drafting skip (`scheduler.plan_drafting`, `proposers.skip_drafter`) are
bypassed, the choice after the pass (`proposers.assemble`) is the product's. Each round records the output position,
the suffix proposal (tokens, c_j, source) and the DSpark block (tokens, c_j); a proposal's accepted length is its
common prefix with the prompt's plain greedy answer there (the output is checked equal to it). Then every round is
re-decided by each chooser and priced with the profiled cost table (target pass over 1 + K tokens, + the drafter's
one-row pass where it drafted): tokens / seconds summed over the rounds, as a speed relative to plain. The rounds are
the forced-drafting trajectory's positions (an approximation of each chooser's own), and the table leaves out the
loop's overheads, so compare rows, not these speeds with `dspark-trt bench`.

Choosers: suffix alone (K by the survival rule over its c_j); DSpark alone, drafting every round; both every round
(the drafter always paid, the better confidence-rated proposal verified); suffix unless its rated throughput is
below thr × plain, then DSpark; and the hindsight oracle (per round the best of none / suffix / DSpark, the drafter
paid only when DSpark is taken) — no real chooser can reach it. Also the joint acceptance by the suffix's c_1.

    .venv/bin/python scripts/proposer_headroom.py [--prompt-set held-out] [--new 96] [--json OUT]
    .venv/bin/python scripts/proposer_headroom.py --trace OUT --draft-price 1,0.5,0   # re-priced, no model runs
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def trace(prompt_set: str, new: int) -> tuple[Any, list[dict]]:
    """(cost table, per prompt {kind, answer, rounds}) with both proposers asked every round."""
    import torch

    import dspark_trt.spec_decode.loop as loop
    from dspark_trt.commands.bench import load_prompts
    from dspark_trt.engine import SpeculativeDecodingEngine, build_backend, to_runtime_model
    from dspark_trt.runtime.default_model import default_target_dir
    from dspark_trt.runtime.drafters import default_drafter_dir, load_drafter
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.runtime.profile import profile_costs

    rounds: list[dict] = []
    cur: dict[str, Any] = {}
    loop.plan_drafting = lambda cfgs, states, dcaps, *a, **k: list(dcaps)  # every row drafts
    loop.skip_drafter = lambda dcaps, *a, **k: list(dcaps)
    asked, assemble = loop.RoundScheduler._suffix_proposals, loop.assemble

    def suffix_proposals(self, acts, caps):  # noqa: ANN001, ANN202
        out = asked(self, acts, caps)
        p = out[0]
        cur.update(pos=len(acts[0].tokens), cap=caps[0],
                   sfx=None if p is None else {"t": list(p.tokens), "c": [float(c) for c in p.conf], "src": p.source})
        return out

    def record(cfgs, states, sampling, caps, dcaps, rows, proposed, block, proposals, vocab, table):  # noqa: ANN001, ANN202
        plan = assemble(cfgs, states, sampling, caps, dcaps, rows, proposed, block, proposals, vocab, table)
        d = None
        if block is not None and proposed[0] > 0 and block.conf is not None:
            d = {"t": block.tokens[0, :proposed[0]].tolist(), "c": block.conf[0, :proposed[0]].tolist()}
        rounds.append(dict(cur, dsp=d, chosen=plan.source[0]))
        return plan

    loop.RoundScheduler._suffix_proposals, loop.assemble = suffix_proposals, record
    torch.set_num_threads(2)
    td = default_target_dir()
    tok = load_tokenizer(td)
    target = to_runtime_model(td, torch.bfloat16)
    drafter = load_drafter(default_drafter_dir(), target, dtype=torch.bfloat16, target_dir=Path(td))
    prompts = load_prompts(None, prompt_set)
    ids = [[int(t) for t in tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}],
                                                               add_generation_prompt=True, tokenize=False)
                                       if p.chat else p.text)] for p in prompts]
    max_len = max(map(len, ids)) + new + 2
    gamma = int(drafter.gamma)
    table = profile_costs(build_backend(target, drafter, 2, max_len + gamma + 2), gamma + 1, reps=5)
    plain = SpeculativeDecodingEngine(target, None, tok, max_len, gamma, policy="plain")
    hybrid = SpeculativeDecodingEngine(target, drafter, tok, max_len, gamma, policy="survival", cost_table=table,
                                       proposers="dspark,suffix", corpus="auto")
    plain.eos_ids = hybrid.eos_ids = ()  # EOS ignored, as dspark-trt bench
    out = []
    for p, prompt in zip(prompts, ids):
        answer = plain.run(prompt, new).tokens
        hybrid.suffix.forget_outputs()
        n0 = len(rounds)
        if hybrid.run(prompt, new).tokens != answer:
            raise SystemExit(f"the hybrid's output differs from plain greedy on {p.text[:60]!r}: a losslessness bug")
        out.append({"kind": p.kind, "answer": answer, "rounds": rounds[n0:]})
    return table, out


def accepted(prop: list[int], answer: list[int], t: int) -> int:
    n = 0
    while n < len(prop) and t + n < len(answer) and prop[n] == answer[t + n]:
        n += 1
    return n


def evaluate(table: Any, prompts: list[dict], draft_price: float = 1.0) -> str:
    """The choosers' speeds relative to plain, and the joint acceptance by the suffix's c_1, as markdown.
    draft_price: the drafter's pass at this multiple of its profiled price (0: free) — what a cheaper drafter pass
    would let a chooser gain, with the same proposals."""
    step, draft = table.step_seconds, table.draft_seconds(1) * draft_price

    def best_k(c: list[float], cap: int, extra: float = 0.0) -> tuple[int, float]:
        best, bk, gained, run = 1.0 / (step(1) + extra), 0, 0.0, 1.0
        for k, cj in enumerate(c[:cap], start=1):
            run *= cj
            gained += run
            rate = (1 + gained) / (step(1 + k) + extra)
            if rate > best:
                best, bk = rate, k
        return bk, best

    tot: dict[str, list[float]] = {}
    joint: dict[tuple[float, float], list[int]] = {}
    bins = ((0.0, 0.2), (0.2, 0.35), (0.35, 0.5), (0.5, 0.7), (0.7, 1.01))

    def add(name: str, tokens: float, secs: float) -> None:
        t = tot.setdefault(name, [0.0, 0.0])
        t[0], t[1] = t[0] + tokens, t[1] + secs

    n = 0
    for p in prompts:
        ans = p["answer"]
        for r in p["rounds"]:
            t, s, d, cap = r["pos"], r["sfx"], r["dsp"], r["cap"]
            if t >= len(ans) - 1 or d is None:
                continue
            n += 1
            add("plain", 1, step(1))
            ks, rs = best_k(s["c"], cap) if s else (0, 1.0 / step(1))
            ns = min(accepted(s["t"], ans, t), ks) if s else 0
            kd, _ = best_k(d["c"], cap, draft)
            nd = min(accepted(d["t"], ans, t), kd)
            rd = best_k(d["c"], cap)[1]
            suffix, dspark = (1 + ns, step(1 + ks)), (1 + nd, step(1 + kd) + draft)
            add("suffix alone", *suffix)
            add("DSpark alone, drafting every round", *dspark)
            add("both every round, the better rated one verified",
                *((suffix[0], suffix[1] + draft) if rs >= rd else dspark))
            for thr in (1.0, 1.1, 1.2):
                add(f"suffix unless rated < {thr} x plain, then DSpark",
                    *(suffix if s and rs >= thr / step(1) else dspark))
            add("oracle (hindsight)", *max([(1, step(1)), suffix, dspark], key=lambda x: x[0] / x[1]))
            if s:
                b = next(b for b in bins if b[0] <= s["c"][0] < b[1])
                joint.setdefault(b, []).append((accepted(s["t"], ans, t), accepted(d["t"], ans, t)))
    base = tot["plain"][0] / tot["plain"][1]
    priced = "profiled" if draft_price == 1.0 else f"{draft_price:g}× the profiled price"
    lines = [f"{n} rounds; drafter pass {draft / step(1):.2f}× a one-token step ({priced})", "",
             "| chooser | tokens a round | speed vs plain (cost table) |", "|---|---|---|"]
    lines += [f"| {k} | {a / n:.2f} | {a / b / base:.3f} |" for k, (a, b) in tot.items()]
    lines += ["", "| suffix c_1 | rounds | suffix keeps ≥ 1 | DSpark keeps ≥ 1 | suffix mean kept | DSpark mean kept |",
              "|---|---|---|---|---|---|"]
    for (lo, hi), pairs in sorted(joint.items()):
        m = len(pairs)
        lines.append(f"| [{lo:.2f}, {min(hi, 1.0):.2f}) | {m} | {sum(a >= 1 for a, _ in pairs) / m:.2f} | "
                     f"{sum(b >= 1 for _, b in pairs) / m:.2f} | {sum(a for a, _ in pairs) / m:.2f} | "
                     f"{sum(b for _, b in pairs) / m:.2f} |")
    return "\n".join(lines)


def main() -> None:
    from dspark_trt.commands.bench import PROMPT_SETS
    from dspark_trt.runtime import native

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-set", choices=PROMPT_SETS, default="held-out")
    ap.add_argument("--new", type=int, default=96, help="greedy answer tokens per prompt (EOS ignored)")
    ap.add_argument("--json", type=Path, default=None, help="also write the traced rounds here")
    ap.add_argument("--trace", type=Path, default=None,
                    help="re-price the rounds a --json run wrote instead of tracing (no model runs)")
    ap.add_argument("--draft-price", default="1",
                    help="comma list of drafter-pass prices, multiples of the profiled one (0: free), one table each")
    args = ap.parse_args()
    from dspark_trt.spec_decode.costs import CostTable

    try:
        prices = [float(x) for x in args.draft_price.split(",") if x]
    except ValueError:
        prices = []
    if not prices or min(prices) < 0:
        raise SystemExit(f"--draft-price: a comma list of numbers ≥ 0, got {args.draft_price!r}")
    if args.trace is not None:
        saved = json.loads(args.trace.read_text())
        table, prompts = CostTable.from_dict(saved["table"]), saved["prompts"]
        print(f"rounds traced earlier: {args.trace}\n")
    else:
        table, prompts = trace(args.prompt_set, args.new)
        print(f"prompt set {args.prompt_set}, {args.new} tokens each, engine {native.engine()} "
              f"({native.cpu_model()})\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"table": table.to_json(), "prompts": prompts}))
    for price in prices:
        print(evaluate(table, prompts, price) + "\n")


if __name__ == "__main__":
    main()
