"""The GPU-host round loop (serve.gpu_host.rounds) over the stand-in engine semantics, in process: greedy output equals
plain greedy decoding for every policy, stop conditions, queueing, cancel, drafter failure; the verify-reply
interpretation; the stand-in's TensorRT-LLM semantics; the BLS tensors; the stand-in config rewrite."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch

from dspark_trt.errors import InvalidArgumentError, ServeError
from dspark_trt.serve.gpu_host.bls import INPUT_DTYPES, call_tensors, reply_from_arrays
from dspark_trt.serve.gpu_host.rounds import EngineCall, EngineReply, TrtllmRoundScheduler, verify_outcome
from dspark_trt.spec_decode.loop import LoopConfig, Request
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.spec_decode.sampling import SamplingParams
from dspark_trt.testing.trtllm_standin import install_standin, standin_config
from dspark_trt.testing.trtllm_standin.engine import StandinEngine

GAMMA, MAX_SEQ = 4, 200
PROMPTS = [(5, 6, 7, 8), (10, 11), (3,) * 7, (20, 30, 40), (1, 2), (99, 98, 97, 96, 95)]
POLICIES = ["confidence", "fixed", "survival", "plain"]


@pytest.fixture(scope="module")
def models(tiny_pair):  # noqa: ANN001, ANN201
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint

    return (load_hf_checkpoint(tiny_pair.target, dtype=torch.float32),
            load_hf_checkpoint(tiny_pair.draft, dtype=torch.float32))


class Client:
    """EngineClient over StandinEngines (what the Triton stand-in answers), with optional injected draft failures."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, max_batch: int = 8) -> None:
        self.engines = {"target": StandinEngine(target, max_batch, MAX_SEQ + GAMMA + 2),
                        "draft": StandinEngine(draft, max_batch, MAX_SEQ + GAMMA + 2)}
        self.calls: dict[str, list[EngineCall]] = {"target": [], "draft": []}
        self.fail_draft = 0

    def generate(self, model: str, calls: Sequence[EngineCall]) -> list[EngineReply]:
        self.calls[model].extend(calls)
        if model == "draft" and self.fail_draft:
            self.fail_draft -= 1
            raise RuntimeError("injected draft failure")
        return list(self.engines[model].run(calls))


def _run(sched: TrtllmRoundScheduler, reqs: list[Request]) -> dict[int, tuple[list[int], str | None]]:
    ids = [sched.add(r) for r in reqs]
    out: dict[int, list[int]] = {i: [] for i in ids}
    reasons: dict[int, str | None] = {}
    for _ in range(2000):
        if not sched.pending:
            break
        for ev in sched.step():
            out[ev.request_id].extend(ev.new_tokens)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
    assert not sched.pending
    return {i: (out[i], reasons.get(i)) for i in ids}


def _greedy(model: torch.nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    from dspark_trt.runtime.model import greedy_decode

    return greedy_decode(model, list(prompt), n)


def test_verify_outcome() -> None:
    assert verify_outcome([5, 6, 7], [5, 6, 9]) == (2, [5, 6, 9])  # recovered at the first mismatch
    assert verify_outcome([5, 6], [5, 6, 1]) == (2, [5, 6, 1])  # all accepted + bonus
    assert verify_outcome([], [4]) == (0, [4])  # a plain step
    assert verify_outcome([5, 6], [1]) == (0, [1])
    assert verify_outcome([5, 6], [5, 6]) == (1, [5, 6])  # no bonus returned: the last token counts as the target's
    assert verify_outcome([5], [5, 8, 9]) == (1, [5, 8])  # never more than K + 1 tokens
    with pytest.raises(ServeError, match="no tokens"):
        verify_outcome([1], [])


@pytest.mark.parametrize("max_batch", [8, 2])
def test_greedy_equals_plain_decoding_every_policy(models, max_batch: int) -> None:  # noqa: ANN001
    target, draft = models
    client = Client(target, draft, max_batch)
    sched = TrtllmRoundScheduler(client,
        LoopConfig(gamma=GAMMA, calibrate=False), max_batch, MAX_SEQ, target.config.vocab_size)
    reqs = [Request(p, 25 + 3 * i, policy=PolicyConfig(policy=POLICIES[i % 4], k=GAMMA, min_k=1, max_k=GAMMA))
            for i, p in enumerate(PROMPTS)]
    got = _run(sched, reqs)
    for (tokens, reason), req in zip(got.values(), reqs):
        assert tokens == _greedy(target, req.prompt_ids, req.max_new_tokens)
        assert reason == "length"
    verifies = client.calls["target"]
    assert any(c.draft_ids for c in verifies), "nothing was speculated"
    assert all(c.output_len == len(c.draft_ids) + 1 for c in verifies if c.draft_ids)  # BLS rule: K + 1
    assert all(len(c.draft_ids) <= GAMMA for c in verifies)
    assert max(client.engines["target"].batches) == min(max_batch, len(PROMPTS))  # one fan-out = one batch
    conf_calls = [c for c in verifies if c.return_logits]
    assert conf_calls, "confidence-policy rows ask for generation logits"
    assert sched.totals.accepted_tokens > 0 and sched.totals.drafted_tokens >= sched.totals.accepted_tokens


def test_stops_eos_and_stop_sequences(models) -> None:  # noqa: ANN001
    target, draft = models
    ref = _greedy(target, PROMPTS[0], 30)
    sched = TrtllmRoundScheduler(Client(target, draft),
        LoopConfig(gamma=GAMMA, calibrate=False), 8, MAX_SEQ, target.config.vocab_size)
    got = _run(sched, [Request(PROMPTS[0], 30, eos_ids=(ref[9],), policy=PolicyConfig(policy="fixed", k=GAMMA)),
                       Request(PROMPTS[0], 30, stop_sequences=(tuple(ref[12:14]),),
                               policy=PolicyConfig(policy="fixed", k=GAMMA))])
    (a, ra), (b, rb) = got.values()
    assert a == ref[: ref.index(ref[9]) + 1] and ra == "eos"
    assert b == ref[:14] and rb == "stop"


def test_cancel_and_draft_failure_fallback(models) -> None:  # noqa: ANN001
    target, draft = models
    client = Client(target, draft)
    client.fail_draft = 2
    sched = TrtllmRoundScheduler(client, LoopConfig(gamma=GAMMA, calibrate=False), 8, MAX_SEQ, target.config.vocab_size)
    rid = sched.add(Request(PROMPTS[1], 40, policy=PolicyConfig(policy="fixed", k=GAMMA)))
    keep = sched.add(Request(PROMPTS[2], 20, policy=PolicyConfig(policy="fixed", k=GAMMA)))
    out: list[int] = []
    for ev in sched.step():
        if ev.request_id == keep:
            out.extend(ev.new_tokens)
    assert sched.cancel(rid) and not sched.cancel(rid)
    while sched.pending:
        for ev in sched.step():
            out.extend(ev.new_tokens)
    assert out == _greedy(target, PROMPTS[2], 20)
    assert sched.totals.draft_failures >= 1


def test_engine_error_raises(models) -> None:  # noqa: ANN001
    target, draft = models

    class Broken(Client):
        def generate(self, model: str, calls: Sequence[EngineCall]) -> list[EngineReply]:
            if model == "target" and any(c.draft_ids or c.output_len > 1 for c in calls):
                return [EngineReply([], error="boom")] * len(calls)
            return super().generate(model, calls)

    sched = TrtllmRoundScheduler(Broken(target, draft),
        LoopConfig(gamma=GAMMA, calibrate=False), 8, MAX_SEQ, target.config.vocab_size)
    sched.add(Request(PROMPTS[0], 10, policy=PolicyConfig(policy="fixed", k=GAMMA)))
    with pytest.raises(ServeError, match="boom"):
        sched.step()
    with pytest.raises(InvalidArgumentError, match="max_seq"):
        sched.add(Request(PROMPTS[0], MAX_SEQ))


def test_sampled_requests_go_to_the_engine_sampler(models) -> None:  # noqa: ANN001
    target, draft = models
    client = Client(target, draft)
    sched = TrtllmRoundScheduler(client, LoopConfig(gamma=GAMMA, calibrate=False), 8, MAX_SEQ, target.config.vocab_size)
    req = Request(PROMPTS[3], 20, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7),
                  policy=PolicyConfig(policy="fixed", k=GAMMA))
    a = _run(sched, [req])
    b = _run(TrtllmRoundScheduler(Client(target, draft), LoopConfig(gamma=GAMMA, calibrate=False), 8, MAX_SEQ,
                                  target.config.vocab_size), [req])
    assert list(a.values())[0][0] == list(b.values())[0][0]  # the stand-in's sampler is seeded by position
    assert all(c.temperature == pytest.approx(0.8) and c.seed == 7 for c in client.calls["target"])
    assert all(c.temperature == 0.0 for c in client.calls["draft"])  # drafts stay greedy


def test_standin_engine_semantics(models) -> None:  # noqa: ANN001
    target, _ = models
    eng = StandinEngine(target, 4, 64)
    prompt = (5, 6, 7, 8)
    ref = _greedy(target, prompt, 6)
    plain, verify_good, verify_bad, short = eng.run([
        EngineCall(prompt, 3, return_logits=True),
        EngineCall(prompt, 4, tuple(ref[:3])),  # all 3 accepted → + bonus
        EngineCall(prompt, 4, (ref[0], (ref[1] + 1) % 512, ref[2])),  # mismatch at d_2 → recovered
        EngineCall(prompt, 2, tuple(ref[:3]))])  # truncated to request_output_len
    assert plain.tokens == ref[:3] and plain.logits is not None and plain.logits.shape == (3, target.config.vocab_size)
    assert int(np.argmax(plain.logits[0])) == ref[0]
    assert verify_good.tokens == ref[:4] and verify_good.steps == [4]
    assert verify_bad.tokens == ref[:2] and verify_bad.steps == [2]
    assert short.tokens == ref[:2]
    assert eng.batches == [4]
    (bad,) = eng.run([EngineCall((), 1)])
    assert bad.error and "input_ids" in bad.error


def test_bls_tensors() -> None:
    t = call_tensors(EngineCall((1, 2, 3), 3, (4, 5), 0.7, 0.9, 11, True, "r"))
    assert set(t) <= set(INPUT_DTYPES)
    assert t["input_ids"].shape == (1, 3) and t["draft_input_ids"].shape == (1, 2)
    for name, arr in t.items():
        assert arr.dtype == INPUT_DTYPES[name], name
        assert arr.ndim == 2 and arr.shape[0] == 1, name
    assert int(t["request_output_len"][0, 0]) == 3 and bool(t["exclude_input_in_output"][0, 0])
    plain = call_tensors(EngineCall((1,), 1))
    assert "draft_input_ids" not in plain and "temperature" not in plain
    assert not bool(plain["return_generation_logits"][0, 0])  # always sent, as tensorrtllm_backend's BLS does
    rep = reply_from_arrays(np.array([[[7, 8, 9, 0]]], dtype=np.int32), np.array([[3]], dtype=np.int32),
                            np.ones((1, 1, 4, 5), dtype=np.float32))
    assert rep.tokens == [7, 8, 9] and rep.logits is not None and rep.logits.shape == (3, 5)


def test_standin_config_rewrite(tmp_path: Path) -> None:
    from dspark_trt.builder.model_repo import TRTLLM_TEMPLATE_DIR

    text = (TRTLLM_TEMPLATE_DIR / "target" / "config.pbtxt").read_text().replace("${BUILD_DIR}", "/b/x")
    out = standin_config(text, "target")
    assert 'backend: "python"' in out and "tensorrtllm\"" not in out.split("STAND-IN")[1].split("\n", 2)[2]
    assert 'key: "STANDIN_BUILD_DIR" value: { string_value: "/b/x" }' in out
    body = lambda s: [ln for ln in s.splitlines() if "name:" in ln]  # noqa: E731 - every tensor declaration kept
    assert body(out) == body(text)
    with pytest.raises(InvalidArgumentError, match="not a tensorrtllm model"):
        standin_config(out, "target")
    with pytest.raises(InvalidArgumentError, match="no target"):
        install_standin(tmp_path)
