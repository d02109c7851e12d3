"""The suffix proposer (spec_decode.suffix) and its place in the round (spec_decode.proposers, loop): matches, the
cross-request index's bound and eviction, the learned confidences, the per-row choice, and losslessness (greedy
token for token; sampling in distribution) with DSpark, suffix and both."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy import stats as sstats

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.accept import sample_accept
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler, generate
from dspark_trt.spec_decode.policies import parse_proposers
from dspark_trt.spec_decode.proposers import assemble, rate, skip_drafter
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import CostTable, PolicyConfig, PolicyState
from dspark_trt.spec_decode.suffix import (SequenceIndex, SuffixConfidence, SuffixConfig, SuffixIndex,
                                           SuffixProposal, SuffixProposer, own_class)

TABLE = CostTable(tuple(range(1, 10)), tuple(1.0 + 0.05 * i for i in range(9)), draft_t0=0.2, draft_t1=0.0)
HYBRID = ("dspark", "suffix")


# ---- the index ------------------------------------------------------------------------------------------
def test_own_index_finds_the_longest_match() -> None:
    idx = SequenceIndex(SuffixConfig(min_match=2, max_match=4))
    idx.extend([1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3])
    toks, n = idx.match(3)  # type: ignore[misc]
    assert n == 3 and toks == [9, 5, 2]  # [1, 2, 3] matched (the order-2 [2, 3] → 7 is later but shorter)
    idx.extend([9])  # ... 1 2 3 9: [1, 2, 3, 9] matches at 0..3 → 5 2 3
    assert idx.match(3) == ([5, 2, 3], 4)
    idx2 = SequenceIndex(SuffixConfig(min_match=2, max_match=4))
    idx2.extend([4, 4, 4])
    assert idx2.match(5) == ([4, 4, 4, 4, 4], 2)  # a loop is continued past the end of the sequence (period 1)
    idx3 = SequenceIndex(SuffixConfig(min_match=2, max_match=4))
    idx3.extend([1, 2, 3, 4])
    assert idx3.match(4) is None  # nothing repeats
    assert idx.entries <= 3 * len(idx)  # ≤ (max − min + 1) entries per token


def test_own_index_continues_the_most_frequent_next_token_the_first_seen_on_ties() -> None:
    cfg = SuffixConfig(min_match=2, max_match=2)
    idx = SequenceIndex(cfg)
    idx.extend([1, 2, 7, 0, 1, 2, 7, 5, 1, 2, 8, 6, 1, 2])  # [1, 2] → 7 twice, then 8 once (the latest)
    assert idx.match(3) == ([7, 5, 1], 2)  # the usual continuation, from its latest occurrence
    tie = SequenceIndex(cfg)
    tie.extend([1, 2, 7, 0, 1, 2, 8, 6, 1, 2])  # [1, 2] → 7 once, 8 once
    assert tie.match(3) == ([7, 0, 1], 2)  # a tie: the first seen (in an edit, the prompt's own text)
    tie.extend([8, 3, 1, 2])  # 8 now leads 2 : 1
    assert tie.match(2) == ([8, 3], 2)


def test_own_match_confidence_class_says_how_its_continuations_voted() -> None:
    cfg = SuffixConfig(min_match=2, max_match=2)
    idx = SequenceIndex(cfg)
    idx.extend([1, 2, 7, 1, 2])
    assert idx.support(2) == 0  # one earlier occurrence
    idx.extend([7, 1, 2])
    assert idx.support(2) == 2  # unanimous over two
    idx.extend([8, 1, 2])
    assert idx.support(2) == 1  # contested: 7 twice, 8 once
    uni = SequenceIndex(cfg)
    uni.extend([1, 2, 5] * 3 + [1, 2])
    assert uni.support(2) == 3 and uni.support(0) == 0  # unanimous over three; no suffix, no vote
    assert own_class(2, 0, 8) == 2 and own_class(2, 3, 8) == 26  # a single occurrence keeps the length-only class
    sp = SuffixProposer(cfg)
    for _ in range(30):  # unanimous ×3 matches are always accepted, single-occurrence ones never
        sp.observe(SuffixProposal((5,), (0.5,), 2, "own", (own_class(2, 3, 2),)), 1, 1)
        sp.observe(SuffixProposal((5,), (0.5,), 2, "own"), 1, 0)
    p = sp.propose("u", [1, 2, 5] * 3 + [1, 2], 1)
    assert p is not None and p.classes == (own_class(2, 3, 2),) and p.conf[0] > 0.9
    p = sp.propose("s", [1, 2, 5, 1, 2], 1)
    assert p is not None and p.classes == () and p.conf[0] < 0.1  # its class is the match length, as before
    off = SuffixProposer(SuffixConfig(min_match=2, max_match=2, support_classes=False))
    p = off.propose("u", [1, 2, 5] * 3 + [1, 2], 1)
    assert p is not None and p.classes == () and p.conf[0] == pytest.approx(0.5)


def test_cross_index_is_bounded_evicts_oldest_and_drops_overwritten_tokens() -> None:
    cfg = SuffixConfig(min_match=2, max_match=3, ring_tokens=64, max_entries=40)
    idx = SuffixIndex(cfg)
    idx.add([10, 11, 12, 13, 14])
    assert idx.match([99, 10, 11], 3) == ([12, 13, 14], 2)
    assert idx.match([5, 10, 11, 12], 8) == ([13, 14], 3)  # the continuation stops at the end of what was stored
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # 20 × 30 tokens: far past both bounds
        idx.add(torch.randint(100, 500, (30,), generator=g).tolist())
        assert idx.entries <= cfg.max_entries
    assert idx.match([10, 11], 3) is None  # evicted (and its ring tokens overwritten)
    recent = torch.randint(100, 500, (10,), generator=g).tolist()
    idx.add(recent)
    assert idx.match(recent[2:4], 2) == (recent[4:6], 2)


def test_cross_index_never_proposes_from_overwritten_ring_tokens() -> None:
    cfg = SuffixConfig(min_match=2, max_match=2, ring_tokens=8, max_entries=1000)
    idx = SuffixIndex(cfg)
    idx.add([1, 2, 3, 4])
    idx.add([50, 51, 52, 53, 54, 55])  # the ring (8) now holds 3 4 50 .. 55: [1, 2]'s key and continuation are gone
    assert idx.match([1, 2], 2) is None
    assert idx.match([50, 51], 2) == ([52, 53], 2)


def test_confidence_learns_per_depth_and_match_length_and_forgets() -> None:
    c = SuffixConfidence(SuffixConfig(horizon=20))
    assert c.conf("own", 4, 1) == pytest.approx(0.5)  # the Beta(1, 1) prior
    for _ in range(10):
        c.observe("own", 4, k=3, accepted=1)  # position 1 always accepted, position 2 always rejected, 3 unreached
    assert c.conf("own", 4, 1) == pytest.approx(11 / 12)
    assert c.conf("own", 4, 2) == pytest.approx(1 / 12)
    assert c.conf("own", 4, 3) == pytest.approx(0.5)  # never reached: still the prior
    assert c.conf("own", 2, 1) == pytest.approx(0.5) and c.conf("cross", 4, 1) == pytest.approx(0.5)
    for _ in range(40):
        c.observe("own", 4, k=1, accepted=0)
    assert c.conf("own", 4, 1) < 0.15  # the horizon halves old counts: 40 rejections outweigh 10 old accepts
    assert c.reached[("own", 4, 1)] <= 20


def test_proposer_prefers_the_longer_match_and_releases_into_the_cross_index() -> None:
    sp = SuffixProposer(SuffixConfig(min_match=2, max_match=6))
    assert sp.propose("a", [1, 2, 3, 4], 3) is None
    sp.release("a", [1, 2, 3, 4, 5, 6, 7, 8], prompt_len=4)
    assert sp.requests == 0
    p = sp.propose("b", [9, 9, 5, 6], 3)
    assert p is not None and p.tokens == (7, 8) and p.source == "cross" and p.match_len == 2
    p = sp.propose("c", [5, 6, 0, 2, 3, 4, 5, 6], 3)  # own [5, 6] → 0 (len 2) loses to cross [2, .., 6] (len 5:
    assert p is not None and p.source == "cross" and p.tokens == (7, 8) and p.match_len == 5  # prompt tail kept)
    assert len(p.conf) == 2 and all(0 < x < 1 for x in p.conf)
    with pytest.raises(InvalidArgumentError, match="min_match"):
        SuffixConfig(min_match=3, max_match=2)
    with pytest.raises(InvalidArgumentError, match="proposers must be a non-empty comma list of dspark, suffix"):
        parse_proposers("dspark,ngram")
    assert parse_proposers("suffix,dspark,suffix") == HYBRID
    assert PolicyConfig(proposers=("suffix",)).uses("suffix") and not PolicyConfig(policy="plain",
                                                                                     proposers=HYBRID).uses("suffix")


# ---- the choice rule ------------------------------------------------------------------------------------
def test_skip_drafter_where_the_suffix_pays_better() -> None:
    good = SuffixProposal((1, 2, 3, 4), (0.95, 0.9, 0.9, 0.9), 6, "own")
    weak = SuffixProposal((1,), (0.1,), 2, "own")
    drafter_ok, drafter_bad, fresh = PolicyState(k=4, survival_est=[0.6, 0.3]), PolicyState(k=4, survival_est=[0.05]), \
        PolicyState(k=4)
    one = [skip_drafter([c], [p], [s], TABLE)[0] for c, p, s in
           [(4, good, drafter_ok), (4, weak, drafter_ok), (4, weak, fresh), (4, None, drafter_ok), (0, good, fresh)]]
    assert one == [0, 4, 4, 4, 0]  # good suffix beats a fair drafter; a weak one does not; no estimate: draft
    assert skip_drafter([4], [weak], [drafter_bad], TABLE) == [0]  # a useless drafter loses even to a weak suffix
    # batch-aware: in a 5-row round the fair drafter's extra verify tokens + pass cost more than they commit
    assert skip_drafter([4] * 5, [weak] * 5, [drafter_ok] * 5, TABLE) == [0] * 5
    assert rate([], 2, TABLE) == pytest.approx(2 / TABLE.step_seconds(2))
    assert rate([0.9, 0.9], 1, TABLE) == pytest.approx((1 + 1.8) / TABLE.step_seconds(3))


def test_assemble_takes_the_better_proposal_and_one_hot_q_for_sampled_rows() -> None:
    from dspark_trt.spec_decode.protocols import DraftBlock

    cfgs = [PolicyConfig(proposers=HYBRID)] * 3
    states = [PolicyState(k=4) for _ in range(3)]
    sampling = [SamplingParams(), SamplingParams(1.0, seed=1), SamplingParams()]
    block = DraftBlock(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.full((2, 3, 16), 1 / 16),
                       torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.2, 0.2]]))
    props = [SuffixProposal((1, 2), (0.5, 0.5), 2, "own"), SuffixProposal((3, 4, 5, 6), (0.9,) * 4, 5, "own"),
             SuffixProposal((11,), (0.7,), 2, "cross")]
    out = assemble(cfgs, states, sampling, [4, 4, 4], [3, 3, 0], [0, 1], [3, 3, 0], block, props, 16, TABLE)
    assert out.source == ["dspark", "suffix", "suffix"] and out.avail == [3, 4, 1]
    assert out.tokens.tolist() == [[5, 6, 7, 0], [3, 4, 5, 6], [11, 0, 0, 0]]
    assert out.q is not None and out.q.shape == (3, 4, 16)
    assert torch.equal(out.q[1].argmax(-1), torch.tensor([3, 4, 5, 6])) and float(out.q[1].sum()) == 4.0
    assert torch.allclose(out.q[0, :3], torch.full((3, 16), 1 / 16))
    assert out.conf is not None and out.conf[1].tolist() == pytest.approx([0.9] * 4)


# ---- losslessness ---------------------------------------------------------------------------------------
PROPOSERS = st.sampled_from([("dspark",), ("suffix",), HYBRID])
POLICY = st.sampled_from(["fixed", "confidence", "survival"])
PIECE = st.lists(st.integers(4, 511), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(piece=PIECE, reps=st.integers(1, 3), policy=POLICY, k=st.integers(1, 6), gamma=st.integers(1, 7),
       proposers=PROPOSERS, n=st.integers(1, 28))
def test_greedy_output_equals_plain_with_any_proposers(ref_backend, greedy_oracle, tiny_models, piece, reps, policy,
                                                       k, gamma, proposers, n) -> None:
    prompt = piece * reps  # repeats give the suffix proposer matches from the first round
    be = ref_backend("draft")
    res = generate(be, prompt, max_new_tokens=n, config=LoopConfig(gamma=gamma, cost_table=TABLE, calibrate=False),
                   policy=PolicyConfig(policy=policy, k=k, min_k=1, max_k=max(k, 1), proposers=proposers))
    assert res.tokens == greedy_oracle(tiny_models["target"], prompt, n)
    s = res.stats
    assert s.committed_tokens == n and s.accepted_tokens <= s.drafted_tokens
    assert sum(p.accepted_tokens for p in s.by_proposer.values()) == s.accepted_tokens
    if "dspark" not in proposers:
        assert be.draft_calls == 0 and "dspark" not in s.by_proposer


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(PIECE, min_size=2, max_size=5), proposers=st.lists(PROPOSERS, min_size=5, max_size=5),
       lens=st.lists(st.integers(1, 24), min_size=5, max_size=5), max_batch=st.integers(1, 3))
def test_batched_mixed_proposers_each_equal_plain(ref_backend, greedy_oracle, tiny_models, pieces, proposers, lens,
                                                  max_batch) -> None:
    """Several requests in flight with different proposers (one shared cross-request index), each lossless."""
    be = ref_backend("draft", max_batch=max_batch)
    sched = RoundScheduler(be, LoopConfig(gamma=5, cost_table=TABLE, calibrate=False), suffix=SuffixProposer())
    ids = {sched.add(Request(tuple(p * 2), lens[i], policy=PolicyConfig(max_k=5, proposers=proposers[i]))): i
           for i, p in enumerate(pieces)}
    out: dict[int, list[int]] = {r: [] for r in ids}
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    for rid, i in ids.items():
        assert out[rid] == greedy_oracle(tiny_models["target"], pieces[i] * 2, lens[i])
    assert sched.suffix is not None and sched.suffix.requests == 0  # every request released its own index


def test_suffix_alone_needs_no_drafter_and_saves_target_calls(tiny_models, greedy_oracle) -> None:
    from tests.spec_decode.conftest import RefBackend

    target = tiny_models["target"]
    prompt = [30, 31, 32, 33, 34, 35, 36, 37] * 3
    ref = greedy_oracle(target, prompt, 40)
    be = RefBackend(target, None)
    sp = SuffixProposer()
    sp.release("earlier", prompt + ref, len(prompt))  # an earlier request wrote this very output
    res = generate(be, prompt, max_new_tokens=40, policy=PolicyConfig(max_k=6, proposers=("suffix",)),
                   config=LoopConfig(gamma=6, cost_table=TABLE, calibrate=False), suffix=sp)
    assert res.tokens == ref and be.draft_calls == 0
    s = res.stats.by_proposer["suffix"]
    assert s.accepted_tokens >= 30 and res.stats.tau > 3  # the output is copied from the cross-request index
    assert res.stats.summary()["proposers"]["suffix"]["acceptance_per_position"][0] > 0.9


def test_useless_drafter_rule_holds_with_both_proposers(ref_backend, greedy_oracle, tiny_models) -> None:
    from tests.spec_decode.test_gate import _UselessDrafter

    be = _UselessDrafter(ref_backend("draft"))
    prompt, n = [11, 22, 33, 44, 55], 60
    res = generate(be, prompt, max_new_tokens=n, policy=PolicyConfig(max_k=4, proposers=HYBRID),
                   config=LoopConfig(gamma=4, cost_table=TABLE, calibrate=False))
    assert res.tokens == greedy_oracle(tiny_models["target"], prompt, n)
    assert be.draft_calls <= 8, be.draft_calls  # of ~60 rounds: the gate still closes the drafter


@torch.no_grad()
def test_one_hot_proposal_keeps_the_target_distribution() -> None:
    """A deterministic draft d (q = one-hot at d) through exact rejection sampling: the committed token at the
    first position is distributed as p, whichever d (likely or not)."""
    g = torch.Generator().manual_seed(0)
    v, n = 12, 4000
    logits = torch.randn(1, 2, v, generator=g) * 1.5
    p = torch.softmax(logits[0, 0], -1).double()
    for d in (int(p.argmax()), int(p.argmin())):
        q = torch.nn.functional.one_hot(torch.tensor([[d]]), v).float()  # [1, 1, V]
        res = sample_accept(logits.expand(n, -1, -1), torch.full((n, 1), d), q.expand(n, -1, -1),
                            torch.ones(n, dtype=torch.long), torch.ones(n), torch.ones(n),
                            torch.arange(n), torch.full((n,), 7))
        first = torch.where(res.accepted > 0, torch.full((n,), d), res.next_token)
        counts = torch.bincount(first, minlength=v).double()
        assert sstats.chisquare(counts.numpy(), (p / p.sum() * counts.sum()).numpy()).pvalue > 1e-3
        assert abs(float(res.accepted.double().mean()) - float(p[d])) < 4 * (float(p[d]) / n) ** 0.5 + 1e-3


@torch.no_grad()
def test_speculative_sampling_with_suffix_proposals_matches_target_marginals(ref_backend, tiny_models) -> None:
    """As test_loop's marginal test, with every round-1 draft from the suffix proposer: the cross-request index
    holds a continuation for every token (the target's own argmax after it, so proposals are often accepted)."""
    target, prompt, temp, n = tiny_models["target"], [40, 41, 42], 1.5, 600
    p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1] / temp, -1)  # [V]
    v = p1.shape[0]
    seqs = torch.cat([torch.tensor(prompt).expand(v, -1), torch.arange(v).unsqueeze(1)], 1)  # [V, 4]
    p2_given = torch.softmax(target(seqs).logits[:, -1] / temp, -1)  # [V, V]
    p2 = (p1.unsqueeze(1) * p2_given).sum(0).double()
    sp = SuffixProposer(SuffixConfig(min_match=1, max_match=1))
    for x1, w in enumerate(p2_given.argmax(-1).tolist()):
        sp.cross.add([x1, w])
    be = ref_backend("draft_small", max_batch=8)
    sched = RoundScheduler(be, LoopConfig(gamma=1), suffix=sp)
    out: dict[int, list[int]] = {}
    for s in range(n):
        out[sched.add(Request(tuple(prompt), 3, SamplingParams(temperature=temp, seed=s),
                              PolicyConfig(policy="fixed", k=1, proposers=("suffix",))))] = []
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    x2 = torch.tensor([t[1] for t in out.values()])
    counts = torch.bincount(x2, minlength=v).double()
    big = p2 * n >= 8  # pool the rare tokens into one cell
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([p2[big], p2[~big].sum().unsqueeze(0)]) * n
    assert sstats.chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy()).pvalue > 1e-3
    suffix = sched.totals.by_proposer["suffix"]
    assert be.draft_calls == 0 and suffix.rounds >= n and suffix.accepted_tokens > n // 10  # x2 was a verified draft


def test_confidence_learns_from_greedy_rounds_another_proposer_won() -> None:
    sp = SuffixProposer()
    p = SuffixProposal((5, 6, 7), (0.5,) * 3, 3, "own")
    sp.observe_committed(p, [5, 6, 9])  # d_1, d_2 would have been kept, d_3 rejected
    sp.observe_committed(p, [5])  # only position 1 decidable: accepted
    c = sp.confidence
    assert c.reached[("own", 3, 1)] == 2 and c.hits[("own", 3, 1)] == 2
    assert c.reached[("own", 3, 3)] == 1 and c.hits.get(("own", 3, 3), 0) == 0
    sp.observe_committed(p, [4, 6])  # rejected at once
    assert c.reached[("own", 3, 1)] == 3 and c.hits[("own", 3, 1)] == 2 and c.reached[("own", 3, 2)] == 1


def test_sampled_hybrid_rounds_mix_dspark_q_and_one_hot_q_and_reproduce(ref_backend) -> None:
    """Sampled rows with both proposers: DSpark rows keep their q, suffix rows get a one-hot q in the same batch;
    a seed fixes the output."""
    def run() -> tuple[dict[int, list[int]], RoundScheduler]:
        be = ref_backend("draft", max_batch=3)
        sched = RoundScheduler(be, LoopConfig(gamma=4, cost_table=TABLE, calibrate=False), suffix=SuffixProposer())
        ids = [sched.add(Request(tuple(p), 30, SamplingParams(temperature=0.7, seed=s),
                                 PolicyConfig(max_k=4, proposers=HYBRID)))
               for s, p in enumerate([[5, 6, 7, 8] * 4, [9, 10, 11] * 3, [12, 13] * 5])]
        out: dict[int, list[int]] = {r: [] for r in ids}
        while sched.pending:
            for ev in sched.step():
                out[ev.request_id].extend(ev.new_tokens)
        return out, sched

    a, sched = run()
    b, _ = run()
    assert a == b and all(len(t) == 30 for t in a.values())
    assert {"dspark", "suffix"} <= set(sched.totals.by_proposer), sched.totals.by_proposer


def _rosenblatt(p: torch.Tensor, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[N] u = P(tokens more likely than x) + v·p(x) under each row's distribution p [N, V] (ties by index): i.i.d.
    uniform when each x is drawn from its p; near 0 when x is too often a likely token (an over-accepted draft)."""
    order = torch.argsort(-p.double(), dim=-1, stable=True)  # [N, V] most likely first
    rank = torch.argsort(order, dim=-1, stable=True).gather(1, x[:, None])  # [N, 1] x's place in that order
    before = torch.cumsum(p.double().gather(1, order), -1) - p.double().gather(1, order)  # [N, V] mass before each
    px = p.double().gather(1, x[:, None])[:, 0]
    return before.gather(1, rank)[:, 0] + v * px


@torch.no_grad()
def test_sampled_suffix_dspark_and_hybrid_rows_keep_the_target_joint_distribution(ref_backend, tiny_models) -> None:
    """Temperature > 0, three kinds of rows in the same batches — suffix alone (one-hot q), DSpark alone (the
    drafter's q) and both (chosen per row) — verifying K = 2 drafts in their first round: the four generated tokens
    (x1 from the prefill, then accepted / recovered / bonus tokens) follow the target's own sampling distribution,
    jointly. Exact test, no marginals pooled: under the target's conditionals p_j(· | prompt, x_<j) the Rosenblatt
    values u_j (_rosenblatt, auxiliary uniforms v) of every sample are i.i.d. uniform iff the law is the target's;
    KS test on the 4n values of each kind. The suffix's own proposals (the target's argmax) fail it."""
    target, prompt, temp, n = tiny_models["target"], [40, 41, 42], 1.5, 200  # n requests per kind
    v = int(target.config.vocab_size)
    seqs = torch.cat([torch.tensor(prompt).expand(v, -1), torch.arange(v).unsqueeze(1)], 1)  # [V, 4]
    after = target(seqs).logits[:, -1].argmax(-1)  # [V]: the target's argmax after (prompt, x)
    sp = SuffixProposer(SuffixConfig(min_match=1, max_match=1))
    for x, w in enumerate(after.tolist()):  # every token has a continuation: the suffix proposes every round
        sp.cross.add([x, w, int(after[w])])
    be = ref_backend("draft", max_batch=8)
    sched = RoundScheduler(be, LoopConfig(gamma=2, cost_table=TABLE, calibrate=False), suffix=sp)
    kinds = {"suffix": ("suffix",), "dspark": ("dspark",), "hybrid": HYBRID}
    rid_kind: dict[int, str] = {}
    for s in range(n):
        for kind, props in kinds.items():  # interleaved: every batch mixes the kinds
            rid = sched.add(Request(tuple(prompt), 4, SamplingParams(temperature=temp, seed=len(rid_kind)),
                                    PolicyConfig(policy="fixed", k=2, proposers=props)))
            rid_kind[rid] = kind
    out: dict[int, list[int]] = {r: [] for r in rid_kind}
    chosen: dict[str, set[str]] = {k: set() for k in kinds}
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
            if ev.finished:
                chosen[rid_kind[ev.request_id]] |= {p for p, ps in ev.stats.by_proposer.items() if ps.rounds}
    assert chosen["suffix"] == {"suffix"} and chosen["dspark"] == {"dspark"} and chosen["hybrid"], chosen
    assert all(len(sched.totals.by_proposer[p].pos_verified) == 2 for p in HYBRID)  # rounds of K = 2 for both
    x = torch.tensor([out[r] for r in sorted(out)])  # [3n, 4]
    kind_of = [rid_kind[r] for r in sorted(out)]
    base = torch.tensor(prompt).expand(len(x), -1)
    ps = [torch.softmax(target(torch.cat([base, x[:, :j]], 1)).logits[:, -1] / temp, -1)  # [3n, V] each
          for j in range(x.shape[1])]
    aux = torch.rand(len(x), x.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = torch.stack([_rosenblatt(p, x[:, j], aux[:, j]) for j, p in enumerate(ps)], 1)  # [3n, 4]
    for kind in kinds:
        rows = torch.tensor([k == kind for k in kind_of])
        pval = sstats.kstest(u[rows].reshape(-1).numpy(), "uniform").pvalue
        assert pval > 1e-3, (kind, pval)
    proposal = after[x[:, 0]]  # what the suffix proposed for x2: a sampler accepting it always is caught
    assert sstats.kstest(_rosenblatt(ps[1], proposal, aux[:, 1]).numpy(), "uniform").pvalue < 1e-6


@torch.no_grad()
def test_seeded_sampled_suffix_rows_commit_plain_samplings_tokens(ref_backend, tiny_models) -> None:
    """Sampled rows whose drafts come from the suffix match are verified coupled to the target's sampler: a seeded
    request commits, token for token, what plain sampling with its seed commits — whatever the match proposed, at
    any K, batched with DSpark, hybrid and greedy rows (the hybrid rows' suffix rounds too; their DSpark rounds keep
    the distribution only). The cross-request index holds the target's argmax after every token, so the match
    proposes every round and the target often keeps it."""
    target = tiny_models["target"]
    v = int(target.config.vocab_size)
    prompts = [[40, 41, 42], [7, 8, 9, 7, 8], [100, 3, 100, 3, 100]]
    seqs = torch.arange(v).unsqueeze(1)  # [V, 1]
    after = target(seqs).logits[:, -1].argmax(-1)  # [V]
    n, temps = 12, (0.6, 1.0)

    def run(props: tuple[str, ...] | None, k: int) -> tuple[dict[tuple[int, int], list[int]], RoundScheduler]:
        sp = SuffixProposer(SuffixConfig(min_match=1, max_match=1))
        for x, w in enumerate(after.tolist()):
            sp.cross.add([x, w, int(after[w])])
        sched = RoundScheduler(ref_backend("draft", max_batch=8), LoopConfig(gamma=4, cost_table=TABLE, calibrate=False),
                               suffix=sp)
        rid: dict[int, tuple[int, int]] = {}
        for i, p in enumerate(prompts):
            for t, temp in enumerate(temps):
                pol = (PolicyConfig(policy="plain") if props is None else
                       PolicyConfig(policy="fixed", k=k, min_k=0, max_k=k, proposers=props))
                rid[sched.add(Request(tuple(p), n, SamplingParams(temperature=temp, top_p=0.95, seed=31 * i + t),
                                      pol))] = (i, t)
            sched.add(Request(tuple(p), n, SamplingParams(), PolicyConfig(policy="fixed", k=3, proposers=HYBRID)))
            sched.add(Request(tuple(p), n, SamplingParams(temperature=0.8, seed=5), PolicyConfig(
                policy="fixed", k=3, proposers=("dspark",))))
        out: dict[int, list[int]] = {r: [] for r in rid}
        while sched.pending:
            for ev in sched.step():
                if ev.request_id in out:
                    out[ev.request_id].extend(ev.new_tokens)
        return {rid[r]: t for r, t in out.items()}, sched

    plain, _ = run(None, 0)
    assert all(len(t) == n for t in plain.values())
    for k in (1, 3):
        got, sched = run(("suffix",), k)
        assert got == plain, k
        assert sched.totals.by_proposer["suffix"].accepted_tokens > 0  # proposals were kept, not only rejected
    got, _ = run(HYBRID, 4)  # a hybrid row's answer may differ (its DSpark rounds), yet stays a valid sample
    assert all(len(t) == n for t in got.values())
