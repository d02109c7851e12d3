"""Target-generated chat data: the target's own greedy answers to instruction prompts.

Owns: batched greedy generation with Hugging Face generate (left padding, chat template), written
incrementally to a JSONL file (one record per prompt: prompt text, full token ids, prompt length) so an
interrupted run resumes where it stopped. Knows nothing about drafters.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:  # noqa: ANN001 - HF tokenizer
    """Token ids of a single-turn chat prompt ending with the assistant header."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def generate_answers(target_dir: Path, prompts: Sequence[str], out: Path, batch_size: int = 64,
                     max_new_tokens: int = 192, threads: int = 2) -> int:
    """Greedy answers for prompts not yet in `out`; returns the number of records in `out` afterwards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    done: set[str] = set()
    if out.exists():
        for line in out.read_text().splitlines():
            done.add(json.loads(line)["prompt"])
    todo = [p for p in prompts if p not in done]
    if not todo:
        return len(done)
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    eos = tok.eos_token_id
    encoded = [(p, chat_prompt_ids(tok, p)) for p in todo]
    encoded.sort(key=lambda x: len(x[1]))  # similar lengths per batch → little padding
    out.parent.mkdir(parents=True, exist_ok=True)
    n = len(done)
    bar = tqdm(total=len(encoded), desc="generate", unit="prompt")
    with out.open("a") as f:
        for i in range(0, len(encoded), batch_size):
            chunk = encoded[i:i + batch_size]
            width = max(len(ids) for _, ids in chunk)
            input_ids = torch.full((len(chunk), width), eos, dtype=torch.long)  # [B, T] left-padded
            attn = torch.zeros_like(input_ids)
            for r, (_, ids) in enumerate(chunk):
                input_ids[r, width - len(ids):] = torch.tensor(ids)
                attn[r, width - len(ids):] = 1
            with torch.inference_mode():
                gen = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=eos, eos_token_id=eos)  # [B, T+N]
            for r, (p, ids) in enumerate(chunk):
                ans = gen[r, width:].tolist()
                if eos in ans:
                    ans = ans[:ans.index(eos) + 1]
                f.write(json.dumps({"prompt": p, "ids": ids + ans, "prompt_len": len(ids)}) + "\n")
                n += 1
            f.flush()
            bar.update(len(chunk))
    bar.close()
    return n


def main() -> None:  # python -m dspark_trt.train.chatgen TARGET OUT [N] [BATCH] [THREADS]
    import sys

    from dspark_trt.train.prompts import training_prompts

    logging.basicConfig(level=logging.INFO)
    target, out = Path(sys.argv[1]), Path(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else None
    bs = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    total = generate_answers(target, training_prompts(0, n), out, batch_size=bs, threads=threads)
    log.info("%d records in %s", total, out)


if __name__ == "__main__":
    main()
