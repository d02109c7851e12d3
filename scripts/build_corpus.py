#!/usr/bin/env python
"""Write a suffix corpus file (spec_decode.corpus) from the target's own answers: chatgen-style JSONL(.gz) records
{"ids": prompt + answer, "prompt_len"} (`python -m dspark_trt.train.chatgen` writes them) → an .npz that
`dspark-trt build --corpus FILE` puts in a build and `SpeculativeDecodingEngine(corpus=FILE)` loads.

    .venv/bin/python scripts/build_corpus.py --records data/chatgen/*.jsonl.gz --out corpus.npz [--target DIR]

The default pair's corpus (dspark_trt/assets/corpus-smollm2-135m/corpus.npz) is this over data/chatgen/ with the
embedded default target (~10 s). Records must never include the prompts a benchmark holds out.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", nargs="+", required=True, help="JSONL(.gz) files of the target's answers")
    ap.add_argument("--out", required=True, help="the .npz to write")
    ap.add_argument("--target", default=None, help="target HF directory (default: the embedded default target)")
    ap.add_argument("--max-tokens", type=int, default=0, help="stop after this many answer tokens (0: all)")
    args = ap.parse_args()

    import torch

    from dspark_trt.runtime.drafters.vocab import target_fingerprint, vocab_info
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint
    from dspark_trt.spec_decode.corpus import CorpusIndex, corpus_from_records, save_corpus

    if args.target is None:
        from dspark_trt.runtime.default_model import default_target_dir

        target = default_target_dir()
    else:
        target = Path(args.target)
    vocab = vocab_info(target)
    model = load_hf_checkpoint(target, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    tokens, stats = corpus_from_records(args.records, args.max_tokens)
    meta = {"vocab_size": int(model.config.vocab_size), "vocab_digest": vocab.digest,
            "target_fingerprint": target_fingerprint(model.embed_tokens.weight),
            "sources": [Path(r).name for r in args.records], **stats}
    CorpusIndex(tokens, meta["vocab_size"])  # the ids fit the vocabulary (raises otherwise)
    save_corpus(args.out, tokens, meta)
    print(f"{args.out}: {stats['records']} answers, {stats['answer_tokens']} answer tokens, "
          f"{Path(args.out).stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s; meta {meta}")


if __name__ == "__main__":
    main()
