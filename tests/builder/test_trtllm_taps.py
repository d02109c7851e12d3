"""The tapped target (builder/trtllm_taps.py) and the TensorRT-LLM >= 1.4 LLM-API config (builder/llmapi.py):
every TensorRT-LLM name they use is a 1.2.1 name (tests/builder/trtllm_1_2_1_names.json "taps", read from the
sources), the engine plan of a DSpark pair builds the tapped target through our Python-API entry point, and the
LLM-API files carry the DSparkDecodingConfig fields. No engine is built here (TensorRT-LLM cannot be installed)."""
from __future__ import annotations

import inspect
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dspark_trt.builder import llmapi, trtllm, trtllm_taps
from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import BuildError

NAMES = json.loads((Path(__file__).parent / "trtllm_1_2_1_names.json").read_text())
TAPS = NAMES["taps"]


class _Tensor:
    """Records mark_output calls with TensorRT-LLM's Tensor.mark_output(name, dtype) signature."""

    def __init__(self, marks: list[tuple[str, Any]]) -> None:
        self.marks = marks

    def mark_output(self, name: str, dtype: Any) -> None:
        self.marks.append((name, dtype))


class _Layer:
    def __init__(self, idx: int, marks: list[tuple[str, Any]]) -> None:
        self.layer_idx, self.marks, self.calls = idx, marks, 0

    def forward(self, hidden: Any, use_cache: bool = False) -> Any:
        self.calls += 1
        out = _Tensor(self.marks)
        return (out, "presents") if use_cache else out


class _Model:
    def __init__(self, n: int) -> None:
        self.marks: list[tuple[str, Any]] = []
        self.transformer = type("T", (), {})()
        self.transformer.layers = [_Layer(i, self.marks) for i in range(n)]
        self.config = type("C", (), {"num_hidden_layers": n})()


def test_tap_output_names_and_errors() -> None:
    assert trtllm_taps.tap_output_names((1, 8, 14)) == ("dspark_tap_1", "dspark_tap_8", "dspark_tap_14")
    for bad in ((), (2, 2), (-1,)):
        with pytest.raises(BuildError, match="Fix|fix"):
            trtllm_taps.tap_output_names(bad)


@pytest.mark.parametrize("use_cache", [False, True])
def test_mark_taps_marks_the_tapped_layers_outputs(use_cache: bool) -> None:
    m = _Model(6)
    assert trtllm_taps.mark_taps(m, (4, 1), "bf16") == ["dspark_tap_1", "dspark_tap_4"]
    for layer in m.transformer.layers:  # tracing the network = calling every layer
        out = layer.forward(None, use_cache=use_cache)
        assert isinstance(out, tuple) == use_cache  # the layer's own return value is untouched
    assert m.marks == [("dspark_tap_1", "bf16"), ("dspark_tap_4", "bf16")]
    assert all(layer.calls == 1 for layer in m.transformer.layers)
    with pytest.raises(BuildError, match="does not exist"):
        trtllm_taps.mark_taps(_Model(3), (5,), "bf16")


def test_the_names_used_are_121_names() -> None:
    # Tensor.mark_output(name, dtype), PretrainedModel.from_checkpoint(ckpt_dir, rank, config)
    assert list(inspect.signature(_Tensor.mark_output).parameters)[1:] == TAPS["tensor_methods"]["mark_output"]
    src = inspect.getsource(trtllm_taps) + inspect.getsource(trtllm._build_rank)
    assert ".mark_output(name, dtype)" in src
    assert "from_checkpoint(str(ckpt), rank=rank, config=cfg)" in src
    assert set(TAPS["model_class_methods"]["from_checkpoint"]) == {"ckpt_dir", "rank", "config"}
    assert set(trtllm_taps.TAPPED_BASES.values()) <= set(TAPS["model_classes"])
    # the serving side's executor names (docs/gpu.md) are the 1.2.1 OutputConfig / AdditionalModelOutput fields
    assert {"return_context_logits", "additional_model_outputs"} <= set(TAPS["executor_classes"]["OutputConfig"])
    assert TAPS["executor_classes"]["AdditionalModelOutput"] == ["name", "gather_context"]


@pytest.mark.parametrize("opts", [BuildOptions(), BuildOptions(kv_quant="fp8", tp_size=2, max_draft_len=5)])
@pytest.mark.parametrize("algo", [None, "FP8", "W8A8_SQ_PER_CHANNEL"])
def test_tapped_target_build_config(opts: BuildOptions, algo: str | None) -> None:
    bc = trtllm.build_config_json(opts, "target_taps", algo)
    assert set(bc) <= set(NAMES["build_config_fields"])
    assert set(bc["plugin_config"]) <= set(NAMES["plugin_config_fields"])
    assert bc["gather_context_logits"] is True and bc["gather_generation_logits"] is False
    assert bc["speculative_decoding_mode"] == NAMES["speculative_decoding_mode_values"]["NONE"]
    assert bc["max_draft_len"] == 0
    assert bc["max_input_len"] == opts.max_input_len + opts.max_draft_len <= bc["max_seq_len"]
    assert bc["plugin_config"].get("use_fp8_context_fmha", False) == (opts.kv_quant == "fp8")
    # the draft/target recipe's target is unchanged
    assert trtllm.build_config(opts, "target", algo)["gather_context_logits"] is False


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_plan_of_a_dspark_pair(tmp_path: Path, tp: int) -> None:
    engines = tmp_path / "b" / "engines"
    facts = trtllm.build_engines(engines, BuildOptions(max_draft_len=5, tp_size=tp), tmp_path / "b/target/checkpoint",
                                 tmp_path / "b/draft/checkpoint", "dspark", "FP8", None, (1, 8, 14))
    assert facts["built"] is False and facts["target_engine"] == "tapped"
    assert facts["tap_layers"] == [1, 8, 14] and facts["tap_outputs"] == ["dspark_tap_1", "dspark_tap_8", "dspark_tap_14"]
    script = (engines / "build_engines.sh").read_text()
    assert subprocess.run(["bash", "-n", str(engines / "build_engines.sh")]).returncode == 0
    assert "trtllm-build --" not in script  # the tap list travels on the PretrainedConfig: Python API only
    line = next(ln for ln in script.splitlines() if "dspark_trt.builder.trtllm" in ln)
    argv = shlex.split(line.replace('"', ""))
    assert (argv[:4] == ["mpirun", "-n", "2", "--allow-run-as-root"]) == (tp == 2)
    argv = argv[argv.index("-m") + 2:]
    ns = dict(zip(argv[::2], argv[1::2]))
    assert ns["--tap_layers"] == "1,8,14" and ns["--output_dir"] == "$BUILD_DIR/engines/target"
    assert ns["--checkpoint_dir"] == "$BUILD_DIR/target/checkpoint"
    bc = json.loads((engines / "target.build_config.json").read_text())
    assert bc["gather_context_logits"] is True and bc["speculative_decoding_mode"] == 1


def test_only_the_adapters_import_tensorrt_llm_lazily() -> None:
    root = Path(__file__).resolve().parents[2] / "dspark_trt"
    pat = re.compile(r"^\s*(import tensorrt_llm|from tensorrt_llm)", re.M)
    offenders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if pat.search(p.read_text()))
    assert offenders == ["builder/trtllm.py", "builder/trtllm_taps.py", "serve/gpu_host/executor_model.py"]
    for name in offenders:
        top = [ln for ln in (root / name).read_text().splitlines() if re.match(r"(import|from) tensorrt_llm", ln)]
        assert top == [], name


DRAFTER = {"target_layer_ids": [1, 8, 14, 21, 28], "block_size": 7, "mask_token_id": 0, "markov_rank": 64,
           "markov_head_type": "vanilla", "enable_confidence_head": True}
ISSUE_FIELDS = {"speculative_model", "max_draft_len", "mask_token_id", "target_layer_ids", "block_size", "markov_rank",
                "markov_head_type", "token_counts", "step_time_ms", "fixed_overhead_ms", "batch_sizes",
                "batch_overhead_ms"}


def _check_schema(obj: dict[str, Any], schema: dict[str, Any]) -> None:
    """The cost table against COST_TABLE_SCHEMA (the keywords it uses; jsonschema is not installed here)."""
    assert set(schema["required"]) <= set(obj)
    for k, spec in schema["properties"].items():
        v = obj[k]
        if spec["type"] == "array":
            assert isinstance(v, list) and len(v) >= spec["minItems"]
            for x in v:
                assert isinstance(x, int if spec["items"]["type"] == "integer" else (int, float))
                assert x >= spec["items"].get("minimum", float("-inf"))
                assert x > spec["items"].get("exclusiveMinimum", float("-inf"))
        else:
            assert isinstance(v, (int, float)) and v >= spec["minimum"]


def test_dspark_decoding_config_fields(tmp_path: Path) -> None:
    cfg = llmapi.dspark_decoding_config(BuildOptions(), DRAFTER, "/x/drafter")
    assert ISSUE_FIELDS <= set(cfg) and tuple(cfg) == llmapi.LLMAPI_FIELDS
    assert cfg["decoding_type"] == "DSpark" and cfg["max_draft_len"] == 7 and cfg["target_layer_ids"] == [1, 8, 14, 21, 28]
    assert cfg["confidence_scheduling"] is True  # survival (the default policy) with a confidence head
    _check_schema({k: cfg[k] for k in llmapi.COST_TABLE_SCHEMA["properties"]}, llmapi.COST_TABLE_SCHEMA)
    assert len(cfg["token_counts"]) == len(cfg["step_time_ms"]) and len(cfg["batch_sizes"]) == len(cfg["batch_overhead_ms"])
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"tokens": [1, 8, 64], "seconds": [0.010, 0.011, 0.020], "draft": {"t0": 0.002, "t1": 0.0001}}))
    cfg = llmapi.dspark_decoding_config(BuildOptions(cost_table=str(table), max_batch_size=4), DRAFTER, "/x")
    assert cfg["token_counts"] == [1, 8, 64] and cfg["step_time_ms"] == [10.0, 11.0, 20.0]
    assert cfg["fixed_overhead_ms"] == 2.0 and cfg["batch_sizes"] == [1, 2, 4]
    assert cfg["batch_overhead_ms"] == pytest.approx([2.1, 2.2, 2.4])
    with pytest.raises(BuildError, match="block_size"):
        llmapi.dspark_decoding_config(BuildOptions(max_draft_len=8), DRAFTER, "/x")
    with pytest.raises(BuildError, match="target_layer_ids"):
        llmapi.dspark_decoding_config(BuildOptions(), {"block_size": 7}, "/x")


def test_write_llmapi_files(tmp_path: Path) -> None:
    from dspark_trt.runtime.drafters.loader import default_drafter_dir  # the shipped drafter

    build = tmp_path / "b"
    build.mkdir()
    (build / "manifest.json").write_text(json.dumps({"inputs": {"target": {"path": "/models/SmolLM2-135M"}}}))
    facts = llmapi.write_llmapi(build / "engines" / "llmapi", BuildOptions(), build, default_drafter_dir())
    d = build / "engines" / "llmapi"
    assert {"drafter", "extra_llm_api_options.yaml", "dspark_decoding_config.json", "cost_table.schema.json",
            "trtllm_serve.sh"} <= set(facts["files"])
    assert json.loads((d / "drafter" / "config.json").read_text())["architectures"] == ["DSparkDrafter"]
    opts = yaml.safe_load((d / "extra_llm_api_options.yaml").read_text())
    spec = opts["speculative_config"]
    assert spec == json.loads((d / "dspark_decoding_config.json").read_text())
    assert spec["speculative_model"] == str((d / "drafter").resolve()) and spec["decoding_type"] == "DSpark"
    serve = (d / "trtllm_serve.sh").read_text()
    assert subprocess.run(["bash", "-n", str(d / "trtllm_serve.sh")]).returncode == 0
    argv = shlex.split(serve.splitlines()[-1])
    assert argv[:3] == ["trtllm-serve", "serve", "/models/SmolLM2-135M"]
    assert argv[argv.index("--backend") + 1] == "pytorch"
    assert argv[argv.index("--extra_llm_api_options") + 1] == str((d / "extra_llm_api_options.yaml").resolve())
