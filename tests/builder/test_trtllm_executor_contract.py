"""The DSpark GPU-host `target` (serve/gpu_host/executor_model.py over tensorrt_llm.bindings.executor) against the
TensorRT-LLM 1.2.1 sources: every binding class, enum member, constructor parameter, method and result field it uses
is a 1.2.1 name with that signature (tests/builder/trtllm_1_2_1_names.json "executor_bindings", read from the
sources named there), and the builder selects it for DSpark pairs with the BLS side's tensor names. Nothing here runs
TensorRT-LLM (it cannot be installed on these machines)."""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dspark_trt.builder.model_repo import fill_trtllm_repo
from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.trtllm import TOKENS_PER_BLOCK
from dspark_trt.serve.gpu_host import bls
from dspark_trt.serve.gpu_host import executor_model as em

NAMES = json.loads((Path(__file__).parent / "trtllm_1_2_1_names.json").read_text())
EXB = NAMES["executor_bindings"]
SOURCE = inspect.getsource(em)


class Recorder:
    """A strict stand-in for tensorrt_llm.bindings.executor: constructors check the 1.2.1 parameters, every call is
    recorded (class, positional names, keyword names)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], list[str]]] = []
        for name in EXB["constructors"]:
            setattr(self, name, self._ctor(name))
        for name, members in EXB["enums"].items():
            setattr(self, name, type(name, (), {m: f"{name}.{m}" for m in members}))

    def _ctor(self, name: str) -> Any:
        spec = EXB["constructors"][name]

        def make(*args: Any, **kwargs: Any) -> Any:
            assert len(args) <= len(spec["positional"]), (name, args)
            pos = spec["positional"][:len(args)]
            assert set(kwargs) <= set(spec["keyword"]) and not set(pos) & set(kwargs), (name, kwargs)
            self.calls.append((name, pos, sorted(kwargs)))
            obj = type(name, (), {})()
            obj.__dict__.update(dict(zip(pos, args)), **kwargs)
            return obj

        return make


class Fields:
    """A result object that records which attributes are read."""

    def __init__(self, kind: str, seen: set[tuple[str, str]], **values: Any) -> None:
        self.__dict__["_kind"], self.__dict__["_seen"], self.__dict__["_values"] = kind, seen, values

    def __getattr__(self, name: str) -> Any:
        self._seen.add((self._kind, name))
        return self._values[name]


def cfg() -> em.ExecutorModelConfig:
    return em.ExecutorModelConfig("target", Path("/b/engines/target"), ("dspark_tap_3",), 8, max_queue_size=16)


def test_every_binding_name_used_is_a_121_name() -> None:
    used = set(re.findall(r"\btle\.(\w+)", SOURCE))
    assert used <= set(EXB["constructors"]) | set(EXB["enums"]), used - set(EXB["constructors"]) - set(EXB["enums"])
    for enum, member in re.findall(r"\btle\.(\w+)\.([A-Z_]+)\b", SOURCE):
        assert member in EXB["enums"][enum], (enum, member)
    assert "tensorrt_llm.bindings.executor" in SOURCE  # the 1.2.x Python bindings module (docs: executor.md)
    for method in set(re.findall(r"\bself\.executor\.(\w+)\(", SOURCE)):
        assert method in EXB["methods"]["Executor"], method
    assert "await_responses(timeout=" in SOURCE and EXB["methods"]["Executor"]["await_responses"] == ["timeout"]
    assert em.CONTEXT_PREFIX == EXB["context_output_prefix"]


def test_constructor_calls_match_the_121_signatures() -> None:
    tle = Recorder()
    ec = em.executor_config(tle, cfg())
    req = em.TargetRequest((1, 2, 3), 1, True, ("dspark_tap_3",), True, 0.7, 0.95, 9)
    r = em.executor_request(tle, req)
    seen = {c[0] for c in tle.calls}
    assert seen == {"AdditionalModelOutput", "KvCacheConfig", "SchedulerConfig", "ExecutorConfig", "OutputConfig",
                    "SamplingConfig", "Request"}
    # the fields the feature needs, under their 1.2.1 names
    assert [(o.name, o.gather_context) for o in ec.additional_model_outputs] == [("dspark_tap_3", True)]
    assert ec.kv_cache_config.enable_partial_reuse is False and ec.max_queue_size == 16
    assert r.output_config.return_context_logits and r.output_config.return_perf_metrics
    assert [(o.name, o.gather_context) for o in r.output_config.additional_model_outputs] == [("dspark_tap_3", True)]
    assert r.input_token_ids == [1, 2, 3] and r.max_tokens == 1
    assert (r.sampling_config.beam_width, r.sampling_config.temperature, r.sampling_config.seed) == (1, 0.7, 9)


def test_result_fields_read_are_121_fields() -> None:
    import torch

    seen: set[tuple[str, str]] = set()
    kv = Fields("KvCacheMetrics", seen, num_reused_blocks=1)
    perf = Fields("RequestPerfMetrics", seen, kv_cache_metrics=kv)
    outs = [Fields("AdditionalOutput", seen, name="context_dspark_tap_3", output=torch.zeros(12, 4)),
            Fields("AdditionalOutput", seen, name="generation_dspark_tap_3", output=torch.zeros(1, 1, 4))]
    result = Fields("Result", seen, is_final=True, output_token_ids=[[7]], context_logits=torch.zeros(12, 5),
                    additional_outputs=outs, request_perf_metrics=perf)
    resp = Fields("Response", seen, has_error=lambda: False, error_msg="", result=result, request_id=1)
    out = em.reply_arrays(resp, em.TargetRequest(tuple(range(12)), 1, True, ("dspark_tap_3",)), cfg())
    assert out["context_logits"].shape == (1, 4, 5) and out["dspark_tap_3"].shape == (1, 4, 4)  # 12 − 1 block of 8
    for kind, field in seen:
        allowed = EXB["attributes"].get(kind, []) + list(EXB["methods"].get(kind, {}))
        assert field in allowed, (kind, field)
    assert ("Result", "additional_outputs") in seen and ("KvCacheMetrics", "num_reused_blocks") in seen


def _params(text: str) -> dict[str, str]:
    return dict(re.findall(r'parameters: \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', text))


def _names(text: str, section: str) -> list[str]:
    """Tensor names of every `section [ ... ]` block (a repeated field may be given again)."""
    return [n for body in text.split(f"{section} [")[1:] for n in re.findall(r'name: "(\w+)"', body.split("\n]")[0])]


def test_the_builder_selects_the_executor_target_for_dspark_pairs(tmp_path: Path) -> None:
    opts = BuildOptions(max_batch_size=8, max_queue=32)
    facts = fill_trtllm_repo(opts, tmp_path / "d", draft_engine=False, taps=(1, 8))
    repo = tmp_path / "d" / "model_repo_trtllm"
    assert not (repo / "_variants").exists() and not (repo / "draft").exists()
    text = (repo / "target" / "config.pbtxt").read_text()
    assert 'backend: "python"' in text and "decoupled: false" in text and "${" not in text
    assert "ExecutorTargetModel" in (repo / "target" / "1" / "model.py").read_text()
    p = _params(text)
    assert p["engine_dir"] == f"{(tmp_path / 'd').resolve()}/engines/target"
    assert p["dspark_tap_names"] == "dspark_tap_1,dspark_tap_8" and p["tokens_per_block"] == str(TOKENS_PER_BLOCK)
    assert p["enable_kv_cache_reuse"] == "true" and 0 < float(p["kv_cache_free_gpu_mem_fraction"]) <= 1
    ins, outs = _names(text, "input"), _names(text, "output")
    assert set(ins) == set(em.INPUT_NAMES) and set(ins) <= set(bls.INPUT_DTYPES)  # the BLS side's names
    assert set(bls.OUTPUT_NAMES) | {"dspark_tap_1", "dspark_tap_8"} <= set(outs)
    for name in ins:  # dtypes as the BLS side sends them
        decl = re.search(r'name: "%s" data_type: TYPE_(\w+)' % name, text).group(1)
        assert np.dtype(bls.INPUT_DTYPES[name]) == np.dtype({"INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32,
                                                             "UINT64": np.uint64}[decl]), name
    assert facts["tap_outputs"] == ["dspark_tap_1", "dspark_tap_8"] and "executor" in facts["target_model"]
    stock = fill_trtllm_repo(opts, tmp_path / "lm")  # LM / PARD pairs: the stock tensorrtllm target
    text = (tmp_path / "lm" / "model_repo_trtllm" / "target" / "config.pbtxt").read_text()
    assert 'backend: "tensorrtllm"' in text and not (tmp_path / "lm" / "model_repo_trtllm" / "_variants").exists()
    assert "target_model" not in stock


def test_why_the_python_model() -> None:
    """The stock backend's C++ model never sets additional outputs (names file); the Python model does."""
    assert NAMES["taps"]["triton_backend_forwards_additional_outputs"] is False
    assert NAMES["taps"]["triton_python_model_forwards_additional_outputs"] is True
    assert "additional_model_outputs=_outputs(tle, cfg.tap_names)" in SOURCE
    assert "additional_model_outputs=_outputs(tle, req.taps)" in SOURCE


@pytest.mark.parametrize("name", sorted(EXB["constructors"]))
def test_names_file_lists_keyword_positional_consistently(name: str) -> None:
    spec = EXB["constructors"][name]
    assert set(spec["positional"]) <= set(spec["keyword"]) or name == "Executor"
