"""The suffix proposer: draft tokens copied from the longest earlier match of a request's last tokens.

Owns (pure Python, no torch, no models):
- `SuffixConfig` (frozen): match orders, the cross-request index's bounds, the confidence prior.
- `SequenceIndex`: one request's own n-gram index over its prompt + committed output. For every n-gram of order
  min_match..max_match it counts the tokens that followed it (with the end of each one's latest occurrence), so a
  lookup of the last n tokens is one dict probe per order (longest first) and proposes the most frequent
  continuation. Memory: at most (max_match − min_match + 1) × length entries per request, freed when the request
  ends (`SuffixProposer.release`); measured on a 2,000-token sequence, 1.9 MB and 3–6 µs of indexing a token (the
  latest-occurrence index before the vote: 0.9 MB, 2–4 µs); an n-gram with one continuation keeps a 4-int list.
- `SuffixIndex`: a bounded cross-request index of recent outputs: a ring buffer of `ring_tokens` tokens (finished
  requests' outputs, each preceded by its prompt's last max_match tokens) and an LRU dict (hash of an n-gram →
  ring position after it) of at most `max_entries` entries; the oldest entries are evicted first and entries that
  point at overwritten ring tokens are dropped on lookup. A hit is checked against the ring's own tokens, so a
  hash collision never proposes a wrong match. Bound: ring_tokens + max_entries integers (~7 MB at defaults).
- `SuffixConfidence`: c_j, the probability that proposed token j is accepted given tokens 1..j−1 were, learned
  online from the proposer's own verified rounds per (source own / cross, match length — for an own match also how
  its n-gram's earlier continuations voted, `own_class` — depth j) as a Beta posterior mean with forgetting (counts
  are halved past `horizon` observations), so the survival rule weighs a suffix proposal like the DSpark head's
  calibrated c_k.
- the corpus (spec_decode.corpus.CorpusIndex, optional): a static index of the target's own answers to other
  prompts, asked when the own / cross match is shorter than `corpus_below` (2) tokens; its proposal then wins where
  its expected accepted tokens Σ_j Π c_i beat that match's.
- `SuffixProposer`: the above for the rows of one RoundScheduler (or shared across schedulers, like GateMemory):
  `propose(key, sequence, cap)` → `SuffixProposal | None`, `observe(proposal, k, accepted)` (a verified suffix
  round), `observe_committed(proposal, committed)` (a greedy round that verified another proposer: the committed
  tokens say what this proposal would have kept), `release(key,
  sequence, prompt_len)` (folds the output into the cross-request index). At most `max_requests` own indices.

A proposal is deterministic: for rejection sampling its q is a one-hot at each proposed token (spec_decode.loop
builds it), which keeps the target's distribution exactly. The choice between this proposer, the DSpark block and
nothing is spec_decode.proposers'.
"""
from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Hashable, Sequence

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.corpus import CorpusIndex

log = logging.getLogger(__name__)

__all__ = ["SuffixConfig", "SuffixProposal", "SequenceIndex", "SuffixIndex", "SuffixConfidence", "SuffixProposer",
           "corpus_class", "own_class"]

SOURCES = ("own", "cross", "corpus")


@dataclass(frozen=True)
class SuffixConfig:
    """Bounds and priors of the suffix proposer."""

    min_match: int = 1  # shortest suffix (tokens) that counts as a match (short ones learn their own low c_j)
    max_match: int = 8  # longest suffix looked up; orders min_match..max_match are indexed
    ring_tokens: int = 1 << 16  # cross-request index: tokens of recent outputs kept (ring buffer)
    max_entries: int = 1 << 16  # cross-request index: n-gram entries kept (LRU eviction)
    max_depth: int = 16  # confidence table width (deeper positions share the last column)
    prior_accept: float = 1.0  # Beta prior of every c_j: (accept, reject) pseudo-counts → c = 0.5 before data
    prior_reject: float = 1.0
    horizon: float = 512.0  # a (source, length, depth) cell's counts are halved when they exceed this
    corpus_below: int = 2  # the corpus is asked only when the own / recent match is shorter than this: a request
    # repeating ≥ 2 of its own tokens continues as before more often than the corpus guesses (measured, docs/drafter.md)
    support_classes: bool = True  # an own match's confidence class also says how its n-gram's earlier
    # continuations voted (single / contested / unanimous ×2 / ×≥3): c_1 0.11–0.88 at one length (ARCHITECTURE.md)
    max_requests: int = 4096  # own indices kept at once (the oldest goes first: only a scheduler abandoned
    # mid-request leaves one behind, every finished or cancelled request releases its own)

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match <= 64:
            raise InvalidArgumentError(f"suffix match orders need 1 ≤ min_match ≤ max_match ≤ 64, got "
                                       f"{self.min_match}..{self.max_match}")
        if (self.ring_tokens < 0 or self.max_entries < 0 or self.max_depth < 1 or self.max_requests < 1
                or self.corpus_below < 0):
            raise InvalidArgumentError(f"suffix index bounds must be ≥ 0 (ring_tokens, max_entries, corpus_below), "
                                       f"max_depth and max_requests ≥ 1, got {self.ring_tokens}, {self.max_entries}, "
                                       f"{self.corpus_below}, {self.max_depth}, {self.max_requests}")
        if self.prior_accept <= 0 or self.prior_reject <= 0 or self.horizon < 1:
            raise InvalidArgumentError("suffix confidence priors must be > 0 and horizon ≥ 1")

    def with_recent_tokens(self, n: int) -> "SuffixConfig":
        """This config with a cross-request index of n recent output tokens (0: none, proposals from the request's
        own tokens only); its n-gram entries bounded by n too."""
        return replace(self, ring_tokens=n, max_entries=min(self.max_entries, n))

    @property
    def orders(self) -> range:
        return range(self.max_match, self.min_match - 1, -1)  # longest first


@dataclass(frozen=True)
class SuffixProposal:
    """One row's suffix proposal for one round."""

    tokens: tuple[int, ...]  # [m] proposed d_1..d_m (1 ≤ m ≤ cap)
    conf: tuple[float, ...]  # [m] c_j per proposed position (SuffixConfidence)
    match_len: int  # length of the matched suffix
    source: str  # "own" (the request's prompt + output) | "cross" (recent outputs of other requests) | "corpus"
    classes: tuple[int, ...] = ()  # [m] the confidence class of each position (SuffixConfidence); () = match_len


def _continue(seq: Sequence[int], end: int, cap: int) -> list[int]:
    """The cap tokens after seq[:end]; past the end of seq the proposal continues itself (a repeat with period
    len(seq) − end), so a loop of period p is proposed in full."""
    n = len(seq)
    out: list[int] = []
    for t in range(cap):
        i = end + t
        out.append(int(seq[i]) if i < n else out[i - n])
    return out


class SequenceIndex:
    """One request's own n-gram index (prompt + committed output): n-gram → for each token that followed it, how
    often, where first and where last. A match continues with the n-gram's most frequent next token (the first seen
    on ties: in an edit, the prompt's), from that token's latest occurrence: in a rewrite of its prompt a request's
    short matches recur with several continuations, and the usual one is the one to copy (code edits: τ 1.89 → 2.00
    at K = 7, scripts/suffix_headroom.py, docs/ARCHITECTURE.md)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.tokens: list[int] = []
        # n-gram → [next, count, −first, latest end] while one token has followed it (most n-grams), else
        # {next: [count, −first, latest end]}
        self._next: dict[tuple[int, ...], list[int] | dict[int, list[int]]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def entries(self) -> int:
        return len(self._next)

    def extend(self, new: Sequence[int]) -> None:
        """Append committed tokens; the n-grams ending just before each new token become lookup-able."""
        lo, hi = self.config.min_match, self.config.max_match
        seq, table = self.tokens, self._next
        for tok in new:
            i, nxt = len(seq), int(tok)  # the new token's index: n-grams ending at i − 1 now continue with it
            for n in range(lo, min(hi, i) + 1):
                key = tuple(seq[i - n:i])
                v = table.get(key)
                if v is None:
                    table[key] = [nxt, 1, -i, i]
                elif isinstance(v, list):
                    if v[0] == nxt:
                        v[1] += 1
                        v[3] = i
                    else:  # a second continuation: one entry per token from now on
                        table[key] = {v[0]: v[1:], nxt: [1, -i, i]}
                else:
                    seen = v.get(nxt)
                    if seen is None:
                        v[nxt] = [1, -i, i]
                    else:
                        seen[0] += 1
                        seen[2] = i
            seq.append(nxt)

    def support(self, n: int) -> int:
        """How the continuations of the last n tokens voted: 0 one earlier occurrence, 1 contested (the winner short
        of all), 2 unanimous over two, 3 unanimous over three or more (the class `own_class` folds in)."""
        follow = self._next.get(tuple(self.tokens[-n:])) if 0 < n < len(self.tokens) else None
        if not follow:
            return 0
        if isinstance(follow, list):
            count = total = follow[1]
        else:
            count, total = max(follow.values())[0], sum(v[0] for v in follow.values())
        return 0 if total == 1 else 1 if count < total else 2 if total == 2 else 3

    def match(self, cap: int) -> tuple[list[int], int] | None:
        """(up to cap continuation tokens, match length) of the longest indexed suffix, or None."""
        seq = self.tokens
        for n in self.config.orders:
            if n > len(seq) - 1:
                continue
            follow = self._next.get(tuple(seq[-n:]))
            if follow:
                end = follow[3] if isinstance(follow, list) else max(follow.values())[2]  # most frequent, first seen
                return _continue(seq, end, cap), n  # on ties; from its latest occurrence
        return None


class SuffixIndex:
    """The bounded cross-request index of recent outputs (ring buffer + LRU n-gram table, see the module doc)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self._ring = array("q", [0] * config.ring_tokens)
        self._total = 0  # tokens ever written; ring position of absolute index a is a % ring_tokens
        self._table: OrderedDict[int, int] = OrderedDict()  # hash(n-gram) → absolute index after it

    @property
    def entries(self) -> int:
        return len(self._table)

    def _tok(self, a: int) -> int:
        return self._ring[a % self.config.ring_tokens]

    def _live(self, a: int) -> bool:
        return self._total - self.config.ring_tokens <= a < self._total

    def add(self, tokens: Sequence[int]) -> None:
        """Append a finished request's tokens (its prompt tail + output) and index their n-grams."""
        cfg = self.config
        if cfg.ring_tokens == 0 or cfg.max_entries == 0 or not tokens:
            return
        start = self._total
        for tok in tokens:
            self._ring[self._total % cfg.ring_tokens] = int(tok)
            self._total += 1
        tail = list(tokens)
        for i in range(1, len(tail)):  # n-grams ending at i − 1 (continuation at i)
            for n in range(cfg.min_match, min(cfg.max_match, i) + 1):
                key = hash(tuple(tail[i - n:i]))
                self._table.pop(key, None)
                self._table[key] = start + i
        while len(self._table) > cfg.max_entries:
            self._table.popitem(last=False)  # the oldest entry goes first

    def match(self, suffix: Sequence[int], cap: int) -> tuple[list[int], int] | None:
        """(up to cap continuation tokens, match length) of the longest suffix of `suffix` seen in recent outputs."""
        cfg = self.config
        for n in cfg.orders:
            if n > len(suffix):
                continue
            key = tuple(int(t) for t in suffix[-n:])
            a = self._table.get(hash(key))
            if a is None:
                continue
            if not (self._live(a - n) and self._live(a) and all(self._tok(a - n + t) == key[t] for t in range(n))):
                self._table.pop(hash(key), None)  # overwritten or a hash collision: not a match
                continue
            out: list[int] = []
            while len(out) < cap and self._live(a + len(out)):
                out.append(self._tok(a + len(out)))
            if out:
                return out, n
        return None


def own_class(match_len: int, support: int, max_match: int) -> int:
    """The confidence class of an own match: its length, plus max_match × its vote (SequenceIndex.support) — a
    single earlier occurrence keeps the length-only class."""
    return match_len + max_match * support


CORPUS_CLASSES = 15  # corpus_class values: 3 match-length classes × 5 share classes


def corpus_class(match_len: int, share: float) -> int:
    """The confidence class of a corpus-proposed position: match length (1–2, 3–5, ≥ 6 tokens) × the share of the
    voting occurrences that continue with it (fifths) — both predict acceptance (docs/drafter.md)."""
    return (0 if match_len <= 2 else 1 if match_len <= 5 else 2) * 5 + min(int(share * 5), 4)


@dataclass
class SuffixConfidence:
    """c_j by (source, class, depth j), learned online: (accepted + α) / (reached + α + β). The class of a
    cross-request match is its length; of an own match `own_class` (its length where config.support_classes is
    off); of a corpus match, `corpus_class`."""

    config: SuffixConfig
    hits: dict[tuple[str, int, int], float] = field(default_factory=dict)
    reached: dict[tuple[str, int, int], float] = field(default_factory=dict)
    _first_seen: set[int] = field(default_factory=set)  # corpus classes observed at depth 1

    def _key(self, source: str, match_len: int, depth: int) -> tuple[str, int, int]:
        cfg = self.config
        return source, match_len if source != "cross" else min(match_len, cfg.max_match), min(depth, cfg.max_depth)

    def conf(self, source: str, match_len: int, depth: int) -> float:
        """c_depth (depth 1 = the first proposed token)."""
        key = self._key(source, match_len, depth)
        a, b = self.config.prior_accept, self.config.prior_reject
        return (self.hits.get(key, 0.0) + a) / (self.reached.get(key, 0.0) + a + b)

    def best_first(self, source: str = "corpus", min_rounds: float = 8.0) -> float:
        """The highest c_1 of any corpus class reached in ≥ min_rounds rounds (a class seen fewer times, or not yet,
        counts at the prior: a lucky streak of three must not unlock lookups in every large batch)."""
        a, b = self.config.prior_accept, self.config.prior_reject
        seen = [self.conf(source, cls, 1) for cls in self._first_seen
                if self.reached.get(self._key(source, cls, 1), 0.0) >= min_rounds]
        return max(seen + ([a / (a + b)] if len(seen) < CORPUS_CLASSES else []))

    def observe(self, source: str, match_len: int | Sequence[int], k: int, accepted: int) -> None:
        """One verified round of k proposed tokens, `accepted` of them kept: positions 1..min(k, accepted + 1) were
        reached; of those 1..accepted were accepted. match_len: the class of every position, or one per position."""
        for j in range(1, min(k, accepted + 1) + 1):
            key = self._key(source, match_len if isinstance(match_len, int) else match_len[j - 1], j)
            if j == 1 and source == "corpus":
                self._first_seen.add(key[1])
            r = self.reached.get(key, 0.0) + 1.0
            h = self.hits.get(key, 0.0) + (1.0 if j <= accepted else 0.0)
            if r > self.config.horizon:  # forgetting: the stream's recent rounds dominate
                r, h = r / 2.0, h / 2.0
            self.reached[key], self.hits[key] = r, h


def _expected(conf: Sequence[float]) -> float:
    """Expected accepted tokens of a proposal verified whole: Σ_j Π_{i≤j} c_i."""
    total, run = 0.0, 1.0
    for c in conf:
        run *= c
        total += run
    return total


def _classes(p: SuffixProposal) -> int | tuple[int, ...]:
    return p.classes or p.match_len


class SuffixProposer:
    """Suffix proposals for the requests of one RoundScheduler (or several: pass one to each, like GateMemory).

    Per request (by a caller's key: spec_decode.loop uses (its own token, request id)) a SequenceIndex of its
    prompt + committed output, kept in step with `propose`'s `sequence` argument; across requests one SuffixIndex
    and one SuffixConfidence. Not thread-safe: one round loop drives it (as it drives the scheduler)."""

    def __init__(self, config: SuffixConfig = SuffixConfig(), corpus: CorpusIndex | None = None) -> None:
        self.config = config
        self.corpus = corpus  # static: a corpus of the target's own outputs (spec_decode.corpus), None: none
        self.cross = SuffixIndex(config)
        self.confidence = SuffixConfidence(config)
        self._own: dict[Hashable, SequenceIndex] = {}

    @property
    def requests(self) -> int:
        return len(self._own)

    def _index(self, key: Hashable, sequence: Sequence[int]) -> SequenceIndex:
        idx = self._own.get(key)
        if idx is None or len(idx) > len(sequence) or (len(idx) and idx.tokens[-1] != sequence[len(idx) - 1]):
            idx = self._own[key] = SequenceIndex(self.config)
            while len(self._own) > self.config.max_requests:
                self._own.pop(next(iter(self._own)))
        if len(idx) < len(sequence):
            idx.extend(sequence[len(idx):])
        return idx

    def propose(self, key: Hashable, sequence: Sequence[int], cap: int,
                min_first: float = 0.0) -> SuffixProposal | None:
        """Up to cap tokens continuing `sequence` (the request's committed tokens, prompt included) from the
        longest match (own sequence first on equal lengths, then recent outputs) — or, where that match is shorter
        than config.corpus_below, from the corpus if its expected accepted tokens under the learned c_j are higher —
        or None (no match, cap 0). min_first: skip the corpus lookup unless some corpus class's learned c_1 exceeds it
        (spec_decode.proposers.first_token_floor: in a large batch no corpus token would be verified)."""
        if cap < 1:
            return None
        idx = self._index(key, sequence)
        best = idx.match(cap)
        source = "own"
        cross = self.cross.match(idx.tokens[-self.config.max_match:], cap)
        if cross is not None and (best is None or cross[1] > best[1]):
            best, source = cross, "cross"
        found = None
        if best is not None:
            tokens, n = best
            cls = (own_class(n, idx.support(n), self.config.max_match)
                   if source == "own" and self.config.support_classes else n)
            found = SuffixProposal(tuple(tokens), tuple(self.confidence.conf(source, cls, j)
                                                        for j in range(1, len(tokens) + 1)), n, source,
                                   (cls,) * len(tokens) if cls != n else ())
        if (self.corpus is not None and (found is None or found.match_len < self.config.corpus_below)
                and self.confidence.best_first("corpus") > min_first):
            cm = self.corpus.match(idx.tokens, cap)
            if cm is not None:
                classes = tuple(corpus_class(cm.match_len, sh) for sh in cm.shares)
                conf = tuple(self.confidence.conf("corpus", c, j) for j, c in enumerate(classes, start=1))
                corpus = SuffixProposal(cm.tokens, conf, cm.match_len, "corpus", classes)
                if found is None or _expected(corpus.conf) > _expected(found.conf):
                    found = corpus
        return found

    def observe_committed(self, proposal: SuffixProposal, committed: Sequence[int]) -> None:
        """Learn from a greedy round whose drafts came from elsewhere (DSpark, or none): the target's committed
        tokens are exactly what verifying this proposal would have accepted, as far as they reach (a mismatch at
        j: positions 1..j reached, 1..j−1 accepted). Free data, so c_j keeps learning where DSpark wins."""
        m, n = 0, min(len(proposal.tokens), len(committed))
        while m < n and proposal.tokens[m] == committed[m]:
            m += 1
        k = m + 1 if m < n else m
        if k >= 1:
            self.confidence.observe(proposal.source, _classes(proposal), k, m)

    def forget_outputs(self) -> None:
        """Empty the cross-request index (benchmarks: a repeated prompt must not copy its own earlier output); the
        learned confidences stay."""
        self.cross = SuffixIndex(self.config)

    def observe(self, proposal: SuffixProposal, k: int, accepted: int) -> None:
        """Fold one verified round (k ≥ 1 of the proposal's tokens verified, `accepted` kept) into c_j."""
        if k >= 1:
            self.confidence.observe(proposal.source, _classes(proposal), k, accepted)

    def release(self, key: Hashable, sequence: Sequence[int] | None = None, prompt_len: int = 0) -> None:
        """Forget a request's own index; with its final `sequence`, add its output (preceded by max_match prompt
        tokens) to the cross-request index."""
        self._own.pop(key, None)
        if sequence is not None and len(sequence) > prompt_len:
            self.cross.add(list(sequence[max(0, prompt_len - self.config.max_match):]))
