"""Target-generated chat data: the target's own greedy answers to instruction prompts.

Owns: batched greedy generation on the reference runtime (continuous batching over a slot KV cache:
each prompt is prefilled alone, then every active request decodes one token per step in one batched
forward, and a finished slot is refilled at once), written incrementally to a JSONL file (one record
per prompt: prompt text, full token ids, prompt length) so an interrupted run resumes where it stopped.
Knows nothing about drafters.

Rerun: `python -m dspark_trt.train.chatgen --out runs/data/chat.jsonl --prompts 6000 --batch 48`
(the default target when --target is omitted); then the teacher pass is
`dspark-trt train-drafter --corpus runs/data/chat.jsonl --out runs/drafter --features-only`.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatGenConfig:
    prompts: int = 6000
    batch: int = 64
    max_new_tokens: int = 320
    threads: int = 2
    seed: int = 0


D = ChatGenConfig()


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:  # noqa: ANN001 - HF tokenizer
    """Token ids of a single-turn chat prompt ending with the assistant header."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _done_prompts(out: Path) -> set[str]:
    done: set[str] = set()
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                done.add(json.loads(line)["prompt"])
    return done


def generate_answers(target_dir: Path, prompts: Sequence[str], out: Path, batch_size: int = D.batch,
                     max_new_tokens: int = D.max_new_tokens, threads: int = D.threads) -> int:
    """Greedy answers for prompts not yet in `out`; returns the number of records in `out` afterwards."""
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer

    torch.set_num_threads(threads)
    done = _done_prompts(out)
    todo = [p for p in prompts if p not in done]
    if not todo:
        return len(done)
    tok = load_tokenizer(target_dir)
    model = load_hf_checkpoint(target_dir, dtype=torch.bfloat16)
    eos = set(model.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    queue = [(p, chat_prompt_ids(tok, p)) for p in todo]
    max_prompt = max(len(ids) for _, ids in queue)
    B = min(batch_size, len(queue))
    cache = model.new_cache(B, max_prompt + max_new_tokens + 1)
    active: dict[int, tuple[str, list[int], list[int]]] = {}  # slot -> (prompt, prompt ids, answer ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    n, new_tokens, t0 = len(done), 0, time.time()
    bar = tqdm(total=len(queue), desc="generate", unit="prompt", mininterval=30)
    nxt = 0
    with out.open("a") as f, torch.inference_mode():
        while active or nxt < len(queue):
            for slot in range(B):  # refill free slots: prefill each prompt alone
                if slot in active or nxt >= len(queue):
                    continue
                p, ids = queue[nxt]
                nxt += 1
                cache.reset(slot)
                logits = model(torch.tensor([ids]), cache, torch.tensor([slot]), logits="last").logits  # [1, 1, V]
                active[slot] = (p, ids, [int(logits[0, -1].argmax())])
            slots = sorted(active)
            last = torch.tensor([[active[s][2][-1]] for s in slots])  # [B', 1]
            logits = model(last, cache, torch.tensor(slots), logits="last").logits  # [B', 1, V]
            picks = logits[:, -1].argmax(-1).tolist()
            for s, t in zip(slots, picks):
                ans = active[s][2]
                if ans[-1] in eos or len(ans) >= max_new_tokens:
                    continue  # finished last step; written below
                ans.append(int(t))
            for s in slots:
                p, ids, ans = active[s]
                if ans[-1] in eos or len(ans) >= max_new_tokens:
                    f.write(json.dumps({"prompt": p, "ids": ids + ans, "prompt_len": len(ids)}) + "\n")
                    new_tokens += len(ans)
                    n += 1
                    del active[s]
                    bar.update(1)
            f.flush()
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    bar.close()
    dt = time.time() - t0
    log.info("generated %d answer tokens in %.0f s = %.0f tok/s (batch %d)", new_tokens, dt, new_tokens / dt, B)
    return n


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_trt.train.prompt_sources import varied_prompts

    p = argparse.ArgumentParser(prog="python -m dspark_trt.train.chatgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=None, help="target HF dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", type=Path, required=True, help="JSONL output (appended; a rerun resumes)")
    p.add_argument("--prompts", type=int, default=D.prompts, help=f"number of varied prompts (default {D.prompts})")
    p.add_argument("--batch", type=int, default=D.batch, help=f"decode batch (default {D.batch})")
    p.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens)
    p.add_argument("--threads", type=int, default=D.threads)
    p.add_argument("--seed", type=int, default=D.seed)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.target is None:
        from dspark_trt.runtime.default_model import default_target_dir
        args.target = default_target_dir()
    prompts = varied_prompts(args.prompts, seed=args.seed)
    total = generate_answers(args.target, prompts, args.out, batch_size=args.batch,
                             max_new_tokens=args.max_new_tokens, threads=args.threads)
    log.info("%d records in %s", total, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
