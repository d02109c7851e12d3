#!/usr/bin/env python
"""How much τ a suffix proposer could reach on a prompt set, offline: the target's own greedy answers, then every
round re-played with each way of choosing the continuation to propose. A measurement of headroom, not a benchmark.

For each prompt: the target's greedy answer (plain decoding, `--new` tokens, EOS ignored as `dspark-trt bench`
does; `--eos-cut` also reports each answer cut at its first EOS). Then rounds are replayed at fixed K = cap (the
proposal verified whole): the round keeps the agreeing prefix plus one target token. Choices, over the
occurrences in prompt + committed tokens of the longest suffix (≤ 8 tokens) of the committed sequence:
- product: this package's `spec_decode.suffix.SuffixProposer` (own tokens only; the most frequent continuation);
- first: the earliest occurrence; vote: the latest occurrence whose next token is the most frequent next token;
- best-of-longest (oracle): the occurrence that would be accepted furthest — no real proposer can know it;
- any-substring (oracle): the longest run of the true continuation found anywhere in the context — an upper
  bound for copying from context at all.
τ = tokens / rounds (the round's own target token included).

    .venv/bin/python scripts/suffix_headroom.py --prompt-set code-edit [--new 160] [--cap 7]
"""
from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Callable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

Chooser = Callable[[list[int], list[int], int, int], int]  # (context, answer, t, cap) → tokens accepted


def _run(a: Sequence[int], i: int, out: Sequence[int], t: int, cap: int) -> int:
    """Tokens of out[t:] that a proposal copied from a[i:] gets accepted (≤ cap)."""
    n = 0
    while n < cap and i + n < len(a) and t + n < len(out) and a[i + n] == out[t + n]:
        n += 1
    return n


def _occurrences(seq: list[int], max_match: int) -> list[int]:
    """Continuation starts of the longest suffix (≤ max_match) of seq that occurred before with a continuation."""
    for n in range(min(max_match, len(seq) - 1), 0, -1):
        suf = seq[-n:]
        occ = [i for i in range(n, len(seq)) if seq[i - n:i] == suf]
        if occ:
            return occ
    return []


def replay(pairs: list[tuple[list[int], list[int]]], choose: Chooser, cap: int) -> float:
    """τ over all answers when each round proposes what `choose` picks."""
    tokens = rounds = 0
    for prompt, out in pairs:
        seq, t = list(prompt), 0
        while t < len(out):
            n = min(choose(seq, out, t, cap) + 1, len(out) - t)
            seq += out[t:t + n]
            t += n
            tokens += n
            rounds += 1
    return tokens / max(rounds, 1)


def choosers() -> dict[str, Chooser]:
    from dspark_trt.spec_decode.suffix import SuffixConfig, SuffixProposer

    state: dict[int, SuffixProposer] = {}

    def product(seq: list[int], out: list[int], t: int, cap: int) -> int:
        sp = state.setdefault(id(out), SuffixProposer(SuffixConfig().with_recent_tokens(0)))
        p = sp.propose(0, seq, cap)
        return 0 if p is None else _run(p.tokens, 0, out, t, cap)

    def pick(rule: str) -> Chooser:
        def f(seq: list[int], out: list[int], t: int, cap: int) -> int:
            occ = _occurrences(seq, 8)
            if not occ:
                return 0
            if rule == "first":
                return _run(seq, occ[0], out, t, cap)
            if rule == "vote":
                top = Counter(seq[i] for i in occ).most_common(1)[0][0]
                return _run(seq, [i for i in occ if seq[i] == top][-1], out, t, cap)
            return max(_run(seq, i, out, t, cap) for i in occ)  # best-of-longest
        return f

    def any_substring(seq: list[int], out: list[int], t: int, cap: int) -> int:
        for n in range(min(cap, len(out) - t), 0, -1):
            want = out[t:t + n]
            if any(seq[i:i + n] == want for i in range(len(seq) - n + 1)):
                return n
        return 0

    return {"product (the most frequent continuation)": product, "first occurrence": pick("first"),
            "vote": pick("vote"),
            "best of the longest match's occurrences (oracle)": pick("best"),
            "any substring of the context (oracle)": any_substring}


def main() -> None:
    import torch

    from dspark_trt.commands.bench import PROMPT_SETS, load_prompts
    from dspark_trt.engine import build_backend, to_runtime_model
    from dspark_trt.runtime import native
    from dspark_trt.runtime.default_model import default_target_dir
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.spec_decode.loop import generate
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-set", choices=PROMPT_SETS, default="code-edit")
    ap.add_argument("--new", type=int, default=160, help="greedy answer tokens per prompt")
    ap.add_argument("--cap", type=int, default=7, help="tokens proposed (and verified) per round")
    args = ap.parse_args()
    td = default_target_dir()
    tok = load_tokenizer(td)
    be = build_backend(to_runtime_model(td, torch.bfloat16), None, 1, 2048)
    pairs = []
    for p in load_prompts(None, args.prompt_set):
        text = (tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                        tokenize=False) if p.chat else p.text)
        ids = tok.encode(text)
        pairs.append((list(ids), generate(be, ids, args.new, policy=PolicyConfig(policy="plain")).tokens))
    eos = set(int(e) for e in ([tok.eos_token_id] if tok.eos_token_id is not None else []))
    cut = [(p, o[:next((i + 1 for i, x in enumerate(o) if x in eos), len(o))]) for p, o in pairs]
    print(f"{len(pairs)} prompts ({args.prompt_set}), {args.new} greedy tokens each, cap {args.cap}; engine "
          f"{native.engine()}; answers cut at EOS: {sum(map(len, (o for _, o in cut)))} of "
          f"{sum(map(len, (o for _, o in pairs)))} tokens\n")
    print("| proposal choice | τ, EOS ignored | τ, answers cut at EOS |\n|---|---|---|")
    for name, choose in choosers().items():
        print(f"| {name} | {replay(pairs, choose, args.cap):.2f} | {replay(cut, choose, args.cap):.2f} |")


if __name__ == "__main__":
    main()
