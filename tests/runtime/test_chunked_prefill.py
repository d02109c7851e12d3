"""Chunked prefill (LoopConfig.prefill_chunk, SpecBackend.prefill offsets) on real tiny checkpoints: a prompt
prefilled in chunks leaves the same logits, target cache and drafter context as one pass, bit for bit; under a
per-step budget the generating requests keep their rounds while a long prompt is prefilled, and every answer equals
the target's own greedy decoding; cancel and wrong offsets behave."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.runtime.drafters import DSparkConfig, DSparkDrafter, DSparkModel
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.runtime.model import CausalLM, greedy_decode
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig

LONG = [5, 17, 99, 200, 3, 41, 7, 300, 12, 8, 9, 10, 11, 77, 123, 45, 6, 250, 19]  # 19 tokens


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def target(tiny_pair, request) -> CausalLM:  # noqa: ANN001
    return load_hf_checkpoint(tiny_pair.target, dtype=request.param)


def _dspark(target: CausalLM) -> DSparkDrafter:
    c = target.config
    cfg = DSparkConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=c.vocab_size, target_layer_ids=(0, 1),
                       num_target_layers=c.num_layers, mask_token_id=3, num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    model = DSparkModel(cfg).to(target.embed_tokens.weight.dtype)
    model.attach_target(target.embed_tokens.weight, target.lm_head_weight)
    return DSparkDrafter(model)


def _cache_rows(be: SpecBackend, slot: int, n: int) -> list[torch.Tensor]:
    ks, vs = be.cache.layer_views()
    return [t[slot, :, :n].clone() for t in (*ks, *vs)]  # each [Hkv, n, D]


def test_chunks_equal_one_pass_bit_for_bit(target: CausalLM) -> None:
    whole = SpecBackend(target, _dspark(target), max_batch=2, max_seq=64)
    chunked = SpecBackend(target, _dspark(target), max_batch=2, max_seq=64)
    ref = whole.prefill([1], [LONG])  # [1, V]
    got = None
    for a, b in ((0, 7), (7, 8), (8, 15), (15, len(LONG))):  # uneven chunks, a 1-token one among them
        got = chunked.prefill([1], [LONG[a:b]], offsets=[a])
    assert got is not None and torch.equal(got, ref)
    assert int(chunked.cache.lengths[1]) == len(LONG)
    for x, y in zip(_cache_rows(chunked, 1, len(LONG)), _cache_rows(whole, 1, len(LONG))):
        assert torch.equal(x, y)
    anchor = torch.tensor([int(ref.argmax())])
    sp = [SamplingParams()]
    pos = torch.tensor([len(LONG) + 1])
    d_whole = whole.draft([1], anchor, 4, sp, pos)
    d_chunk = chunked.draft([1], anchor, 4, sp, pos)  # the drafter's context came in four pieces
    assert torch.equal(d_whole.tokens, d_chunk.tokens)
    assert d_whole.conf is None or torch.equal(d_whole.conf, d_chunk.conf)


def test_a_chunk_must_continue_its_slot(target: CausalLM) -> None:
    be = SpecBackend(target, None, max_batch=2, max_seq=64)
    be.prefill([0], [LONG[:5]])
    with pytest.raises(InvalidArgumentError, match="holds 5 tokens"):
        be.prefill([0], [LONG[6:9]], offsets=[6])
    with pytest.raises(InvalidArgumentError, match="offsets"):
        be.prefill([0, 1], [LONG[5:9], LONG[:2]], offsets=[5])
    be.prefill([0], [LONG[5:9]], offsets=[5])  # the right continuation is taken
    assert int(be.cache.lengths[0]) == 9


@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_budgeted_rounds_are_lossless_and_keep_decoding(target: CausalLM, chunk: int) -> None:
    """Two slots, a long prompt arriving while a short one generates: with a budget, the short request keeps getting
    tokens every step while the long prompt is prefilled; every answer = the target's greedy decoding."""
    be = SpecBackend(target, _dspark(target), max_batch=2, max_seq=96)
    sched = RoundScheduler(be, LoopConfig(gamma=4, prefill_chunk=chunk, calibrate=False))
    prompts = {"short": [300, 12], "long": LONG, "mid": LONG[:11], "one": [42]}
    news = {"short": 20, "long": 9, "mid": 12, "one": 6}
    pols = {"short": PolicyConfig(policy="fixed", k=3), "long": PolicyConfig(policy="survival"),
            "mid": PolicyConfig(policy="confidence"), "one": PolicyConfig(policy="plain")}
    rid = {"short": sched.add(Request(tuple(prompts["short"]), news["short"], policy=pols["short"]))}
    out: dict[int, list[int]] = {}
    steps, short_during_long = 0, 0
    while sched.pending:
        if steps == 1:  # the short request is generating: the others arrive
            for name in ("long", "mid", "one"):
                rid[name] = sched.add(Request(tuple(prompts[name]), news[name], policy=pols[name]))
        events = {ev.request_id: ev for ev in sched.step()}
        for r, ev in events.items():
            out.setdefault(r, []).extend(ev.new_tokens)
        if "long" in rid and rid["long"] not in out and events.get(rid["short"]) is not None \
                and events[rid["short"]].new_tokens:
            short_during_long += 1
        assert sched.active <= 2
        steps += 1
        assert steps < 400
    for name, r in rid.items():
        assert out[r] == greedy_decode(target, prompts[name], news[name]), name
    if chunk < len(LONG):
        assert short_during_long >= 2  # the long prompt took several steps, and the short one kept decoding


def test_cancel_while_prefilling_frees_the_slot(target: CausalLM) -> None:
    be = SpecBackend(target, None, max_batch=1, max_seq=64)
    sched = RoundScheduler(be, LoopConfig(gamma=0, prefill_chunk=4))
    a = sched.add(Request(tuple(LONG), 4))
    sched.step()  # 4 of 19 prompt tokens in
    assert sched.active == 1
    assert sched.cancel(a)
    assert sched.active == 0 and sched.pending == 0
    b = sched.add(Request((300, 12), 5))
    out: list[int] = []
    while sched.pending:
        out += [t for ev in sched.step() if ev.request_id == b for t in ev.new_tokens]
    assert out == greedy_decode(target, [300, 12], 5)
