"""The corpus index: suffix matches in a static corpus of the target's own outputs (a third source of suffix drafts).

Owns (numpy, no torch, no models):
- `CorpusIndex`: a read-only index over a corpus of token sequences (the target's greedy answers to many prompts,
  separated). Every corpus position i that has a token is keyed by the tokens before it, nearest first
  (t[i−1], t[i−2], …, t[i−max_match], stopping at a sequence boundary), packed into uint64 keys (as many tokens
  per key as fit: 4 for a vocabulary under 2^16), and the positions sorted by those keys. The occurrences of a
  context's last n tokens are then one contiguous range, nested in the range of its last n − 1: a lookup narrows
  the range token by token (two binary searches per token on a view, no copy) to the longest match ≤ max_match,
  then votes the continuation over up to `max_votes` of the range's occurrences (evenly spaced): at each depth the
  most frequent next token among the occurrences that agreed so far (ties: the smaller id), its share recorded.
  Memory: N positions (int32) + N × ceil(max_match / tokens per key) keys (uint64) + the tokens (int32) — ~130 MB
  for the 5.35M-token default corpus at max_match 8; built in a few seconds (a lexsort), then kept as .npy files in
  a cache directory and memory-mapped on later loads (`load_corpus(cache=...)`: ~0.1 s, pages shared by processes).
- `CorpusMatch`: a lookup's answer (tokens, match length, occurrences, shares per depth).
- the corpus file format (`save_corpus` / `load_corpus`): an .npz with `tokens` (int32, −1 between sequences) and
  `meta` (JSON: vocab size and digest, the target's fingerprint, where the corpus came from), and
  `corpus_from_records` (chatgen-style JSONL records → the answers' tokens, each with a few prompt tokens before it:
  the chat template's assistant header, so the first answer tokens match too).

Why: SuffixDecoding-style speculation from earlier outputs of the same model. A small model's greedy answers repeat
its phrasing across prompts, so a corpus of its answers to other prompts proposes continuations that the target
accepts about as often as a trained drafter's first tokens, at the cost of a dictionary lookup (docs/drafter.md,
"A corpus of the target's own answers"). The held-out prompts of the benchmarks never enter the shipped corpus.
spec_decode.suffix.SuffixProposer asks it beside the request's own tokens and recent outputs.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dspark_trt.errors import InvalidArgumentError

log = logging.getLogger(__name__)

__all__ = ["CorpusIndex", "CorpusMatch", "save_corpus", "load_corpus", "corpus_meta", "shared_corpus",
           "corpus_from_records"]

SEP = -1  # between sequences in a corpus token array
PROMPT_TAIL = 4  # prompt tokens kept before each answer (the assistant header of a chat template)


@dataclass(frozen=True)
class CorpusMatch:
    """One lookup: the voted continuation of the longest corpus match of a context's last tokens."""

    tokens: tuple[int, ...]  # [m] the continuation, 1 ≤ m ≤ cap
    match_len: int  # tokens of the context matched
    occurrences: int  # corpus positions with that context (before sampling the vote)
    shares: tuple[float, ...]  # [m] share of the voting occurrences (still agreeing) that continue with tokens[j]


class CorpusIndex:
    """A static suffix index over a corpus token array (see the module doc)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, max_match: int = 8, max_votes: int = 256,
                 meta: dict[str, Any] | None = None) -> None:
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [N]
        if not 1 <= max_match <= 32 or max_votes < 1:
            raise InvalidArgumentError(f"corpus index: need 1 ≤ max_match ≤ 32 and max_votes ≥ 1, got {max_match}, "
                                       f"{max_votes}")
        if vocab_size < 1 or (t.size and (int(t.max()) >= vocab_size or int(t.min()) < SEP)):
            raise InvalidArgumentError(f"corpus tokens must be token ids in [0, {vocab_size}) or {SEP} between "
                                       f"sequences; rebuild the corpus for this target's vocabulary")
        self.vocab_size, self.max_match, self.max_votes = int(vocab_size), int(max_match), int(max_votes)
        self.meta = dict(meta or {})
        self.bits = int(vocab_size).bit_length()  # value vocab_size (a boundary) fits too
        self.per_key = max(1, 64 // self.bits)
        n_keys = -(-self.max_match // self.per_key)
        self.tokens = np.concatenate([t, np.full(64, SEP, dtype=np.int64)]).astype(np.int32)  # [N + 64] padded
        pos = np.nonzero(t >= 0)[0]  # [P] positions with a token to propose
        keys: list[np.ndarray] = []  # n_keys × [P]: the context nearest first, per_key tokens a key
        alive = np.ones(pos.size, dtype=bool)  # the context has not hit a sequence boundary yet
        boundary = np.uint64(self.vocab_size)
        for k in range(n_keys):
            key = np.zeros(pos.size, dtype=np.uint64)
            for d in range(k * self.per_key + 1, (k + 1) * self.per_key + 1):
                if d <= self.max_match:
                    prev = np.where(pos - d >= 0, t[np.maximum(pos - d, 0)], SEP)
                    alive &= prev >= 0  # a boundary ends the context
                    col = np.where(alive, prev, self.vocab_size).astype(np.uint64)
                else:
                    col = np.full(pos.size, boundary, dtype=np.uint64)
                key = (key << np.uint64(self.bits)) | col
            keys.append(key)
        order = np.lexsort([pos] + keys[::-1])  # by key 0, then key 1, …, then position (deterministic ties)
        self.positions = pos[order].astype(np.int32)  # [P]
        self.keys = [k[order] for k in keys]  # n_keys × [P] uint64, sorted lexicographically
        log.info("corpus index: %d positions, max_match %d, %d keys of %d tokens", pos.size, max_match, n_keys,
                 self.per_key)

    @classmethod
    def from_parts(cls, tokens: np.ndarray, positions: np.ndarray, keys: list[np.ndarray], vocab_size: int,
                   max_match: int, max_votes: int = 256, meta: dict[str, Any] | None = None) -> "CorpusIndex":
        """An index from the arrays `save_parts` wrote (memory-mapped: processes share the pages), no sorting."""
        self = cls.__new__(cls)
        self.vocab_size, self.max_match, self.max_votes = int(vocab_size), int(max_match), int(max_votes)
        self.meta = dict(meta or {})
        self.bits = int(vocab_size).bit_length()
        self.per_key = max(1, 64 // self.bits)
        if len(keys) != -(-self.max_match // self.per_key) or positions.shape[0] != keys[0].shape[0]:
            raise InvalidArgumentError("corpus index parts do not fit together; delete the index cache directory")
        # plain ndarray views of the (memory-mapped) arrays: the memmap subclass costs ~40 µs a lookup in indexing
        self.tokens, self.positions, self.keys = np.asarray(tokens), np.asarray(positions), [np.asarray(k) for k in keys]
        return self

    def save_parts(self, directory: Path) -> None:
        """Write the index's arrays as .npy files (+ parts.json) into `directory` (created)."""
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "tokens.npy", self.tokens)
        np.save(directory / "positions.npy", self.positions)
        for i, k in enumerate(self.keys):
            np.save(directory / f"keys{i}.npy", k)
        (directory / "parts.json").write_text(json.dumps({"vocab_size": self.vocab_size, "max_match": self.max_match,
                                                          "keys": len(self.keys), "meta": self.meta}))

    def _bounds(self, head: int, m: int) -> tuple[np.uint64, np.uint64]:
        """The lowest and highest key of a level whose first m tokens pack to `head` (the others free)."""
        free = self.bits * (self.per_key - m)
        lo = head << free
        return np.uint64(lo), np.uint64(lo | ((1 << free) - 1))

    @property
    def size(self) -> int:
        """Corpus positions indexed."""
        return int(self.positions.size)

    def match(self, context: Sequence[int], cap: int) -> CorpusMatch | None:
        """The voted continuation (≤ cap tokens) of the longest suffix of `context` found in the corpus, or None.
        Runs after every target pass, so with the corpus' pages cold: two binary searches a key level (the nested
        ranges of its 1..per_key tokens searched at once) and one sort of the voters' continuations."""
        if cap < 1 or not len(context):
            return None
        want = [int(x) for x in reversed(context[-self.max_match:])]  # nearest first
        if any(not 0 <= x < self.vocab_size for x in want):
            want = want[:next(i for i, x in enumerate(want) if not 0 <= x < self.vocab_size)]
        lo, hi, n = 0, self.size, 0
        for level, keys in enumerate(self.keys):
            part = want[level * self.per_key:(level + 1) * self.per_key]
            if not part:
                break
            bounds = [self._bounds(self._head(part[:m]), m) for m in range(1, len(part) + 1)]
            view = keys[lo:hi]
            a = view.searchsorted(np.array([b[0] for b in bounds], dtype=np.uint64), "left")  # [m]
            b = view.searchsorted(np.array([b[1] for b in bounds], dtype=np.uint64), "right")  # [m]
            got = 0  # the ranges are nested: the first empty one ends the match
            while got < len(part) and b[got] > a[got]:
                got += 1
            if got:
                lo, hi = lo + int(a[got - 1]), lo + int(b[got - 1])
            n += got
            if got < self.per_key:
                break
        if n == 0:
            return None
        count = hi - lo
        votes = min(count, self.max_votes)
        sel = lo + (np.arange(votes, dtype=np.int64) * count) // votes
        starts = self.positions[sel].astype(np.int64)  # [S] continuation starts
        cont = self.tokens[starts[:, None] + np.arange(min(cap, 64))]  # [S, cap]
        tokens, shares = _vote(cont)
        return CorpusMatch(tuple(tokens), n, int(count), tuple(shares)) if tokens else None

    def _head(self, tokens: Sequence[int]) -> int:
        """The first len(tokens) tokens of a key level, packed (CorpusIndex keys' layout)."""
        head = 0
        for t in tokens:
            head = (head << self.bits) | t
        return head


def _vote(cont: np.ndarray) -> tuple[list[int], list[float]]:
    """cont [S, c] the voters' continuations (SEP past a sequence's end) → the continuation voted depth by depth:
    at depth j the most frequent token among the voters that agreed on depths < j (SEP does not vote; ties: the
    smaller id) and its share of those voters; stops where every remaining voter has ended, and a single remaining
    voter's continuation is taken whole. With the rows sorted, the voters agreeing on a prefix are one contiguous
    range whose next column is sorted, so each depth is a count of runs (plain Python: S ≤ max_votes small rows,
    where numpy's per-call cost dominated)."""
    rows = sorted(map(tuple, cont.tolist()))  # lexicographic
    r0, r1 = 0, len(rows)
    tokens: list[int] = []
    shares: list[float] = []
    for j in range(cont.shape[1]):
        if r1 - r0 == 1:  # one occurrence left: its continuation up to the sequence's end, share 1
            for x in rows[r0][j:]:
                if x < 0:
                    break
                tokens.append(x)
                shares.append(1.0)
            break
        first, last = rows[r0][j], rows[r1 - 1][j]
        if first == last:  # all agree (or all ended)
            if first < 0:
                break
            tokens.append(first)
            shares.append(1.0)
            continue
        best, best_at, i = 0, r0, r0
        while i < r1:  # runs of equal tokens, ascending: the first longest is the smallest id on ties
            t, k = rows[i][j], i + 1
            while k < r1 and rows[k][j] == t:
                k += 1
            if t >= 0 and k - i > best:  # the ended voters (SEP) do not vote
                best, best_at = k - i, i
            i = k
        tokens.append(rows[best_at][j])
        shares.append(best / (r1 - r0))
        r0, r1 = best_at, best_at + best
    return tokens, shares


def corpus_from_records(paths: Iterable[Path | str], max_tokens: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """chatgen-style JSONL(.gz) records {"ids": prompt + answer, "prompt_len"} → (tokens int32 with SEP between
    answers, each answer preceded by its prompt's last PROMPT_TAIL tokens; stats). max_tokens > 0: stop there."""
    out: list[int] = []
    records = answer = 0
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt") as fh:
            for line in fh:
                d = json.loads(line)
                ids, pl = d["ids"], int(d["prompt_len"])
                if len(ids) <= pl:
                    continue
                out.append(SEP)
                out.extend(int(x) for x in ids[max(0, pl - PROMPT_TAIL):])
                records += 1
                answer += len(ids) - pl
                if max_tokens and answer >= max_tokens:
                    break
        if max_tokens and answer >= max_tokens:
            break
    out.append(SEP)
    return np.asarray(out, dtype=np.int32), {"records": records, "answer_tokens": answer}


def save_corpus(path: Path | str, tokens: np.ndarray, meta: dict[str, Any]) -> None:
    """Write a corpus file (.npz, compressed): tokens int32 [N] (SEP between sequences) and meta as JSON."""
    np.savez_compressed(path, tokens=np.asarray(tokens, dtype=np.int32), meta=np.array(json.dumps(meta, sort_keys=True)))


def corpus_meta(path: Path | str) -> dict[str, Any]:
    """A corpus file's meta (vocab size and digest, target fingerprint, sources) without indexing it."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"corpus file {path} does not exist; pass the .npz written by save_corpus")
    with np.load(path, allow_pickle=False) as z:
        if "meta" not in z:
            raise InvalidArgumentError(f"{path} is not a corpus file (no 'meta' array); write one with save_corpus")
        return json.loads(str(z["meta"]))


@functools.lru_cache(maxsize=4)
def shared_corpus(path: str, mtime_ns: int, vocab_size: int | None = None, cache: str | None = None) -> CorpusIndex:
    """load_corpus, once per file version in a process: an index is read-only, so engines and schedulers share it
    (call as shared_corpus(str(p), p.stat().st_mtime_ns, vocab_size, cache_dir))."""
    return load_corpus(path, vocab_size, cache=None if cache is None else Path(cache))


INDEX_FORMAT = 1  # bump when the index arrays change meaning


def _cached_parts(path: Path, cache: Path, max_match: int) -> Path:
    """The cache directory of this corpus file's index: named by its content's hash, max_match and INDEX_FORMAT."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return cache / "corpus-index" / f"{digest}-m{max_match}-v{INDEX_FORMAT}"


def load_corpus(path: Path | str, vocab_size: int | None = None, vocab_digest: str | None = None,
                max_match: int = 8, cache: Path | None = None) -> CorpusIndex:
    """A corpus file → CorpusIndex. vocab_size / vocab_digest given: InvalidArgumentError unless the corpus was made
    with that vocabulary (a corpus of another tokenizer's ids would propose nonsense). cache: a directory where the
    built index's arrays are kept (memory-mapped on later loads: ~0.1 s instead of ~3 s, pages shared between
    processes); an unwritable cache only costs the rebuild."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"corpus file {path} does not exist; pass the .npz written by save_corpus")
    with np.load(path, allow_pickle=False) as z:
        if "tokens" not in z or "meta" not in z:
            raise InvalidArgumentError(f"{path} is not a corpus file (needs arrays 'tokens' and 'meta'); write one "
                                       f"with dspark_trt.spec_decode.corpus.save_corpus")
        tokens, meta = z["tokens"], json.loads(str(z["meta"]))
    size = int(meta.get("vocab_size", 0))
    if vocab_size is not None and size != vocab_size:
        raise InvalidArgumentError(f"corpus {path} was made for a vocabulary of {size} tokens, the target has "
                                   f"{vocab_size}; build a corpus from this target's own outputs")
    if vocab_digest is not None and meta.get("vocab_digest") not in (None, vocab_digest):
        raise InvalidArgumentError(f"corpus {path} was made with another tokenizer (vocab digest "
                                   f"{meta.get('vocab_digest')}, the target's {vocab_digest}); build a corpus from "
                                   f"this target's own outputs")
    size = size or (vocab_size or int(tokens.max()) + 1)
    parts = _cached_parts(path, cache, max_match) if cache is not None else None
    if parts is not None and (parts / "parts.json").is_file():
        try:
            info = json.loads((parts / "parts.json").read_text())
            load = lambda name: np.load(parts / f"{name}.npy", mmap_mode="r", allow_pickle=False)  # noqa: E731
            return CorpusIndex.from_parts(load("tokens"), load("positions"),
                                          [load(f"keys{i}") for i in range(int(info["keys"]))], size, max_match,
                                          meta=meta)
        except (OSError, ValueError, KeyError, InvalidArgumentError) as exc:
            log.warning("corpus index cache %s unreadable (%s); rebuilding it", parts, exc)
            shutil.rmtree(parts, ignore_errors=True)
    index = CorpusIndex(tokens, size, max_match=max_match, meta=meta)
    if parts is not None:
        tmp = parts.with_name(parts.name + f".tmp{os.getpid()}")
        try:
            index.save_parts(tmp)
            if parts.exists():  # another process kept it first
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.replace(parts)
        except OSError as exc:
            log.warning("cannot keep the corpus index in %s (%s); it is rebuilt on the next load", parts, exc)
            shutil.rmtree(tmp, ignore_errors=True)
    return index
