"""The executor `target` model (serve/gpu_host/executor_model.py) over a TEST DOUBLE of tensorrt_llm.bindings.executor:
config from the built repository, request checks, the reply's trimming of KV-reused context rows (TensorRT-LLM 1.2.1
returns [prompt_len, ·] context tensors whose reused prefix rows are never written), the bridge's threading, the
Triton layer, and DSpark rounds (TapExecutor) through the whole adapter equal to the reference runtime.

ExecutorBindingsDouble / EngineBackedExecutor below are test doubles for the bindings only (their constructors take
exactly the 1.2.1 signatures of tests/builder/trtllm_1_2_1_names.json "executor_bindings"); they answer with the
reference runtime through trtllm_standin.engine. No TensorRT-LLM runs here."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import pytest
import torch

from dspark_trt.builder.model_repo import fill_trtllm_repo
from dspark_trt.builder.options import BuildOptions
from dspark_trt.serve.gpu_host import executor_model as em
from dspark_trt.serve.gpu_host.bls import call_tensors, reply_from_arrays
from dspark_trt.serve.gpu_host.rounds import EngineCall, EngineReply
from dspark_trt.testing.trtllm_standin.engine import StandinEngine

NAMES = json.loads((Path(__file__).parents[1] / "builder" / "trtllm_1_2_1_names.json").read_text())["executor_bindings"]
TAPS = ("dspark_tap_0", "dspark_tap_1")
GAMMA, MAX_SEQ, MAX_BATCH, TPB = 4, 160, 8, 4


# ---- the test double of the bindings ------------------------------------------------------------------------------
class _Obj:
    """A binding object: accepts exactly the 1.2.1 positional / keyword parameters of its class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec = NAMES["constructors"][type(self).__name__]
        if len(args) > len(spec["positional"]):
            raise TypeError(f"{type(self).__name__}: too many positional arguments")
        named = dict(zip(spec["positional"], args))
        bad = set(kwargs) - set(spec["keyword"]) | set(named) & set(kwargs)
        if bad:
            raise TypeError(f"{type(self).__name__}: unexpected {sorted(bad)}")
        self.__dict__.update(named, **kwargs)


def _enum(name: str) -> Any:
    return SimpleNamespace(**{v: f"{name}.{v}" for v in NAMES["enums"][name]})


class ExecutorBindingsDouble(SimpleNamespace):
    """tensorrt_llm.bindings.executor as far as executor_model uses it (test double)."""

    def __init__(self, executor_cls: type | None = None) -> None:
        classes = {n: type(n, (_Obj,), {}) for n in NAMES["constructors"] if n != "Executor"}
        super().__init__(**classes, **{n: _enum(n) for n in NAMES["enums"]})
        if executor_cls is not None:
            self.Executor = executor_cls


def _slots(name: str) -> type:
    return type(name, (), {"__slots__": tuple(NAMES["attributes"][name])})  # reads outside 1.2.1 names fail


Result, AdditionalOutput = _slots("Result"), _slots("AdditionalOutput")
RequestPerfMetrics, KvCacheMetrics = _slots("RequestPerfMetrics"), _slots("KvCacheMetrics")
Response = type("Response", (), {"__slots__": tuple(NAMES["attributes"]["Response"]) + tuple(NAMES["methods"]["Response"])})


def response(rid: int, *, error: str | None = None, tokens: Sequence[int] = (), ctx: Any = None,
             outputs: dict[str, Any] | None = None, reused_blocks: int | None = 0) -> Any:
    r = Response()
    r.request_id, r.error_msg = rid, error or ""
    r.has_error = lambda: error is not None  # the 1.2.1 method
    if error is None:
        res = Result()
        res.is_final, res.output_token_ids, res.context_logits = True, [list(tokens)], ctx
        res.additional_outputs = []
        for name, t in (outputs or {}).items():
            a = AdditionalOutput()
            a.name, a.output = name, t
            res.additional_outputs.append(a)
        res.request_perf_metrics = None
        if reused_blocks is not None:
            kv, perf = KvCacheMetrics(), RequestPerfMetrics()
            kv.num_reused_blocks, perf.kv_cache_metrics = reused_blocks, kv
            res.request_perf_metrics = perf
        r.result = res
    return r


class EngineBackedExecutor:
    """A test double of Executor answering with the reference runtime in TensorRT-LLM 1.2.1's result layout: context
    logits and "context_<tap>" as [prompt_len, ·] torch tensors whose KV-reused prefix rows are garbage (NaN),
    "generation_<tap>" beside them, num_reused_blocks in the perf metrics."""

    def __init__(self, model_path: str, model_type: Any, executor_config: Any, target: torch.nn.Module) -> None:
        assert model_type == "ModelType.DECODER_ONLY" and isinstance(model_path, str)
        self.config = executor_config
        self.taps = tuple(o.name for o in executor_config.additional_model_outputs)
        assert all(o.gather_context for o in executor_config.additional_model_outputs)
        self.engine = StandinEngine(target, MAX_BATCH, MAX_SEQ + GAMMA + 2, reuse_block=TPB)
        self._next, self._ready, self._lock = 1, [], threading.Lock()
        self.batches: list[int] = []
        self.shut = False

    def enqueue_requests(self, requests: list[Any]) -> list[int]:
        calls = []
        for r in requests:
            oc = r.output_config
            assert oc.return_perf_metrics and oc.exclude_input_from_output and r.streaming is False
            taps = tuple(o.name for o in oc.additional_model_outputs or ())
            assert all(o.gather_context for o in oc.additional_model_outputs or ())
            sc = r.sampling_config.__dict__
            calls.append(EngineCall(tuple(r.input_token_ids), r.max_tokens, (), sc.get("temperature", 0.0),
                                    sc.get("top_p", 1.0), sc.get("seed"), False, "", oc.return_context_logits, taps))
        self.batches.append(len(calls))
        replies = self.engine.run(calls)
        with self._lock:
            ids = list(range(self._next, self._next + len(calls)))
            self._next += len(calls)
            for rid, call, rep in zip(ids, calls, replies):
                self._ready.append(self._response(rid, call, rep))
        return ids

    @staticmethod
    def _full(rows: np.ndarray, P: int) -> torch.Tensor:
        """The computed suffix [P − m, ·] → [P, ·] with the m reused rows unwritten (NaN)."""
        out = torch.full((P, rows.shape[-1]), float("nan"))
        out[P - rows.shape[0]:] = torch.from_numpy(rows)
        return out

    def _response(self, rid: int, call: EngineCall, rep: EngineReply) -> Any:
        if rep.error:
            return response(rid, error=rep.error)
        P = len(call.input_ids)
        outs = {}
        for t in call.taps:
            outs[f"context_{t}"] = self._full(rep.taps[t], P)
            outs[f"generation_{t}"] = torch.zeros(1, call.output_len, rep.taps[t].shape[-1])
        ctx = self._full(rep.context_logits, P) if call.context_logits else None
        reused = P - rep.taps[call.taps[0]].shape[0]  # this call's reused input tokens (whole blocks of TPB)
        return response(rid, tokens=rep.tokens, ctx=ctx, outputs=outs, reused_blocks=reused // TPB)

    def await_responses(self, timeout: Any = None) -> list[Any]:
        with self._lock:
            out, self._ready = self._ready, []
        if not out:
            time.sleep(timeout.total_seconds())
        return out

    def shutdown(self) -> None:
        self.shut = True


# ---- configs ------------------------------------------------------------------------------------------------------
def model_config(text: str) -> dict[str, Any]:
    """A filled config.pbtxt → the fields of Triton's JSON model config that the model reads."""
    params = dict(re.findall(r'parameters: \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', text))
    outputs = re.findall(r'name: "(\w+)"\s*data_type', text.split("output [", 1)[1])
    return {"name": "target", "parameters": {k: {"string_value": v} for k, v in params.items()},
            "output": [{"name": n} for n in outputs],
            "dynamic_batching": {"default_queue_policy": {"max_queue_size": 64}}}


@pytest.fixture(scope="module")
def built_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("exec_repo")
    fill_trtllm_repo(BuildOptions(max_batch_size=MAX_BATCH, max_queue=64), out, draft_engine=False, taps=(0, 1))
    return model_config((out / "model_repo_trtllm" / "target" / "config.pbtxt").read_text())


def test_config_from_the_built_repository(built_config: dict[str, Any]) -> None:
    cfg = em.ExecutorModelConfig.from_model_config(built_config)
    assert cfg.tap_names == TAPS and cfg.engine_dir.name == "target" and cfg.engine_dir.parent.name == "engines"
    assert cfg.tokens_per_block == 32 and cfg.enable_kv_cache_reuse and cfg.max_queue_size == 64
    assert cfg.kv_cache_free_gpu_mem_fraction == 0.5 and cfg.scheduler_policy == "guaranteed_no_evict"
    bad = json.loads(json.dumps(built_config))
    bad["output"] = [o for o in bad["output"] if o["name"] != "dspark_tap_1"]
    with pytest.raises(em.ExecutorModelError, match="does not match the declared tap outputs.*rebuild"):
        em.ExecutorModelConfig.from_model_config(bad)


def _cfg(**kw: Any) -> em.ExecutorModelConfig:
    return em.ExecutorModelConfig("target", Path("/e/engines/target"), TAPS, TPB, **kw)


def test_engine_block_size_wins(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"build_config": {"plugin_config": {"tokens_per_block": 64}}}))
    cfg = em.ExecutorModelConfig("target", tmp_path, TAPS, 32).with_engine_block_size()
    assert cfg.tokens_per_block == 64 and cfg.tap_names == TAPS


@pytest.mark.parametrize("arrays, match", [({}, "input_ids is required"),
                                            ({"input_ids": np.array([[1, 2]]), "request_output_len": np.array([[0]])},
                                             "request_output_len must be"),
                                            ({"input_ids": np.array([[1, 2]]), "request_output_len": np.array([[1]]),
                                              "draft_input_ids": np.array([[3]])}, "speculative mode"),
                                            ({"input_ids": np.array([[1, 2]]), "request_output_len": np.array([[1]]),
                                              "return_generation_logits": np.array([[True]])}, "return_context_logits"),
                                            ({"input_ids": np.array([[1, 2]]), "input_lengths": np.array([[3]]),
                                              "request_output_len": np.array([[1]])}, "input_lengths 3")])
def test_requests_it_cannot_serve_name_the_fix(arrays: dict, match: str) -> None:
    with pytest.raises(em.ExecutorModelError, match=match):
        em.parse_request(arrays, None, _cfg())


def test_the_bls_tensors_parse_to_the_call() -> None:
    call = EngineCall((5, 6, 7, 8, 9), 1, temperature=0.8, top_p=0.9, seed=3, context_logits=True, taps=TAPS[1:])
    req = em.parse_request(call_tensors(call), ["output_ids", "context_logits", "dspark_tap_1"], _cfg())
    assert req == em.TargetRequest((5, 6, 7, 8, 9), 1, True, ("dspark_tap_1",), True, pytest.approx(0.8),
                                   pytest.approx(0.9), 3)
    tle = ExecutorBindingsDouble()
    r = em.executor_request(tle, req)
    assert r.input_token_ids == [5, 6, 7, 8, 9] and r.max_tokens == 1 and r.streaming is False
    assert r.sampling_config.beam_width == 1 and r.sampling_config.seed == 3
    oc = r.output_config
    assert oc.return_context_logits and oc.return_perf_metrics and oc.exclude_input_from_output
    assert [(o.name, o.gather_context) for o in oc.additional_model_outputs] == [("dspark_tap_1", True)]
    ec = em.executor_config(tle, _cfg())
    assert [(o.name, o.gather_context) for o in ec.additional_model_outputs] == [(t, True) for t in TAPS]
    kv = ec.kv_cache_config
    assert kv.enable_block_reuse and kv.enable_partial_reuse is False and kv.free_gpu_memory_fraction == 0.5
    assert ec.batching_type == "BatchingType.INFLIGHT" and ec.max_beam_width == 1
    assert ec.scheduler_config.capacity_scheduler_policy == "CapacitySchedulerPolicy.GUARANTEED_NO_EVICT"


def test_the_reply_keeps_exactly_the_computed_rows() -> None:
    P, V, H = 11, 6, 3
    req = em.TargetRequest(tuple(range(P)), 1, True, TAPS)
    logits, feats = torch.randn(P, V), torch.randn(P, H)
    logits[:8], feats[:8] = float("nan"), float("nan")  # 2 reused blocks of 4: rows 0..7 never written
    resp = response(1, tokens=[42], ctx=logits, outputs={"context_dspark_tap_0": feats, "context_dspark_tap_1": feats,
                                                           "generation_dspark_tap_0": torch.zeros(1, 1, H)},
                    reused_blocks=2)
    out = em.reply_arrays(resp, req, _cfg())
    assert out["output_ids"].tolist() == [[[42]]] and out["sequence_length"].tolist() == [[1]]
    assert out["context_logits"].shape == (1, 3, V) and np.isfinite(out["context_logits"]).all()
    np.testing.assert_array_equal(out["dspark_tap_1"][0], feats[8:].numpy())
    rep = reply_from_arrays(out["output_ids"], out["sequence_length"], None, out["context_logits"],
                            {t: out[t] for t in TAPS})
    assert rep.context_logits.shape == (3, V) and rep.taps["dspark_tap_0"].shape == (3, H)  # what TapExecutor reads
    full = em.reply_arrays(response(1, tokens=[1], ctx=logits, outputs={f"context_{t}": feats for t in TAPS},
                                    reused_blocks=9), req, _cfg())  # more blocks than the prompt: the last row kept
    assert full["context_logits"].shape == (1, 1, V)
    assert em.reply_arrays(resp, req, _cfg(enable_kv_cache_reuse=False))["context_logits"].shape == (1, P, V)


@pytest.mark.parametrize("resp, match", [(response(1, error="out of KV blocks"), "failed the request: out of KV"),
                                         (response(1, tokens=[1], ctx=torch.zeros(4, 2), outputs={}),
                                          "no context_dspark_tap_0.*rebuild"),
                                         (response(1, tokens=[1], ctx=None), "gather_context_logits"),
                                         (response(1, tokens=[1], ctx=torch.zeros(4, 2), reused_blocks=None),
                                          "request_perf_metrics")])
def test_failed_replies_name_the_fix(resp: Any, match: str) -> None:
    with pytest.raises(em.ExecutorModelError, match=match):
        em.reply_arrays(resp, em.TargetRequest((1, 2, 3, 4), 1, True, TAPS), _cfg())


# ---- the bridge and the Triton layer ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_pair):  # noqa: ANN001, ANN201
    """The tiny target (runtime) and a DSpark drafter factory for it (as tests/serve/test_trtllm_taps.py)."""
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


class BridgeClient:
    """EngineClient through the whole adapter: EngineCall → BLS tensors → parse_request → ExecutorBridge →
    (test double executor) → reply_arrays → BLS reply."""

    def __init__(self, bridge: em.ExecutorBridge) -> None:
        self.bridge = bridge

    def generate(self, model: str, calls: Sequence[EngineCall]) -> list[EngineReply]:
        got: list[Any] = [None] * len(calls)
        done = threading.Semaphore(0)

        def cb(i: int) -> Any:
            def f(reply: Any) -> None:
                got[i] = reply
                done.release()
            return f

        reqs = [em.parse_request(call_tensors(c), ["output_ids", "context_logits", *c.taps], self.bridge.cfg)
                for c in calls]
        self.bridge.submit(reqs, [cb(i) for i in range(len(calls))])
        for _ in calls:
            assert done.acquire(timeout=30)
        out = []
        for r in got:
            if isinstance(r, Exception):
                out.append(EngineReply([], error=str(r)))
            else:
                out.append(reply_from_arrays(r["output_ids"], r["sequence_length"], None, r.get("context_logits"),
                                             {t: r[t] for t in TAPS if t in r} or None))
        return out


@pytest.mark.parametrize("sampled", [False, True])
def test_dspark_rounds_through_the_adapter_equal_the_reference(pair, sampled: bool) -> None:  # noqa: ANN001
    from dspark_trt.runtime.backend import SpecBackend
    from dspark_trt.serve.gpu_host.taps import TapExecutor
    from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
    from dspark_trt.spec_decode.sampling import SamplingParams
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    target, drafter = pair
    prompts = [(5, 6, 7, 8, 9, 10), (10, 11), (3,) * 9, (20, 30, 40), (99, 98, 97, 96, 95)]

    def reqs() -> list[Request]:
        return [Request(p, 20 + 3 * i, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=5 + i)
                        if sampled and i % 2 else SamplingParams(), policy=PolicyConfig(policy="fixed", k=3))
                for i, p in enumerate(prompts)]

    def run(sched: RoundScheduler) -> list[list[int]]:
        ids = [sched.add(r) for r in reqs()]
        out: dict[int, list[int]] = {i: [] for i in ids}
        for _ in range(3000):
            if not sched.pending:
                break
            for ev in sched.step():
                out[ev.request_id].extend(ev.new_tokens)
        return [out[i] for i in ids]

    want = run(RoundScheduler(SpecBackend(target, drafter(), MAX_BATCH, MAX_SEQ + GAMMA + 2),
                              LoopConfig(gamma=GAMMA, calibrate=False)))
    tle = ExecutorBindingsDouble()
    cfg = _cfg()
    executor = EngineBackedExecutor("/e/engines/target", tle.ModelType.DECODER_ONLY, em.executor_config(tle, cfg),
                                    target)
    bridge = em.ExecutorBridge(executor, tle, cfg)
    try:
        ex = TapExecutor(BridgeClient(bridge), drafter(), TAPS, MAX_BATCH, MAX_SEQ, int(target.config.vocab_size))
        got = run(RoundScheduler(ex, LoopConfig(gamma=GAMMA, calibrate=False)))
        assert got == want
        assert any(m >= TPB for m in executor.engine.reused)  # blocks were reused: the NaN rows were trimmed, not read
        assert max(executor.batches) > 1 and bridge.pending == 0  # a fan-out is one enqueue; nothing left behind
        assert not ex._holes  # noqa: SLF001 - distinct prompts: no reuse of a needed position
    finally:
        bridge.close()
    assert executor.shut


class PbDouble:
    """triton_python_backend_utils as far as ExecutorTargetModel uses it (test double)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name: str, arr: np.ndarray) -> None:
            self.name, self.arr = name, arr

        def as_numpy(self) -> np.ndarray:
            return self.arr

    class TritonError:
        def __init__(self, msg: str) -> None:
            self.msg = msg

    class InferenceResponse:
        def __init__(self, output_tensors: list, error: Any = None) -> None:
            self.outputs, self.error = {t.name: t.arr for t in output_tensors}, error

    @staticmethod
    def get_input_tensor_by_name(request: Any, name: str) -> Any:
        arr = request.inputs.get(name)
        return None if arr is None else PbDouble.Tensor(name, arr)


class TritonRequestDouble:
    def __init__(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> None:
        self.inputs, self.outputs, self.sent, self.event = inputs, outputs, [], threading.Event()

    def requested_output_names(self) -> list[str]:
        return self.outputs

    def get_response_sender(self) -> Any:
        def send(resp: Any, flags: int = 0) -> None:
            self.sent.append((resp, flags))
            self.event.set()
        return SimpleNamespace(send=send)


def test_the_triton_model_answers_through_response_senders(pair, built_config: dict, tmp_path: Path) -> None:  # noqa: ANN001
    target, _ = pair
    engine = tmp_path / "engines" / "target"
    engine.mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps({"build_config": {"plugin_config": {"tokens_per_block": TPB}}}))
    conf = json.loads(json.dumps(built_config))
    conf["parameters"]["engine_dir"] = {"string_value": str(engine)}
    made: list[EngineBackedExecutor] = []

    def executor_cls(path: str, model_type: Any, config: Any) -> EngineBackedExecutor:
        made.append(EngineBackedExecutor(path, model_type, config, target))
        return made[-1]

    model = type("Model", (em.ExecutorTargetModel,), {"pb": PbDouble, "bindings": ExecutorBindingsDouble(executor_cls)})()
    model.initialize({"model_config": json.dumps(conf)})
    assert model.cfg.tokens_per_block == TPB  # the engine's value
    ok = TritonRequestDouble(call_tensors(EngineCall((5, 6, 7, 8, 9), 1, context_logits=True, taps=TAPS)),
                             ["output_ids", "sequence_length", "context_logits", *TAPS])
    bad = TritonRequestDouble(call_tensors(EngineCall((5, 6), 2, draft_ids=(7,))), ["output_ids"])
    assert model.execute([ok, bad]) is None  # answered through the senders, not returned
    assert ok.event.wait(30) and bad.event.wait(30)
    (resp, flags), = ok.sent
    assert flags == PbDouble.TRITONSERVER_RESPONSE_COMPLETE_FINAL and resp.error is None
    V = int(target.config.vocab_size)
    assert resp.outputs["context_logits"].shape == (1, 5, V) and resp.outputs["dspark_tap_1"].shape[:2] == (1, 5)
    (err, flags), = bad.sent
    assert flags == 1 and "speculative mode" in err.error.msg and not err.outputs
    model.finalize()
    assert made[0].shut and made[0].batches == [1]  # the refused request never reached the executor
