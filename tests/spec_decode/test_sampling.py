"""One rule for sampling settings (spec_decode.sampling), the loop's speculation switch, and the one pass timer."""
from __future__ import annotations

import pytest

from dspark_trt.errors import InvalidArgumentError, RequestError
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler, generate
from dspark_trt.spec_decode.sampling import MAX_TEMPERATURE, SamplingParams, check_sampling
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.spec_decode.stats import TimedBackend

BAD = [  # (temperature, top_p, seed, message fragment)
    (-0.5, 1.0, None, "temperature must be a finite number in [0, 100] (0 = greedy), got -0.5"),
    (float("nan"), 1.0, None, "temperature must be a finite number"),
    (MAX_TEMPERATURE * 2, 1.0, None, "temperature must be a finite number in [0, 100]"),
    (True, 1.0, None, "temperature must be"),
    (1.0, 0.0, None, "top_p must be a number in (0, 1]"),
    (1.0, 1.5, None, "top_p must be a number in (0, 1]"),
    (1.0, 1.0, -1, "seed must be unset or an integer in [0, 2^63 − 1], got -1"),
    (1.0, 1.0, 2**63, "seed must be unset or an integer"),
    (1.0, 1.0, 1.5, "seed must be unset or an integer"),
]


@pytest.mark.parametrize("temperature,top_p,seed,message", BAD)
def test_one_rule_one_message(temperature: object, top_p: object, seed: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        SamplingParams(temperature, top_p, seed)  # type: ignore[arg-type]
    assert message in str(exc.value)


def test_front_ends_share_the_rule_and_name_their_own_argument() -> None:
    import numpy as np

    from dspark_trt.serve.config import ServeConfig
    from dspark_trt.serve.validate import parse_generation

    with pytest.raises(InvalidArgumentError, match=r"^--top-p must be a number in \(0, 1\]"):
        check_sampling(1.0, 0.0, None, names={"top_p": "--top-p"})
    limits = ServeConfig(max_seq_len=64, max_batch=2, gamma=4, vocab_size=512)
    with pytest.raises(RequestError, match=r"^random_seed must be unset or an integer in \[0, 2\^63 − 1\], got -1"):
        parse_generation({"max_tokens": np.array([4]), "random_seed": np.array([-1])}, 5, limits)
    with pytest.raises(RequestError, match=r"^temperature must be a finite number in \[0, 100\]"):
        parse_generation({"max_tokens": np.array([4]), "temperature": np.array([-1.0])}, 5, limits)
    SamplingParams(np.float32(0.7), np.float64(0.9), np.int64(3))  # numpy scalars from request tensors are fine


def test_speculation_off_runs_plain_rounds_with_the_same_output(ref_backend, greedy_oracle,  # noqa: ANN001
                                                                 tiny_models) -> None:  # noqa: ANN001
    be = ref_backend("draft")
    sched = RoundScheduler(be, LoopConfig(gamma=4), speculate=False)
    rid = sched.add(Request((9, 10, 11), 12, policy=PolicyConfig(policy="fixed", k=4)))
    out: list[int] = []
    while sched.pending:
        if len(out) >= 6:
            sched.speculate = True  # flipped between steps: later rounds speculate again
        out += [t for ev in sched.step() if ev.request_id == rid for t in ev.new_tokens]
    assert out == greedy_oracle(tiny_models["target"], [9, 10, 11], 12)
    assert be.draft_calls > 0 and sched.totals.verify_calls > 6  # the first rounds were plain (no drafter call)


def test_timed_backend_times_passes_and_reports_failures(ref_backend) -> None:  # noqa: ANN001
    seen: list[tuple[str, bool]] = []
    be = TimedBackend(ref_backend("draft", fail_draft=lambda n: n == 1),
                      observe=lambda name, s, err: seen.append((name, err is not None)))
    res = generate(be, [11, 12], max_new_tokens=8, policy=PolicyConfig(policy="fixed", k=2),
                   config=LoopConfig(gamma=2))
    assert len(res.tokens) == 8 and res.stats.draft_failures == 1
    assert ("draft", True) in seen and ("verify", False) in seen
    assert be.calls["draft"] == sum(1 for n, _ in seen if n == "draft") and be.seconds["verify"] > 0
    assert be.mean_ms("verify") > 0 and be.vocab_size == 512  # everything else passes through
    be.reset()
    assert be.calls == {"draft": 0, "verify": 0}


def test_positions_reach_the_drafter_and_the_acceptance(ref_backend) -> None:  # noqa: ANN001
    """RefBackend asserts positions == committed length in draft(); accept gets the same numbers."""
    be = ref_backend("draft")
    seen: list[list[int]] = []
    accept = be.accept
    be.accept = lambda *a: (seen.append(a[-1].tolist()), accept(*a))[1]  # type: ignore[method-assign]
    generate(be, [11, 12, 13], max_new_tokens=6, sampling=SamplingParams(0.8, seed=3),
             policy=PolicyConfig(policy="fixed", k=2), config=LoopConfig(gamma=2))
    assert seen[0] == [4]  # prompt (3) + the prefill's token: d_1 of the first round sits at position 4
    assert all(b > a for (a,), (b,) in zip(seen, seen[1:]))
