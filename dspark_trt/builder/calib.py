"""Offline calibration and held-out text (dspark_trt/assets/calib) turned into token batches.

Owns: reading the shipped text files, tokenizing with the target's tokenizer, and cutting fixed-length
sequences. Calibration and held-out text come from disjoint source files (see assets/calib/SOURCES.md).
Must not know about models.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspark_trt.errors import BuildError

CALIB_DIR = Path(__file__).resolve().parents[1] / "assets" / "calib"
DOC_SEP = "<|doc|>"


def read_text(name: str) -> list[str]:
    path = CALIB_DIR / name
    if not path.is_file():
        raise BuildError(f"The shipped calibration text {path} is missing; reinstall dspark_trt (package data "
                         f"dspark_trt/assets/calib/).")
    return [d.strip() for d in path.read_text().split(DOC_SEP) if d.strip()]


def token_batches(tokenizer: object, name: str, n_seq: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len] long: consecutive windows over the documents of `name` (n ≤ n_seq; round-robin over docs)."""
    docs = read_text(name)
    streams = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]  # type: ignore[operator]
    windows: list[list[int]] = []
    per_doc = [[s[i:i + seq_len] for i in range(0, len(s) - seq_len + 1, seq_len)] for s in streams]
    k = 0
    while len(windows) < n_seq and any(k < len(w) for w in per_doc):
        for w in per_doc:
            if k < len(w) and len(windows) < n_seq:
                windows.append(w[k])
        k += 1
    if not windows:
        raise BuildError(f"The calibration text {name} is shorter than one {seq_len}-token window; lower "
                         f"--calib-seq-len.")
    return torch.tensor(windows, dtype=torch.long)


def calibration_batches(tokenizer: object, n_seq: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len] long calibration sequences."""
    return token_batches(tokenizer, "calib.txt", n_seq, seq_len)


def heldout_tokens(tokenizer: object, n_tokens: int, seq_len: int = 128) -> torch.Tensor:
    """[n, seq_len] long held-out sequences covering about n_tokens tokens."""
    return token_batches(tokenizer, "heldout.txt", max(1, n_tokens // seq_len), seq_len)
