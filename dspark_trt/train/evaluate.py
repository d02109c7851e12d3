"""Honest drafter measurement in the real draft-and-verify loop (spec_decode.loop + runtime.backend.SpecBackend).

Owns: running held-out prompts (train.prompts.HELD_OUT_PROMPTS, never trained on; or `unanswered_prompts`: prompts of
the training generators the data set never answered) greedily at fixed K = γ,
checking the output equals plain greedy decoding (lossless), and reporting τ, acceptance per position,
and drafter cost (mean propose time) as a fraction of one target decode step and of one verify pass.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from dspark_trt.spec_decode.loop import LoopConfig, generate
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.spec_decode.stats import SpecStats, TimedBackend

log = logging.getLogger(__name__)


def _device(target) -> torch.device:  # noqa: ANN001
    return next(target.parameters()).device


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def plain_greedy(target, prompt: Sequence[int], max_new: int, eos: Sequence[int]) -> list[int]:  # noqa: ANN001
    dev = _device(target)
    cache = target.new_cache(1, len(prompt) + max_new + 2)
    s = torch.tensor([0], device=dev)
    logits = target(torch.tensor([list(prompt)], device=dev), cache, s, logits="last").logits[0, -1]
    out: list[int] = []
    while True:
        t = int(logits.argmax())
        out.append(t)
        if t in eos or len(out) >= max_new:
            return out
        logits = target(torch.tensor([[t]], device=dev), cache, s, logits="last").logits[0, -1]


def decode_step_ms(target, ctx: int = 256, n: int = 8) -> float:  # noqa: ANN001
    """Mean wall time of one single-token target decode step at context ctx."""
    dev = _device(target)
    cache = target.new_cache(1, ctx + n + 1)
    s = torch.tensor([0], device=dev)
    target(torch.randint(10, int(target.config.vocab_size), (1, ctx), device=dev), cache, s, logits="none")
    times = []
    for _ in range(n):
        _sync(dev)
        t = time.perf_counter()
        target(torch.tensor([[5]], device=dev), cache, s, logits="last")
        _sync(dev)
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def measure(target, drafter, prompts: Sequence[tuple[str, Sequence[int]]], gammas: Sequence[int],  # noqa: ANN001
            max_new: int, eos: Sequence[int], check_lossless: bool = True) -> dict[str, Any]:
    from dspark_trt.runtime.backend import SpecBackend

    max_seq = max(len(p) for _, p in prompts) + max_new + 32
    backend = TimedBackend(SpecBackend(target, drafter, max_batch=1, max_seq=max_seq))
    ref = {i: plain_greedy(target, p, max_new, eos) for i, (_, p) in enumerate(prompts)} if check_lossless else {}
    step_ms = decode_step_ms(target)
    res: dict[str, Any] = {"decode_step_ms": round(step_ms, 2), "by_gamma": {}}
    for g in gammas:
        backend.reset()
        stats: list[SpecStats] = []
        by_kind: dict[str, list[SpecStats]] = {}
        mismatches = 0
        for i, (kind, p) in enumerate(prompts):
            r = generate(backend, p, max_new_tokens=max_new, sampling=SamplingParams(),
                         policy=PolicyConfig(policy="fixed", k=g), eos_ids=eos, config=LoopConfig(gamma=g))
            if check_lossless and r.tokens != ref[i]:
                mismatches += 1
            stats.append(r.stats)
            by_kind.setdefault(kind, []).append(r.stats)
        agg = SpecStats().merge(stats)
        res["by_gamma"][g] = {
            "tau": round(agg.tau, 3), "acceptance_per_position": [round(x, 3) for x in agg.acceptance_per_position()],
            "tau_by_kind": {k: round(SpecStats().merge(v).tau, 3) for k, v in by_kind.items()},
            "draft_ms": round(backend.mean_ms("draft"), 2), "verify_ms": round(backend.mean_ms("verify"), 2),
            "draft_cost_vs_decode_step": round(backend.mean_ms("draft") / step_ms, 3),
            "draft_cost_vs_verify": round(backend.mean_ms("draft") / max(1e-9, backend.mean_ms("verify")), 3),
            "lossless_mismatches": mismatches}
        log.info("γ=%d: %s", g, res["by_gamma"][g])
    return res


def held_out_prompts(tok, n: int = 0) -> list[tuple[str, list[int]]]:  # noqa: ANN001
    """(kind, chat-template ids) of the held-out prompts; n > 0: every (18 // n)-th, keeping the code/chat/math mix."""
    from dspark_trt.train.chatgen import chat_prompt_ids
    from dspark_trt.train.prompts import HELD_OUT_PROMPTS

    sel = HELD_OUT_PROMPTS
    if n:
        sel = [x for i, x in enumerate(HELD_OUT_PROMPTS) if i % max(1, len(HELD_OUT_PROMPTS) // n) == 0]
    return [(k, chat_prompt_ids(tok, t)) for k, t in sel]


DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "chatgen"  # the committed data set (a source checkout)


def unanswered_prompts(tok, n: int, data_dir: Path = DATA_DIR, seed: int = 0,  # noqa: ANN001
                       total: int = 30000) -> list[tuple[str, list[int]]]:
    """(kind, chat-template ids) of n prompts from the training prompt generators that the data set never answered:
    `chatgen.build_data`'s single-turn list (`scaled_prompts(total, seed, extra=the self-instruct questions)`, rebuilt
    from the data's own self-instruct file) less every prompt key in the data files, every (len // n)-th kept —
    in-distribution prompts no drafter trained on this data has seen (beside the hand-written held-out set, which
    differs in style). kind: code / math / other (`prompt_kind`). A rerun of chatgen that answers them ends this."""
    from dspark_trt.errors import InvalidArgumentError
    from dspark_trt.train import prompt_sources_scale as ps
    from dspark_trt.train.chatgen import _records, chat_prompt_ids

    files = sorted(Path(data_dir).glob("*.jsonl*"))
    if not files:
        raise InvalidArgumentError(f"no data files (*.jsonl, *.jsonl.gz) in {data_dir}. Fix: pass --data-dir of the "
                                   "chatgen data set (data/chatgen in a source checkout).")
    si = [f for f in files if ".self_instruct." in f.name]
    recs = [r for f in files for r in _records(f)]
    done = {r["prompt"] for r in recs}
    questions = ps.questions_from_answers(tok.decode(r["ids"][r["prompt_len"]:], skip_special_tokens=True)
                                          for f in si for r in _records(f)) if si else []
    rest = [p for p in ps.scaled_prompts(total, seed=seed, extra=questions) if ps.prompt_key(p) not in done]
    if len(rest) < n:
        raise InvalidArgumentError(f"only {len(rest)} unanswered prompts are left in the generators' first {total}; "
                                   f"ask for fewer (--n-prompts) or a larger total")
    sel = rest[:: max(1, len(rest) // n)][:n]
    return [(ps.prompt_kind(p), chat_prompt_ids(tok, p)) for p in sel]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--gammas", default="4,6,8")
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--n-prompts", type=int, default=0, help="0 = all held-out prompts (unanswered: 36)")
    p.add_argument("--prompt-source", choices=("held-out", "unanswered"), default="held-out",
                   help="held-out: the 18 hand-written prompts; unanswered: prompts of the training generators the "
                        "data set never answered (in-distribution, never trained on)")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR, help="the chatgen data set (--prompt-source unanswered)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="where target and drafter run (cuda on a GPU host)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--draft-head", choices=("int8", "model"), default="int8",
                   help="the drafter's head on the native CPU path: int8 rows (default) or the model dtype")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(a.threads)
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer

    dt = getattr(torch, a.dtype)
    target = load_hf_checkpoint(a.target, dtype=dt).to(a.device)
    drafter = load_drafter(a.drafter, target, dtype=dt, target_dir=a.target)
    if hasattr(drafter, "model") and hasattr(drafter.model, "int8_head"):
        drafter.model.int8_head = a.draft_head == "int8"
    tok = load_tokenizer(a.target)
    prompts = (held_out_prompts(tok, a.n_prompts) if a.prompt_source == "held-out"
               else unanswered_prompts(tok, a.n_prompts or 36, a.data_dir))
    eos = [int(tok.eos_token_id)]
    res = measure(target, drafter, prompts, [int(g) for g in a.gammas.split(",")], a.max_new, eos)
    res.update({"prompts": len(prompts), "prompt_source": a.prompt_source, "max_new_tokens": a.max_new, "dtype": a.dtype, "threads": a.threads, "device": a.device,
                "draft_head": a.draft_head})
    text = json.dumps(res, indent=2)
    if a.json:
        a.json.write_text(text)
    log.info("%s", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
