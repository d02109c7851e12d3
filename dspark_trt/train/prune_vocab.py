"""Shrink a trained DSpark drafter's draft vocabulary to the tokens the target's answers use most, without training.

Owns: `answer_token_counts` (target-id counts of the answer tokens of a `train.chatgen` data set: what drafts must
predict) and the command that writes the pruned checkpoint (`model_init.prune_draft_vocab` does the pruning):

    python -m dspark_trt.train.prune_vocab --drafter dspark_trt/assets/dspark-smollm2-135m --data-dir data/chatgen \\
        --size 8192 --out /tmp/dspark-8k

The head's and Markov W2's products read Vd rows in every drafter pass; a drafter trained with a generous Vd keeps
its drafts where their tokens stay in the smaller set (docs/drafter.md, "Draft vocabulary").
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import shutil
from pathlib import Path
from typing import Sequence

import torch

from dspark_trt.errors import DrafterError

log = logging.getLogger(__name__)


def answer_token_counts(data_dir: Path, vocab_size: int) -> torch.Tensor:
    """counts [V] (int64) of the answer tokens (ids past prompt_len) of every `*.jsonl.gz` record under data_dir."""
    files = sorted(Path(data_dir).glob("*.jsonl.gz"))
    if not files:
        raise DrafterError(f"No *.jsonl.gz data set under {data_dir}. Fix: point --data-dir at a train.chatgen "
                           "output directory (e.g. data/chatgen).")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                ans = [t for t in rec["ids"][int(rec.get("prompt_len", 0)):] if 0 <= t < vocab_size]
                counts += torch.bincount(torch.tensor(ans, dtype=torch.long), minlength=vocab_size)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_trt.runtime.drafters.loader import load_dspark_model, save_dspark
    from dspark_trt.train.model_init import prune_draft_vocab

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", type=Path, required=True, help="a DSpark drafter checkpoint directory")
    p.add_argument("--data-dir", type=Path, required=True, help="train.chatgen data set (*.jsonl.gz) to count")
    p.add_argument("--size", type=int, required=True, help="draft vocabulary to keep")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load_dspark_model(a.drafter, dtype=torch.bfloat16)
    counts = answer_token_counts(a.data_dir, model.cfg.vocab_size)
    pruned = prune_draft_vocab(model, counts, a.size)  # the target's special tokens always kept
    tot = max(1, int(counts.sum()))
    log.info("answer tokens covered: %.4f (Vd %d) -> %.4f (Vd %d)", int(counts[model.d2t].sum()) / tot,
             model.cfg.head_vocab, int(counts[pruned.d2t].sum()) / tot, a.size)
    save_dspark(pruned, a.out)
    card = a.drafter / "README.md"
    if card.exists() and a.out.resolve() != a.drafter.resolve():
        shutil.copy(card, a.out / "README.md")
    log.info("wrote %s", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
