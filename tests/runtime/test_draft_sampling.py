"""Draft sampling on the one counter-based path (runtime.dispatch → block_draft reference on CPU).

A seeded sampled request gives the same tokens run twice in one process — whatever ran in between — and in a
fresh process (no generator state anywhere), with an LM drafter and with DSpark drafters (Markov head, reduced
draft vocabulary, no Markov head); and speculative sampling through SpecBackend stays exactly the target's
distribution (chi-square on the second generated token, which is verified speculatively); each drafter's
tokens follow the q it reports (chi-square over seeds).
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from scipy import stats as sstats

from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.runtime.model import CausalLM
from dspark_trt.spec_decode.accept import target_probs
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler, generate
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig

PROMPT = [5, 17, 99, 4, 250, 31]
DRAFTERS = {"lm": {}, "dspark": {}, "dspark_d2t": {"draft_vocab": 200}, "dspark_no_markov": {"markov": False}}

# What one run does, in this process and in a fresh one (the subprocess gets the same source).
RUN = '''
import torch
from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.runtime.drafters import load_drafter
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.spec_decode.loop import LoopConfig, generate
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.testing.tiny import tiny_dspark_drafter


def make_backend(target_dir, draft_dir, kind, kw):
    target = load_hf_checkpoint(target_dir, dtype=torch.float32)
    drafter = (load_drafter(draft_dir, target, dtype=torch.float32) if kind == "lm"
               else tiny_dspark_drafter(target, **kw))
    return SpecBackend(target, drafter, max_batch=2, max_seq=96)


def run(backend, seed, top_p=1.0):
    res = generate(backend, PROMPT, 24, SamplingParams(temperature=1.0, top_p=top_p, seed=seed),
                   PolicyConfig(policy="fixed", k=3), config=LoopConfig(gamma=4))
    return res.tokens, res.stats.drafted_tokens
'''
exec(RUN)  # noqa: S102 - defines make_backend / run here exactly as in the fresh process


@pytest.fixture(scope="module")
def target(tiny_pair) -> CausalLM:  # noqa: ANN001
    return load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_seeded_sampling_is_reproducible_in_process_and_across_processes(tiny_pair, kind: str) -> None:  # noqa: ANN001
    be = make_backend(tiny_pair.target, tiny_pair.draft, kind, DRAFTERS[kind])  # noqa: F821 - from RUN
    first, drafted = run(be, 1234)  # noqa: F821
    assert drafted > 0  # the drafter's samples were verified
    run(be, 99, top_p=0.8)  # other requests in between must not matter
    run(be, 5)
    assert run(be, 1234)[0] == first
    assert run(be, 1235)[0] != first
    code = RUN + (f"\nPROMPT = {PROMPT!r}\nbe = make_backend({str(tiny_pair.target)!r}, {str(tiny_pair.draft)!r}, "
                  f"{kind!r}, {DRAFTERS[kind]!r})\nprint(__import__('json').dumps(run(be, 1234)[0]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == first


@torch.no_grad()
def _second_token_marginal(target: CausalLM, prompt: list[int], temp: float, top_p: float) -> torch.Tensor:
    """Σ_x1 p(x1) p(x2 | x1) under the serving distribution (target_probs), float64 [V]."""
    def probs(seqs: torch.Tensor) -> torch.Tensor:  # [N, T] → [N, V]
        out = target(seqs, target.new_cache(seqs.shape[0], seqs.shape[1]), torch.arange(seqs.shape[0]),
                     logits="last").logits[:, -1]
        return target_probs(out, torch.full((seqs.shape[0],), temp), torch.full((seqs.shape[0],), top_p))

    p1 = probs(torch.tensor([prompt]))[0]  # [V]
    v = p1.shape[0]
    seqs = torch.cat([torch.tensor(prompt).expand(v, -1), torch.arange(v).unsqueeze(1)], 1)  # [V, T+1]
    p2 = torch.cat([probs(seqs[i:i + 128]) for i in range(0, v, 128)])  # [V, V]
    return (p1.unsqueeze(1) * p2).sum(0).double()


@pytest.mark.parametrize("kind,temp,top_p", [("lm", 1.5, 1.0), ("dspark", 1.0, 0.9)])
def test_speculative_sampling_through_spec_backend_matches_the_target(tiny_pair, target: CausalLM, kind: str,
                                                                     temp: float, top_p: float) -> None:  # noqa: ANN001
    """x1 from prefill, x2 verified speculatively (K = 1: accepted draft or residual resample; 3 tokens so the
    first round may verify one: K ≤ tokens left − 1)."""
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    prompt, n = [40, 41, 42], 600
    p2 = _second_token_marginal(target, prompt, temp, top_p)
    drafter: Any = (load_drafter(tiny_pair.draft_small, target, dtype=torch.float32) if kind == "lm"
                    else tiny_dspark_drafter(target))  # draft_small: far from the target, so a wrong q shows
    sched = RoundScheduler(SpecBackend(target, drafter, max_batch=8, max_seq=32), LoopConfig(gamma=1))
    out: dict[int, list[int]] = {}
    for s in range(n):
        out[sched.add(Request(tuple(prompt), 3, SamplingParams(temperature=temp, top_p=top_p, seed=s),
                              PolicyConfig(policy="fixed", k=1)))] = []
    while sched.pending:
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    assert sched.totals.draft_calls >= n and sched.totals.accepted_tokens > 0
    counts = torch.bincount(torch.tensor([t[1] for t in out.values()]), minlength=p2.shape[0]).double()
    big = p2 * n >= 8  # pool the rare tokens into one cell
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([p2[big], p2[~big].sum().unsqueeze(0)]) * n
    assert float(counts[p2 == 0].sum()) == 0  # nothing outside the nucleus
    assert sstats.chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_draft_tokens_follow_the_reported_q(tiny_pair, target: CausalLM, kind: str) -> None:  # noqa: ANN001
    """Over seeds, d_1 is distributed as q[:, 0] (q itself is the same for every seed), at T = 1.3, top-p 0.95."""
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    drafter: Any = (load_drafter(tiny_pair.draft, target, dtype=torch.float32) if kind == "lm"
                    else tiny_dspark_drafter(target, **DRAFTERS[kind]))
    be = SpecBackend(target, drafter, max_batch=1, max_seq=32)
    be.prefill([0], [PROMPT])
    anchor, pos, n = torch.tensor([7]), torch.tensor([len(PROMPT) + 1]), 800
    firsts, q0 = [], None
    for seed in range(n):
        blk = be.draft([0], anchor, 1, [SamplingParams(temperature=1.3, top_p=0.95, seed=seed)], pos)
        firsts.append(int(blk.tokens[0, 0]))
        q0 = blk.q[0, 0] if q0 is None else q0
        assert torch.equal(blk.q[0, 0], q0)
    counts = torch.bincount(torch.tensor(firsts), minlength=q0.shape[0]).double()
    assert float(counts[q0 == 0].sum()) == 0
    big = q0.double() * n >= 8
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([q0.double()[big], q0.double()[~big].sum().unsqueeze(0)]) * n
    assert sstats.chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_markov_block_matches_the_f_linear_reference(dtype: torch.dtype) -> None:
    """The CPU path (native Markov-bias product, one-hot q built once for greedy blocks) gives the reference's
    tokens, q and confidences bit for bit (the reference with the same row-invariant bias product: torch's fp32
    GEMM rounds differently on some CPUs) — greedy and sampled rows, reduced draft vocabulary, confidence head."""
    from dspark_trt.kernels.block_draft import reference
    from dspark_trt.runtime import dispatch, native

    if not native.available():
        pytest.skip(f"native kernels unavailable here ({native.unavailable_reason()}); the path under test is theirs")
    g = torch.Generator().manual_seed(7)
    b, gamma, vd, vt, r = 3, 5, 300, 500, 16
    u = torch.randn(b, gamma, vd, generator=g) * 3  # [B, γ, Vd]
    w1 = (torch.randn(vt, r, generator=g) * 0.5).to(dtype)
    w2 = (torch.randn(vd, r, generator=g) * 0.5).to(dtype)
    d2t = torch.randperm(vt, generator=g)[:vd]
    anchor = torch.tensor([3, 77, 410])
    pos = torch.tensor([10, 20, 30])
    conf_bias, w_conf = torch.randn(b, gamma, generator=g), torch.randn(r, generator=g)
    temps = torch.rand(gamma, generator=g) + 0.5
    with torch.no_grad():  # inference: the native greedy block applies only without autograd
        mixed = [SamplingParams(), SamplingParams(0.8, 1.0, 5), SamplingParams(1.2, 0.9, 9)]
        for sampling in ([SamplingParams()] * 3, mixed):
            got = dispatch.markov_block(u, anchor, w1, w2, sampling, pos, d2t=d2t, conf_bias=conf_bias, w_conf=w_conf,
                                        conf_temp=temps)
            t = torch.tensor([s.temperature for s in sampling])
            tp = torch.tensor([s.top_p for s in sampling])
            seeds = torch.tensor([int(s.seed or 0) for s in sampling])
            want = reference.markov_block(u, anchor, w1, w2, t, seeds, pos, tp, d2t=d2t, conf_bias=conf_bias,
                                          w_conf=w_conf, conf_temp=temps, linear=dispatch._native_bias(w2))
            assert torch.equal(got.tokens, want.tokens)
            assert torch.equal(got.q, want.q) and torch.equal(got.conf, want.conf)
            if all(s.greedy for s in sampling):  # a caller that drops q may skip it: same tokens and confidences
                lean = dispatch.markov_block(u, anchor, w1, w2, sampling, pos, d2t=d2t, conf_bias=conf_bias,
                                             w_conf=w_conf, conf_temp=temps, need_q=False)
                assert lean.q is None and torch.equal(lean.tokens, want.tokens) and torch.equal(lean.conf, want.conf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dspark_proposal_does_not_depend_on_the_batch(target: CausalLM, dtype: torch.dtype) -> None:
    """A slot's draft block (tokens, q, confidences) is the same bits proposed alone (no attention mask, a view of
    its context) as in a batch with shorter and longer contexts (masked, gathered) — seeded sampled rows included,
    so sampled answers under load keep their drafts."""
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    drafter = tiny_dspark_drafter(target, gamma=4, draft_vocab=200)
    drafter.model.to(dtype)
    drafter.allocate(3, 64)
    g = torch.Generator().manual_seed(3)
    fsize = drafter.cfg.feature_size
    lens = [11, 5, 17]
    feats = torch.randn(3, max(lens), fsize, generator=g).to(dtype)  # [B, T, F]
    toks = torch.randint(0, drafter.vocab_size, (3, max(lens)), generator=g)
    drafter.extend_context(torch.arange(3), toks, torch.tensor(lens), feats)
    anchors = torch.tensor([7, 8, 9])
    sampling = [SamplingParams(0.9, 1.0, 11), SamplingParams(), SamplingParams(1.1, 1.0, 4)]
    batch = drafter.propose(torch.arange(3), anchors, 4, sampling)
    for r in range(3):
        alone = drafter.propose(torch.tensor([r]), anchors[r:r + 1], 4, sampling[r:r + 1])
        assert torch.equal(alone.tokens[0], batch.tokens[r])
        assert torch.equal(alone.conf[0], batch.conf[r])
        if alone.q is not None:
            assert torch.equal(alone.q[0], batch.q[r])


def test_int8_draft_head_is_the_rounded_head_on_limb_products(target: CausalLM) -> None:
    """In bf16 on the native kernels the draft-vocab head runs as int8 rows (round to nearest, row absmax / 127):
    U equals x · dequantized headᵀ within bf16 rounding, stays close to the bf16 head's U, and int8_head = False
    restores the bf16 head's exact U."""
    from dspark_trt.runtime import native
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    if not (native.available() and native.has_vnni()):
        pytest.skip(f"native kernels with VNNI unavailable here ({native.unavailable_reason() or 'no VNNI'})")
    drafter = tiny_dspark_drafter(target, gamma=4, draft_vocab=200)
    m = drafter.model.to(torch.bfloat16)
    m.attach_target(target.transformer.vocab_embedding.weight.bfloat16(), target.lm_head_weight.bfloat16())
    _, head = m._need_target()  # [Vd, d]
    h = (torch.randn(3, 4, head.shape[1], generator=torch.Generator().manual_seed(2))).bfloat16()  # [B, γ, d]
    with torch.no_grad():
        u8 = m.base_logits(h)  # [B, γ, Vd]
        m.int8_head = False
        u16 = m.base_logits(h)
        m.int8_head = True
    w = head.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    deq = torch.round(w / scale[:, None]).clamp(-127, 127) * scale[:, None]  # [Vd, d]
    ref = h.float() @ deq.T
    torch.testing.assert_close(u8, ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))
    assert not torch.equal(u8, u16)  # the int8 head is what ran
    torch.testing.assert_close(u8, u16, rtol=0.05, atol=0.05 * float(u16.abs().max()))
    assert torch.equal(u16, native.linear(h.reshape(-1, h.shape[-1]), head, out_f32=True).view_as(u16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_context_flush_of_several_slots_equals_each_slot_alone(target: CausalLM, dtype: torch.dtype) -> None:
    """Queued context features of several slots (ragged, several chunks each) projected on the native kernels in one
    fc and one k|v product of every layer (ctx_norm fused, RoPE in native.rope_kv) leave each slot's context KV with
    the bits of that slot flushed alone — a slot's drafts do not depend on which slots flushed with it — and the
    torch flush's values (the fused RMSNorm's sum of squares may round apart from torch's mean)."""
    from dspark_trt.runtime import native
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    if not native.available():
        pytest.skip(f"native kernels unavailable here ({native.unavailable_reason()}); the path under test is theirs")
    drafter = tiny_dspark_drafter(target, gamma=4, draft_vocab=200)
    drafter.model.to(dtype)
    g = torch.Generator().manual_seed(5)
    fsize = drafter.cfg.feature_size
    chunks = {0: [5], 1: [3, 1], 2: [17, 2, 1]}
    queued: dict[int, list[tuple[int, torch.Tensor]]] = {s: [] for s in chunks}
    for s, ns in chunks.items():
        p = 0
        for n in ns:
            queued[s].append((p, (torch.randn(n, fsize, generator=g) * 3).to(dtype)))
            p += n

    def flush(groups: list[list[int]], native_ok: bool = True) -> list[torch.Tensor]:
        drafter.allocate(3, 64)
        drafter._pending = {s: list(c) for s, c in queued.items()}
        for s, ns in chunks.items():
            drafter._len[s] = sum(ns)
        if not native_ok:
            drafter._native_ok = lambda span: False  # type: ignore[method-assign]
            drafter.use_plan = False
        try:
            with torch.inference_mode():
                for slots in groups:
                    drafter._flush(slots)
        finally:
            drafter.__dict__.pop("_native_ok", None)
            drafter.use_plan = True
        assert not drafter._pending
        return [t.clone() for t in drafter._k + drafter._v]

    drafter.allocate(3, 64)
    assert drafter._native_ok(32)  # the native flush is what runs below
    together = flush([[0, 1, 2]])
    for a, b in zip(together, flush([[2], [0], [1]])):
        assert torch.equal(a, b)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # one rounding of the model dtype
    for a, b in zip(together, flush([[0, 1, 2]], native_ok=False)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert all(bool(t[s, :, :sum(ns)].abs().sum() > 0) for t in together for s, ns in chunks.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bound_draft_plan_gives_the_unbound_paths_bits_and_follows_the_weights(target: CausalLM,
                                                                                dtype: torch.dtype) -> None:
    """The drafter's greedy pass with its products bound once (native_plan.DraftPlan: one C++ call per product, no
    per-call dispatch) gives the unbound path's tokens and confidences bit for bit — rows of different context
    lengths in one batch, the int8 and the param-dtype head — and rebinds when a weight changes in place or the head's
    precision is switched (the drafts then follow the new weights); a block of γ' < γ tokens, whose head runs on γ'
    rows only, is the prefix of the full one."""
    from dspark_trt.runtime import native
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    if not native.available():
        pytest.skip(f"native kernels unavailable here ({native.unavailable_reason()}); the path under test is theirs")
    drafter = tiny_dspark_drafter(target, gamma=4, draft_vocab=200)
    m = drafter.model.to(dtype)
    m.attach_target(target.transformer.vocab_embedding.weight.to(dtype), target.lm_head_weight.to(dtype))
    g = torch.Generator().manual_seed(8)
    lens = [9, 3, 14]

    def proposals() -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for bound in (True, False):
            drafter.use_plan = bound
            drafter.allocate(3, 64)
            drafter.extend_context(torch.arange(3), toks, torch.tensor(lens), feats)
            blk = drafter.propose(torch.arange(3), torch.tensor([7, 8, 9]), 4, [SamplingParams()] * 3)
            assert (drafter.draft_plan() is not None) == bound  # bound: the plan is what ran
            out.append((blk.tokens, blk.conf))
        drafter.use_plan = True
        return out

    feats = (torch.randn(3, max(lens), drafter.cfg.feature_size, generator=g) * 2).to(dtype)
    toks = torch.randint(0, drafter.vocab_size, (3, max(lens)), generator=g)
    with torch.no_grad():  # a head that spreads its logits, so the drafts depend on the weights
        m.markov_w2.weight.normal_(0, 0.5, generator=g)
    seen = []
    for int8 in (True, False):
        m.int8_head = int8
        (bt, bc), (ut, uc) = proposals()
        assert torch.equal(bt, ut) and torch.equal(bc, uc)
        seen.append(bt)
    with torch.no_grad():
        m.layers[0].o_proj.weight.mul_(-3.0)
        m.markov_w2.weight.mul_(-1.0)
    (bt, bc), (ut, uc) = proposals()
    assert torch.equal(bt, ut) and torch.equal(bc, uc)
    assert not torch.equal(bt, seen[-1])  # the plan was rebound: the changed weights are what ran
    short = drafter.propose(torch.arange(3), torch.tensor([7, 8, 9]), 2, [SamplingParams()] * 3)  # γ' = 2 of 4
    assert torch.equal(short.tokens, bt[:, :2]) and torch.equal(short.conf, bc[:, :2])  # the head ran on 2 rows
