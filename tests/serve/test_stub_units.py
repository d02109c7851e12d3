"""The serving pieces between the wire and the round loop, without a server: the `dspark` stub's validation at its
edge (errors as Triton INVALID_ARG responses), its `stop` entry point, the final response's finish_reason tensor,
the templates declaring it, the clients reading it, and the OpenAI frontend's validation (the same checks, mapped
to 400 with param and code). pb_utils is a small fake; the real server paths are the `triton`-marked files here."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dspark_trt.builder.model_repo import TEMPLATE_DIR
from dspark_trt.errors import RequestError
from dspark_trt.serve.build_loader import LoadedBackend
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.triton.dspark import DsparkModel
from dspark_trt.serve.triton.responder import Responder, TritonSink

CFG = ServeConfig(max_seq_len=64, max_batch=2, gamma=4, vocab_size=100, policy="fixed", min_k=1, max_k=4,
                  max_queue=8)


class FakeTensor:
    def __init__(self, name: str, arr: Any) -> None:
        self.name, self.arr = name, np.asarray(arr)

    def as_numpy(self) -> np.ndarray:
        return self.arr


class FakeError:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, msg: str, code: str | None = None) -> None:
        self.msg, self.kind = msg, code

    def message(self) -> str:
        return self.msg


@dataclass
class FakeResponse:
    output_tensors: list[FakeTensor]
    error: FakeError | None = None

    def out(self, name: str) -> np.ndarray | None:
        return next((t.arr for t in self.output_tensors if t.name == name), None)


class FakePb:
    """The parts of triton_python_backend_utils the stubs use."""

    Tensor = FakeTensor
    TritonError = FakeError
    InferenceResponse = FakeResponse
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    @staticmethod
    def get_input_tensor_by_name(request: "FakeRequest", name: str) -> FakeTensor | None:
        arr = request.inputs.get(name)
        return None if arr is None else FakeTensor(name, arr)


@dataclass
class FakeSender:
    sent: list[tuple[FakeResponse, int]] = field(default_factory=list)

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


@dataclass
class FakeRequest:
    inputs: dict[str, np.ndarray]
    rid: str = "r1"
    sender: FakeSender = field(default_factory=FakeSender)

    def request_id(self) -> str:
        return self.rid

    def parameters(self) -> str:
        return "{}"

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return ["output_ids", "final", "finish_reason"]


@dataclass
class FakeBatcher:
    jobs: list[Any] = field(default_factory=list)
    stops: list[tuple[str, Any]] = field(default_factory=list)

    def submit(self, job: Any) -> None:
        self.jobs.append(job)

    def request_stop(self, key: str, sink: Any) -> None:
        self.stops.append((key, sink))


@pytest.fixture
def model() -> Any:
    m = DsparkModel.__new__(DsparkModel)  # no build loaded: the worker is a fake, the config given
    m.pb, m.name, m.cfg = FakePb, "dspark", CFG
    m.loaded = LoadedBackend(None, 100, (2,))
    m.metrics = ServeMetrics(None, gamma=4)
    m.batcher = FakeBatcher()
    yield m
    if m._responder is not None:
        m._responder.close()


def _request(**inputs: Any) -> FakeRequest:
    arrays = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "max_tokens": np.array([[8]], dtype=np.int32)}
    arrays.update({k: np.asarray(v) for k, v in inputs.items()})
    return FakeRequest({k: v for k, v in arrays.items() if v is not None and v.size})


def test_dspark_stub_hands_a_validated_request_to_the_worker(model: Any) -> None:
    model.execute([_request(policy=np.array([[b"Seed"]], dtype=object), max_k=np.array([[3]], dtype=np.int32))])
    (job,) = model.batcher.jobs
    assert job.prompt_ids == (5, 6, 7) and job.key == "r1" and job.eos_ids == (2,)
    assert (job.params.max_tokens, job.params.policy, job.params.min_k, job.params.max_k) == (8, "confidence", 1, 3)


@pytest.mark.parametrize("inputs,needle,param", [
    ({"input_ids": np.array([[5, 600]], dtype=np.int32)}, "outside the vocabulary", "input_ids"),
    ({"input_ids": np.array([[1] * 70], dtype=np.int32)}, "shorten the prompt", "input_ids"),
    ({"input_ids": np.array([[1], [2]], dtype=np.int32)}, "one prompt per request", "input_ids"),
    ({"max_tokens": np.array([[60]], dtype=np.int32)}, "lower max_tokens", "max_tokens"),
    ({"policy": np.array([[b"bogus"]], dtype=object)}, "policy must be one of", "policy"),
    ({"min_k": np.array([[3]], dtype=np.int32), "max_k": np.array([[2]], dtype=np.int32)}, "min_k", "min_k"),
])
def test_dspark_stub_rejects_at_its_edge(model: Any, inputs: dict, needle: str, param: str) -> None:
    req = _request(**inputs)
    model.execute([req])
    model.responder.close()
    (resp, flags), = req.sender.sent
    assert model.batcher.jobs == [] and flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert resp.error is not None and resp.error.kind == FakeError.INVALID_ARG and needle in resp.error.msg
    assert model.metrics.counters["dspark_errors_total"] == 1
    with pytest.raises(RequestError) as info:  # the same check, called directly, names the field
        model._job(req, TritonSink(model, FakeSender()))
    assert info.value.param == param and needle in str(info.value)


def test_stop_input_goes_to_the_worker_stop(model: Any) -> None:
    model.execute([_request(stop=np.array([[True]]))])
    assert model.batcher.jobs == [] and [k for k, _ in model.batcher.stops] == ["r1"]


def test_final_response_carries_finish_reason_and_stats() -> None:
    host = SimpleNamespace(pb=FakePb, name="dspark", tokenizer=None, responder=Responder(),
                           error_response=lambda exc: FakeResponse([], FakeError(str(exc))))
    sender = FakeSender()
    sink = TritonSink(host, sender, text=False)
    sink.send([4, 5], [], False, None)
    sink.send([6], [4, 5], True, {"tau": 1.5, "finish_reason": "length"}, "length")
    sink.send([7], [], True, None, "eos")  # after the final one: dropped
    host.responder.close()
    (first, f0), (last, f1) = sender.sent
    assert f0 == 0 and f1 == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert first.out("finish_reason") is None and first.out("stats") is None
    assert last.out("output_ids").tolist() == [[6]] and last.out("final").tolist() == [[True]]
    assert last.out("finish_reason").reshape(-1)[0] == b"length"
    assert json.loads(last.out("stats").reshape(-1)[0]) == {"tau": 1.5, "finish_reason": "length"}


def _outputs(text: str) -> list[str]:
    block = text[text.index("output ["):]
    return re.findall(r'name: "(\w+)"', block[:block.index("]\n")])


@pytest.mark.parametrize("model_name", ["dspark", "dspark_sync", "ensemble", "ensemble_stream"])
def test_templates_declare_finish_reason(model_name: str) -> None:
    text = (TEMPLATE_DIR / model_name / "config.pbtxt").read_text()
    assert "finish_reason" in _outputs(text) and "stats" in _outputs(text)
    if model_name.startswith("ensemble"):
        assert 'output_map { key: "finish_reason" value: "finish_reason" }' in text


def test_clients_read_finish_reason() -> None:
    from dspark_trt.serve.clients.aio_client import IDS_OUTPUTS, DsparkAioClient
    from dspark_trt.serve.clients.client import OUTPUTS, _add_result, _Result
    from dspark_trt.serve.triton.bls_sync import OUTPUTS as SYNC_OUTPUTS

    arrays = {"output_ids": np.array([[3, 4]], dtype=np.int32), "final": np.array([[True]]),
              "finish_reason": np.array([[b"stop"]], dtype=object),
              "text_output": np.array([[b"ab"]], dtype=object), "stats": np.array([[b'{"tau": 2.0}']], dtype=object)}
    result = SimpleNamespace(as_numpy=arrays.get)
    chunk = DsparkAioClient._chunk(result)
    assert chunk.ids == (3, 4) and chunk.final and chunk.finish_reason == "stop" and chunk.stats == {"tau": 2.0}
    res = _Result(None)
    _add_result(res, result)
    assert res.as_dict() == {"text": "ab", "token_ids": [3, 4], "finish_reason": "stop", "stats": {"tau": 2.0}}
    assert "finish_reason" in IDS_OUTPUTS and "stats" not in IDS_OUTPUTS  # return_stats is no longer forced
    assert "finish_reason" in OUTPUTS and "finish_reason" in SYNC_OUTPUTS


def test_openai_frontend_validates_with_the_served_checks(tiny_pair) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    from dspark_trt.serve.openai.app import Frontend, ModelInfo
    from dspark_trt.serve.openai.config import OpenAIConfig
    from dspark_trt.serve.openai.protocol import ChatCompletionRequest, CompletionRequest

    tok = AutoTokenizer.from_pretrained(tiny_pair.tokenizer)
    cfg = ServeConfig(max_seq_len=64, max_batch=2, gamma=4, vocab_size=len(tok), policy="fixed", min_k=1, max_k=4)
    info = ModelInfo("m", cfg, tiny_pair.tokenizer)
    fe = Frontend(OpenAIConfig(), client=None, info=info, tokenizer=tok)  # type: ignore[arg-type] - prepare only
    job = fe.prepare(CompletionRequest(model="m", prompt="def f"))
    assert job.gen.max_tokens == 16 and job.gen.return_stats is False and job.gen.policy is None
    chat = fe.prepare(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                            return_stats=True))
    assert chat.gen.max_tokens == cfg.room - len(chat.prompt_ids) and chat.gen.return_stats
    cases = [(CompletionRequest(model="m", prompt="x = 1\n" * 40), "tokens, more than", "prompt",
              "context_length_exceeded"),
             (CompletionRequest(model="m", prompt="def f", max_tokens=60), "lower max_tokens", "max_tokens",
              "context_length_exceeded"),
             (CompletionRequest(model="m", prompt="def f", policy="bogus"), "policy must be one of", "policy", None),
             (CompletionRequest(model="m", prompt="def f", max_k=9), "max_k", "max_k", None),
             (CompletionRequest(model="m", prompt=[1, 10**6]), "outside the vocabulary", "prompt", None)]
    for body, needle, param, code in cases:
        with pytest.raises(RequestError) as info:
            fe.prepare(body)
        assert needle in str(info.value) and (info.value.param, info.value.code) == (param, code), body


def _model_config(**params: str) -> dict:
    base = {"GAMMA": "4", "MAX_SEQ_LEN": "64", "MAX_BATCH_SIZE": "2", "POLICY": "survival", "MIN_K": "2", "MAX_K": "0",
            "MAX_QUEUE": "8", "BUILD_DIR": "/b", **params}
    return {"name": "dspark", "parameters": {k: {"string_value": v} for k, v in base.items()}}


def test_prefill_chunk_defaults_to_chunked_and_is_overridable(monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark_trt.errors import ServeError
    from dspark_trt.serve.config import DEFAULT_PREFILL_CHUNK, PREFILL_CHUNK_ENV

    monkeypatch.delenv(PREFILL_CHUNK_ENV, raising=False)
    assert ServeConfig.from_model_config(_model_config()).prefill_chunk == DEFAULT_PREFILL_CHUNK == 256
    assert ServeConfig.from_model_config(_model_config(PREFILL_CHUNK="0")).prefill_chunk == 0  # whole prompts
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "64")  # the environment wins over the parameter
    assert ServeConfig.from_model_config(_model_config(PREFILL_CHUNK="0")).prefill_chunk == 64
    monkeypatch.setenv(PREFILL_CHUNK_ENV, "-1")
    with pytest.raises(ServeError, match="PREFILL_CHUNK must be an integer"):
        ServeConfig.from_model_config(_model_config())


def test_suffix_recent_tokens_env_sizes_or_turns_off_the_cross_request_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSPARK_SUFFIX_RECENT_TOKENS sizes the served suffix proposer's index of recent outputs; 0 turns it off, so a
    finished answer is never proposed to a later request (its own tokens still are); a bad value names the fix."""
    from dspark_trt.errors import ServeError
    from dspark_trt.serve.config import SUFFIX_RECENT_ENV, suffix_recent_tokens
    from dspark_trt.spec_decode.suffix import SuffixConfig, SuffixProposer

    monkeypatch.delenv(SUFFIX_RECENT_ENV, raising=False)
    assert suffix_recent_tokens(4096) == 4096
    monkeypatch.setenv(SUFFIX_RECENT_ENV, "0")
    assert suffix_recent_tokens(4096) == 0
    monkeypatch.setenv(SUFFIX_RECENT_ENV, "lots")
    with pytest.raises(ServeError, match=SUFFIX_RECENT_ENV):
        suffix_recent_tokens(4096)
    answer = [5, 6, 7, 8, 9, 10, 11, 12]
    for recent, copies in ((1024, True), (0, False)):
        sp = SuffixProposer(SuffixConfig().with_recent_tokens(recent))
        sp.release("a", [1, 2, 3] + answer, prompt_len=3)  # a finished request: its output enters the index
        got = sp.propose("b", [1, 2, 3, 5, 6], 4)  # a later request that starts the same answer
        assert (got is not None and got.source == "cross" and list(got.tokens) == [7, 8, 9, 10]) == copies


def test_calibrate_env_turns_the_loops_calibration_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSPARK_CALIBRATE=0 serves with the startup profile and the drafter's c_j as they are (spec_decode.calibrate
    off, e.g. to compare); unset or 1: on; another value names the fix."""
    from dspark_trt.errors import ServeError
    from dspark_trt.serve.config import CALIBRATE_ENV, calibrate_on

    monkeypatch.delenv(CALIBRATE_ENV, raising=False)
    assert calibrate_on()
    monkeypatch.setenv(CALIBRATE_ENV, "0")
    assert not calibrate_on()
    monkeypatch.setenv(CALIBRATE_ENV, "yes")
    with pytest.raises(ServeError, match=CALIBRATE_ENV):
        calibrate_on()
