"""DSpark rounds over the tapped target (serve.gpu_host.taps.TapExecutor) in process, over the stand-in engine's
tensorrtllm semantics with TensorRT-LLM's KV-cache-reuse contract (context outputs only for computed rows): the
output equals the reference runtime's RoundScheduler(SpecBackend(target, DSpark drafter)) token for token, greedy and
seeded sampling, for every policy; the drafter drafts from the returned taps; a reuse hole turns a request plain."""
from __future__ import annotations

from typing import Sequence

import pytest
import torch

from dspark_trt.serve.gpu_host.rounds import EngineCall, EngineReply
from dspark_trt.serve.gpu_host.taps import TapExecutor
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
from dspark_trt.spec_decode.sampling import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.testing.trtllm_standin.engine import StandinEngine

GAMMA, MAX_SEQ, MAX_BATCH = 4, 160, 8
PROMPTS = [(5, 6, 7, 8), (10, 11), (3,) * 7, (20, 30, 40), (1, 2), (99, 98, 97, 96, 95), (7, 7, 8), (40, 41, 42)]


@pytest.fixture(scope="module")
def pair(tiny_pair):  # noqa: ANN001, ANN201
    """The tiny target (runtime) and a DSpark drafter for it whose drafts the target often accepts."""
    from transformers import AutoModelForCausalLM

    from dspark_trt.runtime.drafters import DSparkDrafter, DSparkModel, target_weights
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint
    from dspark_trt.train.model_init import new_config

    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    torch.manual_seed(0)
    emb = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).get_input_embeddings().weight
    cfg = new_config(tiny_pair.target, (0, 1), num_layers=1, gamma=GAMMA, markov_rank=8, draft_vocab_size=0,
                     embed_weight=emb)

    def drafter() -> DSparkDrafter:
        torch.manual_seed(1)
        m = DSparkModel(cfg)
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.02)
        m.attach_target(*target_weights(target))
        return DSparkDrafter(m.eval())

    return target, drafter


class Client:
    """EngineClient over a StandinEngine with block reuse (what the Triton stand-in answers)."""

    def __init__(self, target: torch.nn.Module, reuse_block: int) -> None:
        self.engine = StandinEngine(target, MAX_BATCH, MAX_SEQ + GAMMA + 2, reuse_block=reuse_block)
        self.calls: list[EngineCall] = []

    def generate(self, model: str, calls: Sequence[EngineCall]) -> list[EngineReply]:
        assert model == "target"
        self.calls.extend(calls)
        return list(self.engine.run(calls))


def _run(sched: RoundScheduler, reqs: list[Request]) -> dict[int, list[int]]:
    ids = [sched.add(r) for r in reqs]
    out: dict[int, list[int]] = {i: [] for i in ids}
    for _ in range(3000):
        if not sched.pending:
            break
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
    return {k: out[i] for k, i in enumerate(ids)}


def _reqs(policy: str, sampled: bool) -> list[Request]:
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i) if sampled and i % 2 else SamplingParams()
          for i in range(len(PROMPTS))]
    return [Request(tuple(p), 24 + 3 * i, sampling=sp[i], policy=PolicyConfig(policy=policy, k=3, max_k=GAMMA,
                                                                            min_k=1))
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("policy", ["confidence", "fixed", "survival", "plain"])
@pytest.mark.parametrize("sampled", [False, True])
def test_equals_the_reference_runtime(pair, policy: str, sampled: bool) -> None:  # noqa: ANN001
    from dspark_trt.runtime.backend import SpecBackend

    target, drafter = pair
    ref = RoundScheduler(SpecBackend(target, drafter(), MAX_BATCH, MAX_SEQ + GAMMA + 2),
        LoopConfig(gamma=GAMMA, calibrate=False))
    want = _run(ref, _reqs(policy, sampled))
    client = Client(target, reuse_block=4)
    d = drafter()
    proposed = [0]
    inner = d.propose

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        proposed[0] += 1
        return inner(*args, **kwargs)

    d.propose = counting
    ex = TapExecutor(client, d, ("dspark_tap_0", "dspark_tap_1"), MAX_BATCH, MAX_SEQ, int(target.config.vocab_size))
    sched = RoundScheduler(ex, LoopConfig(gamma=GAMMA, calibrate=False))
    got = _run(sched, _reqs(policy, sampled))
    assert got == want
    calls = client.calls
    assert all(c.context_logits and c.taps == ("dspark_tap_0", "dspark_tap_1") and not c.draft_ids for c in calls)
    assert any(m > 0 for m in client.engine.reused)  # KV reuse happened: outputs were the computed suffix only
    assert not ex._holes  # noqa: SLF001 - distinct prompts: reuse never covered a position we needed
    assert (proposed[0] > 0) == (policy != "plain")  # the DSpark drafter drafted from the returned taps


def test_a_reuse_hole_makes_that_request_plain(pair, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """Two identical requests: the second's prompt rows come from the first's cached blocks, so the engine returns
    no features for them; that request decodes plain (still exact), the other drafts."""
    target, drafter = pair
    client = Client(target, reuse_block=2)
    ex = TapExecutor(client, drafter(), ("dspark_tap_0", "dspark_tap_1"), MAX_BATCH, MAX_SEQ,
                     int(target.config.vocab_size))
    sched = RoundScheduler(ex, LoopConfig(gamma=GAMMA, calibrate=False))
    reqs = [Request((5, 6, 7, 8, 9, 10, 11), 20, policy=PolicyConfig(policy="fixed", k=3))]
    first = _run(sched, reqs)
    again = _run(sched, reqs)  # same tokens: every full block is cached now
    assert first == again
    assert "drafts nothing from now on" in caplog.text  # the second request: prompt rows reused, no features
    assert not ex._holes  # noqa: SLF001 - released with its request
    from dspark_trt.runtime.backend import SpecBackend

    ref = RoundScheduler(SpecBackend(target, None, 2, MAX_SEQ + GAMMA + 2), LoopConfig(gamma=GAMMA, calibrate=False))
    assert _run(ref, [Request((5, 6, 7, 8, 9, 10, 11), 20, policy=PolicyConfig(policy="plain"))]) == first
