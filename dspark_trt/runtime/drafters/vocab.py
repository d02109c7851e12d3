"""Vocabulary identity of drafts and targets, and the check that they match.

Owns: `VocabInfo` (size, special-token ids, id-ordered tokens, digest) read from a HF checkpoint
directory, a model config (`VocabInfo.from_config`: size + eos ids) or a DSpark drafter's recorded
`target_vocab`; `check_same_vocabulary`, the one vocabulary check of the project (the loader, the build's
validate stage and the Python API all call it) with its one message (VOCAB_MSG + what differs + the fix); and
`target_fingerprint` (a hash of target embedding rows, so a drafter notices it is paired with a different
target of the same vocabulary).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from dspark_trt.errors import VocabularyMismatchError

log = logging.getLogger(__name__)

SPECIAL_NAMES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "mask_token_id")
VOCAB_MSG = "The draft model and target model must have the same vocabulary"
VOCAB_FIX = "Fix: use a draft trained with the target's tokenizer (or train one with `dspark-trt train-drafter`)."


@dataclass(frozen=True)
class VocabInfo:
    size: int
    special: dict[str, Any] = field(default_factory=dict)  # name → id (or list of ids) / None
    tokens: tuple[str, ...] | None = None  # id-ordered token strings, when a tokenizer was read
    digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "special": dict(self.special), "digest": self.digest}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VocabInfo":
        return cls(size=int(d.get("size", 0)), special=dict(d.get("special", {})), digest=str(d.get("digest", "")))

    @classmethod
    def from_config(cls, cfg: Any) -> "VocabInfo":
        """Size + eos ids of a model config: a runtime ModelConfig, a HF PretrainedConfig or a config.json dict."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        eos = get("eos_token_ids", None) or get("eos_token_id", None)
        special = {"eos_token_id": eos} if _ids(eos) else {}
        return cls(size=int(get("vocab_size", 0) or 0), special=special)


def _ids(value: Any) -> frozenset[Any]:
    """A special-token entry (None, one id, or a list of ids) as a set."""
    if value is None:
        return frozenset()
    return frozenset(value) if isinstance(value, (list, tuple, set, frozenset)) else frozenset([value])


def _same_special(name: str, a: Any, b: Any) -> bool:
    if name == "eos_token_id":  # a model may list several end ids; sharing one is enough
        return bool(_ids(a) & _ids(b)) or (not _ids(a) and not _ids(b))
    return a == b


def _digest(tokens: tuple[str, ...]) -> str:
    return hashlib.sha256("\x00".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def vocab_info(directory: Path) -> VocabInfo:
    """VocabInfo of a HF checkpoint dir (tokenizer files if present, else config.json only)."""
    directory = Path(directory)
    cfg: dict[str, Any] = {}
    if (directory / "config.json").is_file():
        cfg = json.loads((directory / "config.json").read_text())
    size = int(cfg.get("vocab_size", 0))
    tokens: tuple[str, ...] | None = None
    special: dict[str, Any] = {}
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(directory)
        vocab = tok.get_vocab()
        n = max(vocab.values()) + 1
        arr = [""] * n
        for t, i in vocab.items():
            arr[i] = t
        tokens = tuple(arr)
        special = {name: getattr(tok, name, None) for name in SPECIAL_NAMES}
        size = max(size, n)
    else:
        special = {name: cfg.get(name) for name in SPECIAL_NAMES if name in cfg}
    return VocabInfo(size=size, special=special, tokens=tokens, digest=_digest(tokens) if tokens else "")


def check_same_vocabulary(draft: VocabInfo | Path, target: VocabInfo | Path) -> None:
    """Raise VocabularyMismatchError (message starts with VOCAB_MSG, names what differs and the fix) if they differ:
    sizes, special ids present on both sides (eos: at least one id in common), the first differing token (or the
    token-table digests)."""
    d = draft if isinstance(draft, VocabInfo) else vocab_info(Path(draft))
    t = target if isinstance(target, VocabInfo) else vocab_info(Path(target))
    problems: list[str] = []
    if d.size != t.size:
        problems.append(f"vocabulary sizes differ (draft {d.size}, target {t.size})")
    for name in SPECIAL_NAMES:
        if name in d.special and name in t.special and not _same_special(name, d.special[name], t.special[name]):
            problems.append(f"special token {name} differs (draft {d.special[name]!r}, target {t.special[name]!r})")
    if d.tokens is not None and t.tokens is not None:
        for i, (a, b) in enumerate(zip(d.tokens, t.tokens)):
            if a != b:
                problems.append(f"first differing token is id {i} (draft {a!r}, target {b!r})")
                break
    elif d.digest and t.digest and d.digest != t.digest:
        problems.append(f"token tables differ (digest draft {d.digest}, target {t.digest})")
    if problems:
        raise vocabulary_mismatch(problems)


def vocabulary_mismatch(problems: Iterable[str]) -> VocabularyMismatchError:
    """The one VocabularyMismatchError message: VOCAB_MSG, what differs, the fix."""
    return VocabularyMismatchError(f"{VOCAB_MSG}: " + "; ".join(problems) + f". {VOCAB_FIX}")


def target_fingerprint(embed_weight: torch.Tensor, rows: int = 256) -> str:
    """Short hash of the first `rows` embedding rows rounded to bf16 (dtype-independent across fp32/bf16)."""
    w = embed_weight.detach()[:rows].to(torch.bfloat16).float().cpu().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]
