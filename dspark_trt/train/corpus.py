"""Offline training text: plain/compressed text files and target-generated chat JSONL → token sequences.

Owns: walking corpus paths (files or directories; .gz read transparently; .jsonl = chat records from
train.chatgen with "ids" and "prompt_len", .jsonl.gz as well), skipping binaries, chunking text into windows, and a
deterministic token budget. Returns (sequences, starts): start = first position worth anchoring at.
"""
from __future__ import annotations

import gzip
import json
import logging
import random
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".gz", "", ".html", ".c", ".h", ".sh", ".cfg", ".toml", ".json"}


def _read_text(p: Path) -> str | None:
    try:
        raw = gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()
    except (OSError, EOFError):
        return None
    if b"\x00" in raw[:4096]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _files(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and not f.is_symlink()
                              and "site-packages" not in f.parts and "__pycache__" not in f.parts
                              and f.suffix in TEXT_SUFFIXES and f.stat().st_size > 200))
        elif p.is_file():
            out.append(p)
    return out


def _is_chat(p: Path) -> bool:
    return p.suffix == ".jsonl" or p.name.endswith(".jsonl.gz")


def load_corpus(paths: Sequence[Path], tokenizer, max_tokens: int, window: int = 512,  # noqa: ANN001
                seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Token sequences (each ≤ window) and their anchor starts, at most ~max_tokens in total.
    Chat JSONL records are all kept first; text files fill the remaining budget in a seeded random order."""
    seqs: list[list[int]] = []
    starts: list[int] = []
    files = _files(paths)
    chat = [f for f in files if _is_chat(f)]
    text = [f for f in files if not _is_chat(f)]
    total = 0
    for f in chat:
        for line in (_read_text(f) or "").splitlines():
            rec = json.loads(line)
            ids, pl = rec["ids"][:window], int(rec["prompt_len"])
            if len(ids) - pl >= 4:
                seqs.append(ids)
                starts.append(pl)
                total += len(ids)
    n_chat = total
    random.Random(seed).shuffle(text)
    for f in text:
        if total >= max_tokens:
            break
        s = _read_text(f)
        if not s or len(s) < 200:
            continue
        ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids), window):
            chunk = ids[i:i + window]
            if len(chunk) >= 32:
                seqs.append(chunk)
                starts.append(0)
                total += len(chunk)
            if total >= max_tokens:
                break
    log.info("corpus: %d sequences, %d tokens (%d chat, %d text) from %d files", len(seqs), total, n_chat,
             total - n_chat, len(files))
    return seqs, starts
