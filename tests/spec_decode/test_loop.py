"""spec_decode.loop over a reference backend on the tiny pair: lossless greedy, stops, cancel, fallback, sampling."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy import stats as sstats

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler, generate
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig

POLICY = st.sampled_from(["plain", "fixed", "confidence", "survival"])
PROMPT = st.lists(st.integers(4, 511), min_size=1, max_size=12)


def _policy(name: str, k: int) -> PolicyConfig:
    return PolicyConfig(policy=name, k=k, min_k=1, max_k=max(k, 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPT, policy=POLICY, k=st.integers(0, 6), gamma=st.integers(1, 7),
       draft=st.sampled_from(["draft", "draft_small"]), n=st.integers(1, 24))
def test_speculative_greedy_equals_plain_greedy(ref_backend, greedy_oracle, tiny_models, prompt, policy, k, gamma,
                                                draft, n) -> None:
    be = ref_backend(draft)
    res = generate(be, prompt, max_new_tokens=n, policy=_policy(policy, k), config=LoopConfig(gamma=gamma))
    assert res.tokens == greedy_oracle(tiny_models["target"], prompt, n)
    assert res.finish_reason == "length"
    s = res.stats
    assert s.committed_tokens == n and s.target_calls == be.verify_calls + 1
    assert s.accepted_tokens <= s.drafted_tokens


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(PROMPT, min_size=2, max_size=5), policies=st.lists(POLICY, min_size=5, max_size=5),
       lens=st.lists(st.integers(1, 20), min_size=5, max_size=5))
def test_batched_requests_each_equal_plain_greedy(ref_backend, greedy_oracle, tiny_models, prompts, policies,
                                                  lens) -> None:
    """Several requests in flight (fewer slots than requests), mixed policies incl. survival, all lossless."""
    be = ref_backend("draft", max_batch=3)
    sched = RoundScheduler(be, LoopConfig(gamma=5))
    ids = {sched.add(Request(tuple(p), lens[i], policy=_policy(policies[i], 3))): i for i, p in enumerate(prompts)}
    out: dict[int, list[int]] = {r: [] for r in ids}
    steps = 0
    while sched.pending:
        assert sched.active <= 3
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
        steps += 1
        assert steps < 200
    for rid, i in ids.items():
        assert out[rid] == greedy_oracle(tiny_models["target"], prompts[i], lens[i])


def test_admitted_first_tokens_are_handed_over_before_the_round(ref_backend, greedy_oracle, tiny_models) -> None:
    """step(on_admit=...) hands each admitted request's first token over before the round runs (a server sends it
    without waiting for the drafter pass and the verify); the round's events then hold the round's tokens only,
    and the streams are the same greedy answers."""
    be = ref_backend("draft", max_batch=2)
    sched = RoundScheduler(be, LoopConfig(gamma=4))
    prompts = [(5, 9, 13, 40), (7, 7, 21), (300, 12)]
    ids = {sched.add(Request(p, 6, policy=_policy("survival", 3))): p for p in prompts}
    out: dict[int, list[int]] = {r: [] for r in ids}
    step_start = [0]  # verify calls when the current step began
    before_verify: list[bool] = []  # per admission: handed over before the step's verify ran

    def on_admit(events) -> None:  # noqa: ANN001
        before_verify.append(be.verify_calls == step_start[0])
        for ev in events:
            assert out[ev.request_id] == [] and len(ev.new_tokens) == 1  # the prefill's token, alone and first
            out[ev.request_id].extend(ev.new_tokens)

    while sched.pending:
        step_start[0] = be.verify_calls
        for ev in sched.step(on_admit=on_admit):
            assert out[ev.request_id], "a round's event before its request's first token"
            out[ev.request_id].extend(ev.new_tokens)
    assert before_verify == [True, True]  # two admissions (two slots, then the third request), each before its round
    for rid, p in ids.items():
        assert out[rid] == greedy_oracle(tiny_models["target"], p, 6)


def test_speculation_actually_saves_target_calls(ref_backend) -> None:
    res = generate(ref_backend("draft"), [10, 20, 30, 40], max_new_tokens=48,
                   policy=PolicyConfig(policy="fixed", k=4), config=LoopConfig(gamma=4))
    assert res.stats.accepted_tokens > 0
    assert res.stats.tau > 1.2  # the ~60%-agreement draft commits > 1 token per target forward
    assert res.stats.target_calls < 48
    plain = generate(ref_backend("draft"), [10, 20, 30, 40], max_new_tokens=48, policy=PolicyConfig(policy="plain"))
    assert plain.stats.tau == 1.0 and plain.stats.draft_calls == 0


def test_eos_and_stop_sequences_cut_output_exactly(ref_backend, greedy_oracle, tiny_models) -> None:
    prompt = [7, 8, 9]
    ref = greedy_oracle(tiny_models["target"], prompt, 30)
    eos = ref[9]
    first = ref.index(eos)
    res = generate(ref_backend("draft"), prompt, max_new_tokens=30, eos_ids=[eos],
                   policy=PolicyConfig(policy="fixed", k=6), config=LoopConfig(gamma=6))
    assert res.tokens == ref[: first + 1] and res.finish_reason == "eos"
    stop = tuple(ref[12:14])
    res = generate(ref_backend("draft"), prompt, max_new_tokens=30, stop_sequences=[stop],
                   policy=PolicyConfig(policy="fixed", k=6), config=LoopConfig(gamma=6))
    cut = next(i for i in range(2, 31) if tuple(ref[i - 2:i]) == stop)
    assert res.tokens == ref[:cut] and res.finish_reason == "stop"


def test_drafter_failure_falls_back_to_plain_with_identical_output(ref_backend, greedy_oracle, tiny_models) -> None:
    be = ref_backend("draft", fail_draft=lambda call: call % 2 == 1)
    res = generate(be, [3, 4, 5], max_new_tokens=20, policy=PolicyConfig(policy="fixed", k=3),
                   config=LoopConfig(gamma=3))
    assert res.tokens == greedy_oracle(tiny_models["target"], [3, 4, 5], 20)
    assert res.stats.draft_failures > 0
    assert any(r.fallback and r.k == 0 for r in res.stats.rounds)


def test_cancel_frees_the_slot_for_a_waiting_request(ref_backend) -> None:
    be = ref_backend("draft", max_batch=1)
    sched = RoundScheduler(be, LoopConfig(gamma=3))
    a = sched.add(Request((1, 2, 3), 50))
    b = sched.add(Request((4, 5, 6), 5))
    assert {e.request_id for e in sched.step()} == {a}
    assert sched.cancel(a) and not sched.cancel(a)
    assert be.ctx.keys() == set()  # released in the backend
    evs = sched.step()
    assert [e.request_id for e in evs] == [b]


def test_bad_requests_raise_clear_errors(ref_backend) -> None:
    sched = RoundScheduler(ref_backend("draft", max_seq=64), LoopConfig(gamma=4))
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        Request((1,), 0)
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        Request(())
    with pytest.raises(InvalidArgumentError, match="max_seq 64"):
        sched.add(Request((1,) * 10, 60))
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        sched.add(Request((1, 99999), 4))
    with pytest.raises(InvalidArgumentError, match="temperature"):
        Request((1,), 4, SamplingParams(temperature=-1.0))


def test_sampling_is_reproducible_for_a_seed(ref_backend) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    pol = PolicyConfig(policy="fixed", k=3)
    a = generate(ref_backend("draft"), [11, 12], max_new_tokens=16, sampling=sp, policy=pol, config=LoopConfig(gamma=3))
    b = generate(ref_backend("draft"), [11, 12], max_new_tokens=16, sampling=sp, policy=pol, config=LoopConfig(gamma=3))
    assert a.tokens == b.tokens and a.stats.drafted_tokens > 0


@torch.no_grad()
def test_speculative_sampling_matches_target_marginals(ref_backend, tiny_models) -> None:
    """x1 from prefill, x2 verified speculatively (K=1; 3 tokens, since K ≤ tokens left − 1): the marginal of x2
    equals Σ_x1 p(x1) p(x2 | x1)."""
    target, prompt, temp, n = tiny_models["target"], [40, 41, 42], 1.5, 600
    p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1] / temp, -1)  # [V]
    v = p1.shape[0]
    seqs = torch.cat([torch.tensor(prompt).expand(v, -1), torch.arange(v).unsqueeze(1)], 1)  # [V, 4]
    p2_given = torch.softmax(target(seqs).logits[:, -1] / temp, -1)  # [V, V]
    p2 = (p1.unsqueeze(1) * p2_given).sum(0).double()
    be = ref_backend("draft_small", max_batch=8)
    sched = RoundScheduler(be, LoopConfig(gamma=1))
    out: dict[int, list[int]] = {}
    for s in range(n):
        out[sched.add(Request(tuple(prompt), 3, SamplingParams(temperature=temp, seed=s),
                              PolicyConfig(policy="fixed", k=1)))] = []
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    x2 = torch.tensor([t[1] for t in out.values()])
    counts = torch.bincount(x2, minlength=v).double()
    big = p2 * n >= 8  # pool the rare tokens into one cell
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([p2[big], p2[~big].sum().unsqueeze(0)]) * n
    assert sstats.chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy()).pvalue > 1e-3
    assert be.draft_calls > 0 and sched.totals.accepted_tokens > 0  # x2 really was a verified draft


def test_mixed_greedy_and_sampled_rows_in_one_batch(ref_backend, greedy_oracle, tiny_models) -> None:
    be = ref_backend("draft", max_batch=3)
    sched = RoundScheduler(be, LoopConfig(gamma=4))
    g = sched.add(Request((9, 10, 11), 20, policy=PolicyConfig(policy="confidence", max_k=4)))
    s = sched.add(Request((12, 13), 20, SamplingParams(temperature=1.0, top_p=0.9, seed=5),
                          PolicyConfig(policy="survival", max_k=4)))
    out: dict[int, list[int]] = {g: [], s: []}
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    assert out[g] == greedy_oracle(tiny_models["target"], [9, 10, 11], 20)
    assert len(out[s]) == 20
    assert sched.totals.verify_calls > 0 and sched.totals.committed_tokens == 40
    assert sched.totals.rounds == [] and sched.totals.acceptance_per_position()  # counters only: no unbounded log
