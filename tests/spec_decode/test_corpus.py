"""The corpus index (spec_decode.corpus) and its place in the suffix proposer: lookups equal a brute-force search,
the vote is deterministic, files round-trip and refuse another vocabulary, a corpus proposal is chosen where the
request's own tokens have none, and greedy output with a corpus equals plain decoding token for token."""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.corpus import (SEP, CorpusIndex, corpus_from_records, corpus_meta, load_corpus,
                                           save_corpus)
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler, generate
from dspark_trt.spec_decode.scheduler import CostTable, PolicyConfig
from dspark_trt.spec_decode.suffix import SuffixProposer, corpus_class

TABLE = CostTable(tuple(range(1, 10)), tuple(1.0 + 0.05 * i for i in range(9)), draft_t0=0.2, draft_t1=0.0)


def _flat(seqs: list[list[int]]) -> list[int]:
    out = [SEP]
    for s in seqs:
        out += s + [SEP]
    return out


def _brute(toks: list[int], ctx: list[int], cap: int, max_match: int) -> tuple | None:
    """The longest suffix of ctx (≤ max_match) followed by a token in toks, and the majority continuation."""
    for n in range(min(max_match, len(ctx)), 0, -1):
        occ = [i for i in range(n, len(toks)) if toks[i] >= 0 and toks[i - n:i] == ctx[-n:]]
        if not occ:
            continue
        rows, out, shares = occ, [], []
        for j in range(cap):
            col = [toks[i + j] if i + j < len(toks) else SEP for i in rows]
            c = Counter(x for x in col if x >= 0)
            if not c:
                break
            top = max(c.values())
            tok = min(x for x, v in c.items() if v == top)
            out.append(tok)
            shares.append(top / len(rows))
            rows = [i for i, x in zip(rows, col) if x == tok]
        return tuple(out), n, len(occ), tuple(round(s, 9) for s in shares)
    return None


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=12),
       ctxs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=9), min_size=1, max_size=8),
       cap=st.integers(1, 7), max_match=st.integers(1, 9), vocab=st.sampled_from([5, 300, 70000]))
def test_lookup_equals_a_brute_force_search(seqs, ctxs, cap, max_match, vocab) -> None:
    """Longest match, occurrence count, voted continuation and shares — across key widths (4, 3 and 2 tokens of a
    64-bit key for vocabularies of 5, 300 and 70,000 ids), sequence boundaries never crossed."""
    toks = _flat(seqs)
    idx = CorpusIndex(np.array(toks), vocab, max_match=max_match, max_votes=10 ** 9)
    for ctx in ctxs:
        got = idx.match(ctx, cap)
        want = _brute(toks, ctx, cap, max_match)
        assert (None if got is None else (got.tokens, got.match_len, got.occurrences,
                                          tuple(round(s, 9) for s in got.shares))) == want


def test_vote_samples_evenly_is_deterministic_and_breaks_ties_to_the_smaller_id() -> None:
    rng = random.Random(3)
    seqs = [[1, 2, rng.choice([7, 7, 7, 8])] for _ in range(400)] + [[1, 2, 9], [5, 6, 4], [5, 6, 3]]
    a = CorpusIndex(np.array(_flat(seqs)), 10, max_votes=16)
    b = CorpusIndex(np.array(_flat(seqs)), 10, max_votes=16)
    m = a.match([0, 1, 2], 3)
    assert m is not None and m.tokens == (7,) and m.match_len == 2 and m.occurrences == 401
    assert m == b.match([0, 1, 2], 3) and 0.5 < m.shares[0] < 1.0  # 16 evenly spaced voters of 401, sorted by key
    tie = a.match([5, 6], 2)
    assert tie is not None and tie.tokens == (3,) and tie.shares == (0.5,)  # 3 and 4 once each: the smaller id
    assert a.match([9, 9], 3) is None and a.match([], 3) is None and a.match([1, 2], 0) is None
    assert a.match([1, 2, 10 ** 6], 2) is None  # an id outside the vocabulary ends the context: nothing matches


def test_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    toks = np.array(_flat([[1, 2, 3, 4], [2, 3, 5]]), dtype=np.int32)
    path = tmp_path / "c.npz"
    save_corpus(path, toks, {"vocab_size": 8, "vocab_digest": "abc", "records": 2})
    assert corpus_meta(path)["records"] == 2
    idx = load_corpus(path, vocab_size=8, vocab_digest="abc")
    m = idx.match([7, 2, 3], 2)
    assert m is not None and m.tokens in ((4,), (5,)) and m.match_len == 2 and m.occurrences == 2
    with pytest.raises(InvalidArgumentError, match="vocabulary of 8 tokens.*build a corpus"):
        load_corpus(path, vocab_size=9)
    with pytest.raises(InvalidArgumentError, match="another tokenizer"):
        load_corpus(path, vocab_digest="xyz")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_corpus(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(InvalidArgumentError, match="not a corpus file"):
        load_corpus(tmp_path / "other.npz")
    with pytest.raises(InvalidArgumentError, match=r"token ids in \[0, 4\)"):
        CorpusIndex(toks, 4)


def test_records_become_answers_with_the_prompt_tail(tmp_path: Path) -> None:
    import json

    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"ids": [9, 9, 9, 9, 9, 1, 2, 3], "prompt_len": 6},
                                                     {"ids": [4, 4], "prompt_len": 2}]) + "\n")
    toks, stats = corpus_from_records([f])
    assert toks.tolist() == [SEP, 9, 9, 9, 1, 2, 3, SEP] and stats == {"records": 1, "answer_tokens": 2}


def test_proposer_takes_the_corpus_where_the_request_has_no_match_and_learns_its_classes() -> None:
    corpus = CorpusIndex(np.array(_flat([[10, 11, 12, 13, 14]] * 5 + [[4, 5, 6, 1, 1]] * 3)), 32)
    sp = SuffixProposer(corpus=corpus)
    p = sp.propose("r", [1, 2, 3, 10, 11], 3)
    assert p is not None and p.source == "corpus" and p.tokens == (12, 13, 14) and p.match_len == 2
    assert p.classes == (corpus_class(2, 1.0),) * 3
    sp.observe(p, 3, 1)  # 12 kept, 13 rejected
    key1, key2 = ("corpus", corpus_class(2, 1.0), 1), ("corpus", corpus_class(2, 1.0), 2)
    assert sp.confidence.hits[key1] == 1.0 and sp.confidence.reached[key2] == 1.0 and sp.confidence.hits[key2] == 0.0
    sp.observe(sp.propose("q", [4, 5, 6], 2), 2, 2)  # the corpus's (4, 5, 6) → (1, 1) learns c = 2/3 ...
    own = sp.propose("r", [5, 6, 7, 5, 6], 2)  # ... yet an own match of ≥ corpus_below (2) tokens is not second-guessed
    assert own is not None and own.source == "own" and own.tokens == (7, 5)
    short = sp.propose("s", [6, 9, 4, 5, 6], 2)  # own match (6) of 1 token: the corpus's (4, 5, 6) wins
    assert short is not None and short.source == "corpus" and short.tokens == (1, 1) and short.match_len == 3


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 30), proposers=st.sampled_from([("suffix",),
                                                                                      ("dspark", "suffix")]))
def test_greedy_output_with_a_corpus_equals_plain(ref_backend, greedy_oracle, tiny_models, seed, n,
                                                  proposers) -> None:
    """A corpus of the tiny target's own greedy answers to other prompts (plus noise): output token for token plain."""
    rng = random.Random(seed)
    target = tiny_models["target"]
    others = [[rng.randrange(3, 60) for _ in range(4)] for _ in range(3)]
    answers = [greedy_oracle(target, p, 24) for p in others]
    noise = [[rng.randrange(0, 64) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    corpus = CorpusIndex(np.array(_flat(answers + noise)), int(target.config.vocab_size))
    prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(2, 7))]
    res = generate(ref_backend("draft"), prompt, max_new_tokens=n, suffix=SuffixProposer(corpus=corpus),
                   config=LoopConfig(gamma=5, cost_table=TABLE, calibrate=False),
                   policy=PolicyConfig(max_k=5, proposers=proposers))
    assert res.tokens == greedy_oracle(target, prompt, n)


def test_batched_requests_with_a_shared_corpus_each_equal_plain(ref_backend, greedy_oracle, tiny_models) -> None:
    target = tiny_models["target"]
    prompts = [[7, 8, 9], [20, 21], [7, 8, 9, 10], [40, 41, 42]]
    answers = [greedy_oracle(target, p, 20) for p in prompts[:2]]  # two requests' answers are in the corpus
    corpus = CorpusIndex(np.array(_flat([p[-2:] + a for p, a in zip(prompts, answers)])),
                         int(target.config.vocab_size))

    def serve(index: CorpusIndex | None) -> int:
        sched = RoundScheduler(ref_backend("draft", max_batch=3), LoopConfig(gamma=5, cost_table=TABLE, calibrate=False),
                               suffix=SuffixProposer(corpus=index))
        ids = {sched.add(Request(tuple(p), 20, policy=PolicyConfig(max_k=5, proposers=("suffix",)))): i
               for i, p in enumerate(prompts)}
        out: dict[int, list[int]] = {r: [] for r in ids}
        while sched.pending:
            for ev in sched.step():
                out[ev.request_id].extend(ev.new_tokens)
        for rid, i in ids.items():
            assert out[rid] == greedy_oracle(target, prompts[i], 20)
        stats = sched.totals.by_proposer.get("suffix")
        sources = sched.totals.summary().get("suffix_sources", {})
        assert sum(v["accepted_tokens"] for v in sources.values()) == (0 if stats is None else stats.accepted_tokens)
        assert ("corpus" in sources) == (index is not None)
        return 0 if stats is None else stats.accepted_tokens

    without, with_corpus = serve(None), serve(corpus)
    assert with_corpus >= without + 15  # the corpus proposes the two answers it holds


def test_index_cache_is_reused_memory_mapped_and_rebuilt_when_broken(tmp_path: Path, caplog) -> None:
    rng = random.Random(5)
    seqs = [[rng.randrange(0, 9) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    path = tmp_path / "c.npz"
    save_corpus(path, np.array(_flat(seqs), dtype=np.int32), {"vocab_size": 9})
    cache = tmp_path / "cache"
    built = load_corpus(path, cache=cache)
    (parts,) = (cache / "corpus-index").iterdir()
    mapped = load_corpus(path, cache=cache)
    assert isinstance(mapped.positions.base, np.memmap) and built.positions.base is None  # a view of the file
    ctxs = [[rng.randrange(0, 9) for _ in range(rng.randrange(1, 8))] for _ in range(50)]
    assert [mapped.match(c, 5) for c in ctxs] == [built.match(c, 5) for c in ctxs]
    (parts / "keys0.npy").write_bytes(b"broken")
    again = load_corpus(path, cache=cache)  # unreadable parts: a warning, then the index is built afresh
    assert "unreadable" in caplog.text and [again.match(c, 5) for c in ctxs] == [built.match(c, 5) for c in ctxs]
    assert isinstance(load_corpus(path, cache=cache).positions.base, np.memmap)  # ... and kept again


def test_no_corpus_lookup_where_no_first_token_would_be_verified() -> None:
    """In a large batch a verify token costs nearly a whole row's share of the step: below first_token_floor no
    corpus class's learned c_1 could earn K ≥ 1, so the proposer skips its lookup (~0.1 ms a row)."""
    from dspark_trt.spec_decode.proposers import first_token_floor

    table = CostTable((1, 8, 16, 32, 64), (1.0, 1.3, 2.0, 3.4, 6.4))  # verify tokens compute-bound from ~16 rows
    assert first_token_floor(1, table) < 0.1 < first_token_floor(8, table) < 0.6 < first_token_floor(32, table)
    corpus = CorpusIndex(np.array(_flat([[10, 11, 12, 13]] * 4)), 32)
    sp = SuffixProposer(corpus=corpus)
    assert sp.propose("a", [3, 10, 11], 2, min_first=first_token_floor(1, table)).source == "corpus"
    assert sp.propose("b", [3, 10, 11], 2, min_first=first_token_floor(32, table)) is None  # not looked up
    for _ in range(30):  # once its class has earned c_1 = 31/32 the lookup pays even there
        p = sp.propose("c", [3, 10, 11], 2)
        sp.observe(p, 2, 2)
    assert sp.propose("d", [3, 10, 11], 2, min_first=first_token_floor(32, table)).source == "corpus"
