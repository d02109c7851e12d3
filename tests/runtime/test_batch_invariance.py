"""Batch invariance of the runtime: a request's logits, taps and greedy tokens are bit-identical whatever else is
in the batch, whichever K it verifies, and whether its prompt was prefilled alone or together with others.

Property tests (hypothesis) on the tiny checkpoints, in bf16 and fp32, on every kernel path the runtime has
(the native row-invariant kernels when they build here, and the pure-torch fixed-tile path), a loop-level property
(RoundScheduler output per request at batch 1 == batched with other requests under other policies / K), and one
`slow` test on the default target in bf16.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dspark_trt.runtime import ops
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.runtime.model import CausalLM, greedy_decode

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TAPS = (0, 1)
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # a failing case is reported as drawn (shrinking is slow)
HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
PROPS = settings(max_examples=25, deadline=None, derandomize=True, phases=NO_SHRINK, suppress_health_check=HEALTH)


def kernel_paths() -> list[str]:
    """Kernel paths to test: "torch" always, and "native-<engine>" for every native engine this machine runs
    (amx / avx512 / avx2: the AVX2 engine runs on every x86-64-v3 CPU, so it is tested everywhere)."""
    from dspark_trt.runtime import native

    return ["torch"] + [f"native-{e}" for e in native.runnable_engines()]


@pytest.fixture(params=kernel_paths())
def kernels(request) -> Iterator[str]:  # noqa: ANN001
    """Run the test with the runtime forced onto one kernel path (and native engine)."""
    from dspark_trt.runtime import native

    path, _, eng = request.param.partition("-")
    with ops.kernel_path(path), (native.use_engine(eng) if eng else contextlib.nullcontext()):
        yield request.param


_MODELS: dict[tuple[str, str], CausalLM] = {}


def _model(path: Path, dname: str) -> CausalLM:
    key = (str(path), dname)
    if key not in _MODELS:
        _MODELS[key] = load_hf_checkpoint(path, dtype=DTYPES[dname])
    return _MODELS[key]


@dataclass
class Req:
    prompt: list[int]
    blocks: list[list[int]]  # per round: [anchor, d_1..d_K] verified that round
    keeps: list[int]  # per round: tokens kept (1..K+1) before the next round


@st.composite
def requests(draw, vocab: int, max_n: int = 16, max_prompt: int = 48, max_k: int = 7, rounds: int = 2) -> list[Req]:  # noqa: ANN001
    n = draw(st.integers(2, max_n))
    tok = st.integers(0, vocab - 1)
    out = []
    for _ in range(n):
        prompt = draw(st.lists(tok, min_size=1, max_size=max_prompt))
        blocks, keeps = [], []
        for _ in range(rounds):
            k = draw(st.integers(0, max_k))
            blocks.append(draw(st.lists(tok, min_size=k + 1, max_size=k + 1)))
            keeps.append(draw(st.integers(1, k + 1)))
        out.append(Req(prompt, blocks, keeps))
    return out


@dataclass
class Trace:
    prefill: torch.Tensor  # [V] logits at the prompt's last token
    prefill_taps: torch.Tensor  # [P, F] taps over the prompt
    verify: list[torch.Tensor]  # per round [K+1, V]
    verify_taps: list[torch.Tensor]  # per round [K+1, F]


def _alone(model: CausalLM, r: Req, stepwise: bool) -> Trace:
    """The request by itself in slot 0 of its own cache; verify blocks in one forward, or token by token."""
    cache = model.new_cache(1, 160)
    out = model(torch.tensor([r.prompt]), cache, [0], taps=TAPS, logits="last")
    tr = Trace(out.logits[0, 0], out.hidden[0], [], [])
    for block, keep in zip(r.blocks, r.keeps):
        start = int(cache.lengths[0])
        if stepwise:  # decode steps: one token per forward
            steps = [model(torch.tensor([[t]]), cache, [0], taps=TAPS) for t in block]
            tr.verify.append(torch.cat([s.logits[0] for s in steps]))
            tr.verify_taps.append(torch.cat([s.hidden[0] for s in steps]))
        else:
            o = model(torch.tensor([block]), cache, [0], taps=TAPS)
            tr.verify.append(o.logits[0])
            tr.verify_taps.append(o.hidden[0])
        cache.truncate([0], [start + keep])
    return tr


def _together(model: CausalLM, reqs: list[Req], seed: int, packed: bool = True) -> list[Trace]:
    """All requests in one cache at shuffled slots: one right-padded prefill, then one padded verify per round —
    with each row's own length (`row_lengths`, as SpecBackend.verify passes: the native path packs the rows and
    computes no padding) when `packed`, else every row computed to the batch's longest block."""
    rng = random.Random(seed)
    slots = list(range(len(reqs) + 3))
    rng.shuffle(slots)
    slots = slots[:len(reqs)]
    cache = model.new_cache(len(reqs) + 3, 160)
    P = max(len(r.prompt) for r in reqs)
    ids = torch.tensor([r.prompt + [rng.randrange(model.config.vocab_size) for _ in range(P - len(r.prompt))]
                        for r in reqs])  # [B, P] right-padded with junk
    n = torch.tensor([len(r.prompt) for r in reqs])
    out = model(ids, cache, slots, taps=TAPS, logits="last", last_index=n - 1)
    cache.truncate(slots, n)
    traces = [Trace(out.logits[i, 0], out.hidden[i, :len(r.prompt)], [], []) for i, r in enumerate(reqs)]
    for rnd in range(len(reqs[0].blocks)):
        W = max(len(r.blocks[rnd]) for r in reqs)
        toks = torch.tensor([r.blocks[rnd] + [rng.randrange(model.config.vocab_size)
                                              for _ in range(W - len(r.blocks[rnd]))] for r in reqs])  # [B, Kmax+1]
        start = cache.lengths[slots].clone()
        widths = torch.tensor([len(r.blocks[rnd]) for r in reqs])  # [B]
        o = model(toks, cache, slots, taps=TAPS, row_lengths=widths if packed else None)
        for i, r in enumerate(reqs):
            w = len(r.blocks[rnd])
            traces[i].verify.append(o.logits[i, :w])
            traces[i].verify_taps.append(o.hidden[i, :w])
        cache.truncate(slots, start + torch.tensor([r.keeps[rnd] for r in reqs]))
    return traces


def _assert_same(a: Trace, b: Trace, what: str) -> None:
    assert torch.equal(a.prefill, b.prefill), f"{what}: prefill logits differ"
    assert torch.equal(a.prefill_taps, b.prefill_taps), f"{what}: prefill taps differ"
    for rnd, (x, y) in enumerate(zip(a.verify, b.verify)):
        assert torch.equal(x, y), f"{what}: round {rnd} logits differ (max |Δ| {float((x - y).abs().max()):.3g})"
    for rnd, (x, y) in enumerate(zip(a.verify_taps, b.verify_taps)):
        assert torch.equal(x, y), f"{what}: round {rnd} taps differ"


@pytest.mark.parametrize("dname", list(DTYPES))
@PROPS
@given(data=st.data())
def test_batched_equals_alone_equals_stepwise(tiny_pair, kernels: str, dname: str, data) -> None:  # noqa: ANN001
    """Prefill alone == prefill together; a K+1 block verified inside a batch of 2–16 requests (other lengths,
    other K, junk padding, shuffled slots; the rows packed to their own lengths or all computed to the longest)
    == the same block verified alone == decoding it token by token."""
    model = _model(tiny_pair.target, dname)
    reqs = data.draw(requests(model.config.vocab_size))
    together = _together(model, reqs, seed=data.draw(st.integers(0, 2 ** 16)), packed=data.draw(st.booleans()))
    for i, r in enumerate(reqs):
        _assert_same(_alone(model, r, stepwise=False), together[i], f"request {i} alone vs batched")
        _assert_same(_alone(model, r, stepwise=True), together[i], f"request {i} stepwise vs batched")


@pytest.mark.parametrize("dname", list(DTYPES))
@settings(max_examples=10, deadline=None, derandomize=True, phases=NO_SHRINK, suppress_health_check=HEALTH)
@given(data=st.data())
def test_qwen2_bias_and_tied_head_batch_invariant(tiny_pair, kernels: str, dname: str, data) -> None:  # noqa: ANN001
    """The Qwen2 checkpoint (qkv bias, tied lm_head) keeps the property too."""
    model = _model(tiny_pair.qwen2, dname)
    reqs = data.draw(requests(model.config.vocab_size, max_n=6, max_prompt=40, rounds=1))
    together = _together(model, reqs, seed=1)
    for i, r in enumerate(reqs):
        _assert_same(_alone(model, r, stepwise=True), together[i], f"request {i}")


QUANTS = ["W8A16", "W8A8_SQ_PER_CHANNEL", "FP8"]
_QMODELS: dict[tuple[str, str], CausalLM] = {}


@pytest.mark.parametrize("algo", QUANTS)
@pytest.mark.parametrize("dname", list(DTYPES))
@settings(max_examples=6, deadline=None, derandomize=True, phases=NO_SHRINK, suppress_health_check=HEALTH)
@given(data=st.data())
def test_quantized_batch_invariant(tiny_pair, kernels: str, dname: str, algo: str, data) -> None:  # noqa: ANN001
    """W8A16, INT8-SQ and FP8 projections (round-to-nearest quantized tiny target) keep the property."""
    from dspark_trt.testing.quantize import rtn_quantize

    key = (dname, algo)
    if key not in _QMODELS:
        _QMODELS[key] = rtn_quantize(_model(tiny_pair.target, dname), algo)
    model = _QMODELS[key]
    reqs = data.draw(requests(model.config.vocab_size, max_n=8, max_prompt=40, rounds=1))
    together = _together(model, reqs, seed=3)
    for i, r in enumerate(reqs):
        _assert_same(_alone(model, r, stepwise=True), together[i], f"{algo} request {i}")


def test_long_prompt_alone_vs_batched_with_short_ones(tiny_pair, kernels: str) -> None:
    """A 100-token prompt (the long-prompt attention path) beside 1..40-token prompts, in both dtypes."""
    for dname in DTYPES:
        model = _model(tiny_pair.target, dname)
        g = torch.Generator().manual_seed(3)
        lens = [100, 1, 7, 33, 40, 64]
        reqs = [Req(torch.randint(0, 512, (n,), generator=g).tolist(), [[5, 6, 7]], [2]) for n in lens]
        together = _together(model, reqs, seed=2)
        for i, r in enumerate(reqs):
            _assert_same(_alone(model, r, stepwise=False), together[i], f"{dname} prompt of {lens[i]}")


# ---------------------------------------------------------------------------------------------------- loop level
def _run_batched(target: CausalLM, drafter_factory, reqs: list, max_batch: int) -> dict[int, list[int]]:  # noqa: ANN001
    from dspark_trt.runtime.backend import SpecBackend
    from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler

    be = SpecBackend(target, drafter_factory(), max_batch=max_batch, max_seq=96)
    sched = RoundScheduler(be, LoopConfig(gamma=4, calibrate=False))
    ids = [sched.add(r) for r in reqs]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    return {k: out[i] for k, i in enumerate(ids)}


def _lm_drafter_factory(tiny_pair, target: CausalLM):  # noqa: ANN001, ANN202
    """A fresh LMDrafter (γ = 4) per backend over one shared loaded draft model in the target's dtype."""
    from dspark_trt.runtime.drafters.lm import LMDrafter

    draft = _model(tiny_pair.draft, "bf16" if target.dtype == torch.bfloat16 else "fp32")
    return lambda: LMDrafter(draft, gamma=4)


POLICIES = st.sampled_from([("plain", 0), ("fixed", 1), ("fixed", 3), ("fixed", 4), ("confidence", 2),
                            ("survival", 4)])


@settings(max_examples=8, deadline=None, derandomize=True, phases=NO_SHRINK, suppress_health_check=HEALTH)
@given(data=st.data())
def test_round_scheduler_output_is_batch_invariant(tiny_pair, kernels: str, data) -> None:  # noqa: ANN001
    """bf16 tiny target + LM drafter: each request's greedy output from one RoundScheduler holding 2–6 requests with
    other policies / K equals its output run alone at batch 1, and plain greedy decoding of the target."""
    from dspark_trt.spec_decode.loop import Request
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    target = _model(tiny_pair.target, "bf16")
    vocab = target.config.vocab_size
    n = data.draw(st.integers(2, 6))
    reqs = []
    for _ in range(n):
        prompt = tuple(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40)))
        pol, k = data.draw(POLICIES)
        cfg = PolicyConfig(policy=pol, k=k, min_k=1, max_k=4) if pol != "plain" else PolicyConfig(policy="plain")
        reqs.append(Request(prompt, max_new_tokens=data.draw(st.integers(1, 16)), policy=cfg))
    factory = _lm_drafter_factory(tiny_pair, target)
    batched = _run_batched(target, factory, reqs, max_batch=n)
    for i, r in enumerate(reqs):
        alone = _run_batched(target, factory, [r], max_batch=1)[0]
        assert batched[i] == alone, f"request {i} ({r.policy.policy}): batched output differs from batch 1"
        assert alone == greedy_decode(target, list(r.prompt_ids), r.max_new_tokens), f"request {i}: not greedy"


# ---------------------------------------------------------------------------------------------------- default target
@pytest.mark.slow
def test_default_target_bf16_batch_invariant(default_target_dir: Path) -> None:
    """SmolLM2-135M bf16: six requests of different lengths (1..90 tokens) and K (0..7), two rounds, batched vs
    alone vs token by token: bit-identical logits and taps."""
    model = load_hf_checkpoint(default_target_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    lens, ks = [1, 9, 30, 33, 64, 90], [[0, 7], [3, 1], [7, 7], [1, 0], [5, 2], [2, 6]]
    reqs = [Req(torch.randint(0, V, (n,), generator=g).tolist(),
                [torch.randint(0, V, (k + 1,), generator=g).tolist() for k in kk], [kk[0] + 1, 1])
            for n, kk in zip(lens, ks)]
    together = _together(model, reqs, seed=0)
    for i, r in enumerate(reqs):
        _assert_same(_alone(model, r, stepwise=False), together[i], f"request {i} alone vs batched")
        _assert_same(_alone(model, r, stepwise=True), together[i], f"request {i} stepwise vs batched")

