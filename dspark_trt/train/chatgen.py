"""Target-generated chat data: the target's own greedy answers to instruction prompts.

Owns: batched greedy generation on the reference runtime (continuous batching over a slot KV cache: the
prompts of freed slots are prefilled together in one right-padded pass, then every active request decodes one
token per step in one batched forward), written incrementally to a JSONL file (one record per prompt or
conversation: its key, full token ids, prompt length) so an interrupted run resumes where it stopped; and the
data set's phases (self-instruct questions → single-turn answers → multi-turn follow-ups, `build_data`).
Knows nothing about drafters.

Rerun: `python -m dspark_trt.train.chatgen --out runs/data/chat.jsonl --prompts 30000 --self-instruct 6000
--follow-ups 4000` (the default target when --target is omitted); then the teacher pass is
`dspark-trt train-drafter --corpus runs/data/chat.jsonl --out runs/drafter --features-only`.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence, Tuple, Union

import torch
from tqdm import tqdm

from dspark_trt.train.prompt_sources_scale import prompt_key as item_key  # a record's "prompt"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatGenConfig:
    prompts: int = 6000
    batch: int = 64
    max_new_tokens: int = 320
    threads: int = 2
    seed: int = 0


D = ChatGenConfig()


Item = Union[str, Tuple[Dict[str, str], ...]]  # a single-turn prompt, or a conversation ending in a user turn


def chat_prompt_ids(tokenizer, prompt: Item) -> list[int]:  # noqa: ANN001 - HF tokenizer
    """Token ids of a chat prompt (one user turn, or a conversation) ending with the assistant header."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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


def _prefill(model, cache, slots: list[int], prompts: list[list[int]]) -> list[int]:  # noqa: ANN001
    """Prefill several prompts in one right-padded forward; returns each one's greedy first token.
    Rows are batch-invariant in the runtime, so this equals prefilling each prompt alone."""
    T = max(len(ids) for ids in prompts)
    x = torch.zeros(len(prompts), T, dtype=torch.long)  # [B', T] right-padded
    for r, ids in enumerate(prompts):
        x[r, :len(ids)] = torch.tensor(ids)
    lens = torch.tensor([len(ids) for ids in prompts])  # [B']
    s = torch.tensor(slots)
    cache.reset(s)
    logits = model(x, cache, s, logits="last", last_index=lens - 1).logits  # [B', 1, V]
    cache.truncate(s, lens)  # roll the padding back
    return greedy_ids(logits[:, -1])


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """argmax per row of [B, V] (the first maximum, as torch.argmax; `max(-1)` is several times faster on CPU)."""
    return logits.max(-1).indices.tolist()


def generate_answers(target_dir: Path, prompts: Sequence[Item], out: Path, batch_size: int = D.batch,
                     max_new_tokens: int = D.max_new_tokens, threads: int = D.threads,
                     max_prompt_tokens: int = 1536) -> int:
    """Greedy answers for prompts not yet in `out`; returns the number of records in `out` afterwards.
    Records: {"prompt": item_key(item), "ids": prompt + answer ids, "prompt_len"}; prompts longer than
    max_prompt_tokens are skipped."""
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer

    torch.set_num_threads(threads)
    done = _done_prompts(out)
    todo = [p for p in prompts if item_key(p) not in done]
    if not todo:
        return len(done)
    tok = load_tokenizer(target_dir)
    model = load_hf_checkpoint(target_dir, dtype=torch.bfloat16)
    eos = set(model.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    queue = [(item_key(p), ids) for p in todo if len(ids := chat_prompt_ids(tok, p)) <= max_prompt_tokens]
    if len(queue) < len(todo):
        log.info("skipped %d prompts longer than %d tokens", len(todo) - len(queue), max_prompt_tokens)
    if not queue:
        return len(done)
    max_prompt = max(len(ids) for _, ids in queue)
    B = min(batch_size, len(queue))
    cache = model.new_cache(B, max_prompt + max_new_tokens + 1)
    active: dict[int, tuple[str, list[int], list[int]]] = {}  # slot -> (prompt key, prompt ids, answer ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    n, new_tokens, t0 = len(done), 0, time.time()
    bar = tqdm(total=len(queue), desc="generate", unit="prompt", mininterval=30)
    nxt = 0
    with out.open("a") as f, torch.inference_mode():
        while active or nxt < len(queue):
            free = [s for s in range(B) if s not in active][:max(0, len(queue) - nxt)]
            if free:  # refill free slots: one batched prefill
                batch = queue[nxt:nxt + len(free)]
                nxt += len(batch)
                for s, (key, ids), t in zip(free, batch, _prefill(model, cache, free, [ids for _, ids in batch])):
                    active[s] = (key, ids, [t])
            slots = sorted(active)
            last = torch.tensor([[active[s][2][-1]] for s in slots])  # [B', 1]
            picks = greedy_ids(model(last, cache, torch.tensor(slots), logits="last").logits[:, -1])  # [B', V]
            for s, t in zip(slots, picks):
                ans = active[s][2]
                if ans[-1] in eos or len(ans) >= max_new_tokens:
                    continue  # finished last step; written below
                ans.append(int(t))
            for s in slots:
                key, ids, ans = active[s]
                if ans[-1] in eos or len(ans) >= max_new_tokens:
                    f.write(json.dumps({"prompt": key, "ids": ids + ans, "prompt_len": len(ids)}) + "\n")
                    new_tokens += len(ans)
                    n += 1
                    del active[s]
                    bar.update(1)
            f.flush()
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}", refresh=False)
    bar.close()
    dt = time.time() - t0
    log.info("generated %d answer tokens in %.0f s = %.0f tok/s (batch %d)", new_tokens, dt, new_tokens / dt, B)
    return n


def _records(path: Path) -> list[dict]:
    """The JSON records of a .jsonl or .jsonl.gz file ([] when it does not exist)."""
    if not path.exists():
        return []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def build_data(target_dir: Path, out: Path, prompts: int, self_instruct: int, follow_ups: int, seed: int = D.seed,
               batch_size: int = D.batch, max_new_tokens: int = D.max_new_tokens, threads: int = D.threads) -> int:
    """The whole data set, in three resumable phases (each skips what its file already holds):
    1. self-instruct: the target writes one question per seeded (topic, persona, kind) prompt (short answers,
       `OUT.self_instruct.jsonl`); the cleaned questions become prompts;
    2. single-turn answers to `scaled_prompts(prompts)` (the earlier data set's prompts first) → OUT;
    3. multi-turn: a follow-up user turn on `follow_ups` of the target's own answers in OUT → OUT.
    Returns the number of records in OUT."""
    import random

    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.train import prompt_sources_scale as ps

    tok = load_tokenizer(target_dir)
    rng = random.Random(seed)
    questions: list[str] = []
    if self_instruct > 0:
        si = out.with_suffix(".self_instruct.jsonl")
        generate_answers(target_dir, ps.self_instruct_seed_prompts(rng, self_instruct), si, batch_size=batch_size,
                         max_new_tokens=64, threads=threads)
        questions = ps.questions_from_answers(tok.decode(r["ids"][r["prompt_len"]:], skip_special_tokens=True)
                                              for r in _records(si))
        log.info("self-instruct: %d questions", len(questions))
    items: list[Item] = list(ps.scaled_prompts(prompts, seed=seed, extra=questions))
    generate_answers(target_dir, items, out, batch_size=batch_size, max_new_tokens=max_new_tokens, threads=threads)
    if follow_ups > 0:
        firsts = [r for r in _records(out) if not r["prompt"].startswith("[")]
        convo = ps.follow_up_items(firsts, random.Random(seed + 1), follow_ups,
                                   lambda ids: tok.decode(ids, skip_special_tokens=True))
        generate_answers(target_dir, convo, out, batch_size=batch_size, max_new_tokens=max_new_tokens,
                         threads=threads)
    return len(_records(out))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_trt.train.chatgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=None, help="target HF dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", type=Path, required=True, help="JSONL output (appended; a rerun resumes)")
    p.add_argument("--prompts", type=int, default=D.prompts, help=f"single-turn prompts (default {D.prompts})")
    p.add_argument("--self-instruct", type=int, default=0, help="self-instruct seed prompts (default 0: none)")
    p.add_argument("--follow-ups", type=int, default=0, help="multi-turn follow-ups on own answers (default 0)")
    p.add_argument("--batch", type=int, default=D.batch, help=f"decode batch (default {D.batch})")
    p.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens)
    p.add_argument("--threads", type=int, default=D.threads)
    p.add_argument("--seed", type=int, default=D.seed)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.target is None:
        from dspark_trt.runtime.default_model import default_target_dir
        args.target = default_target_dir()
    total = build_data(args.target, args.out, args.prompts, args.self_instruct, args.follow_ups, seed=args.seed,
                       batch_size=args.batch, max_new_tokens=args.max_new_tokens, threads=args.threads)
    log.info("%d records in %s", total, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
