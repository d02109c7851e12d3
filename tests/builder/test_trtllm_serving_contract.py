"""The GPU-host repository (model_repo_trtllm/) against TensorRT-LLM 1.2.x's tensorrtllm backend interface
(tests/builder/trtllm_1_2_triton_names.json, read from triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/
config.pbtxt and the BLS draft-target code; commits in its _comment): every tensor name / dtype / dims / reshape /
optional flag and every parameter key and value of our target/draft configs, the tensors the dspark scheduler sends
and reads, the engines those configs point at, and the repository layout the build writes."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from dspark_trt.builder import trtllm
from dspark_trt.builder.model_repo import (TEMPLATE_DIR, TRTLLM_TEMPLATE_DIR, fill_model_repo, fill_trtllm_repo,
                                           template_values)
from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.pipeline import check_serving
from dspark_trt.errors import BuildError, InvalidArgumentError
from dspark_trt.serve.gpu_host.bls import INPUT_DTYPES, OUTPUT_NAMES

NAMES = json.loads((Path(__file__).parent / "trtllm_1_2_triton_names.json").read_text())
SPEC = BuildOptions(max_batch_size=6, max_draft_len=5, max_seq_len=300, max_queue=9, serving="both")
NP_TYPES = {"int32": "TYPE_INT32", "bool": "TYPE_BOOL", "float32": "TYPE_FP32", "uint64": "TYPE_UINT64"}
_TENSOR = re.compile(r'^\s*\{ name: "(\w+)" data_type: (\w+) dims: \[([^\]]*)\](.*)\},?$', re.M)  # one per line


def _tensors(text: str, section: str) -> dict[str, dict]:
    body = text.split(f"\n{section} [")[1].split("\n]")[0]
    out = {}
    for m in _TENSOR.finditer(body):
        rest = m.group(4)
        out[m.group(1)] = {"data_type": m.group(2), "dims": [int(x) for x in m.group(3).split(",")],
                           "optional": "optional: true" in rest, "reshape": "reshape" in rest,
                           "ragged": "allow_ragged_batch: true" in rest}
    assert len(out) == body.count("name:"), f"unparsed tensor lines in {section}"
    return out


def _params(text: str) -> dict[str, str]:
    return dict(re.findall(r'parameters: \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', text))


def _source(section: str) -> dict[str, dict]:
    return {e["name"]: e for e in NAMES[section]}


@pytest.fixture(scope="module", params=["target", "draft"])
def config(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param, (TRTLLM_TEMPLATE_DIR / request.param / "config.pbtxt").read_text()


def test_tensors_are_the_121_declarations(config: tuple[str, str]) -> None:
    _, text = config
    for section, src in (("input", _source("inputs")), ("output", _source("outputs"))):
        ours = _tensors(text, section)
        assert set(ours) == set(src), (section, set(ours) ^ set(src))  # the whole interface, no more, no less
        for name, t in ours.items():
            s = src[name]
            want = s["data_type"]
            if want.startswith("${"):
                assert t["data_type"] in NAMES["template_dtype_choices"][want], (name, t["data_type"])
            else:
                assert t["data_type"] == want, name
            assert t["dims"] == s["dims"], name
            if section == "input":
                assert t["optional"] == bool(s.get("optional")), name
                assert t["reshape"] == ("reshape" in s), name
                assert t["ragged"] == bool(s.get("allow_ragged_batch")), name
    assert _tensors(text, "output")["generation_logits"]["data_type"] == "TYPE_FP32"  # logits_datatype as the recipe


def test_parameters_are_121_names_and_values(config: tuple[str, str]) -> None:
    role, text = config
    assert re.search(r'^name: "%s"$' % role, text, re.M) and re.search(r'^backend: "tensorrtllm"$', text, re.M)
    assert "decoupled: false" in text  # the draft-target recipe's decoupled_mode False (BLS exec, one response)
    assert "max_queue_delay_microseconds: 0" in text
    params = _params(text)
    assert params and set(params) <= set(NAMES["parameters"]), set(params) - set(NAMES["parameters"])
    for key, value in params.items():
        if key in NAMES["parameter_values"]:
            assert value in NAMES["parameter_values"][key], (key, value)
        if key in NAMES["parameter_floats_0_1"]:
            assert 0.0 < float(value) <= 1.0, (key, value)
    recipe = NAMES["draft_target_recipe"]
    assert params["gpt_model_type"] == recipe["batching_strategy"] == "inflight_fused_batching"
    assert params["max_beam_width"] == recipe["max_beam_width"]
    assert params["enable_kv_cache_reuse"] == recipe["enable_kv_cache_reuse"].lower() == "true"
    assert params["exclude_input_in_output"] == recipe["exclude_input_in_output"].lower() == "true"
    assert params["gpt_model_path"] == "${BUILD_DIR}/engines/" + role


def test_engine_dirs_match_the_engine_build(tmp_path: Path) -> None:
    """gpt_model_path points where engines/build_engines.sh (and the in-container build) write each engine, and the
    target engine can verify γ external draft tokens and return generation logits."""
    engines = tmp_path / "b" / "engines"
    trtllm.build_engines(engines, SPEC, tmp_path / "b/target/checkpoint", tmp_path / "b/draft/checkpoint", "lm",
                         None, None)
    script = (engines / "build_engines.sh").read_text()
    for role in ("target", "draft"):
        path = _params((TRTLLM_TEMPLATE_DIR / role / "config.pbtxt").read_text())["gpt_model_path"]
        assert f'--output_dir "{path.replace("${BUILD_DIR}", "$BUILD_DIR")}"' in script, role
    bc = trtllm.build_config(SPEC, "target", None)
    assert bc["speculative_decoding_mode"] == "draft_tokens_external" and bc["max_draft_len"] == SPEC.gamma
    assert bc["gather_generation_logits"] is True  # the confidence policy reads generation_logits
    assert bc["plugin_config"]["use_paged_context_fmha"] is True  # KV-cache reuse (recipe)
    assert set(NAMES["draft_target_recipe"]["engine_build"][:2]) <= {
        f"--{k}={v}" for k, v in (("use_paged_context_fmha", "enable"),
                                  ("speculative_decoding_mode", "draft_tokens_external"))}


def test_scheduler_tensors_are_declared() -> None:
    """What serve.gpu_host.bls sends and reads: 1.2.x names and dtypes, names the BLS draft-target code uses too, and
    declared in our configs; request_output_len = K + 1 is the BLS rule."""
    src_in, src_out = _source("inputs"), _source("outputs")
    ours_in = _tensors((TRTLLM_TEMPLATE_DIR / "target" / "config.pbtxt").read_text(), "input")
    for name, dtype in INPUT_DTYPES.items():
        assert name in src_in and name in NAMES["bls_llm_inputs"] and name in ours_in, name
        assert NP_TYPES[np.dtype(dtype).name] == ours_in[name]["data_type"], name
        assert len(ours_in[name]["dims"]) == 1, name  # sent as [1, n]: batch dim + the declared rank
    for name in OUTPUT_NAMES:
        assert name in src_out and name in NAMES["bls_llm_outputs"], name
    assert not src_in["input_lengths"].get("optional") and not src_in["request_output_len"].get("optional")
    assert {"input_ids", "input_lengths", "request_output_len"} <= set(INPUT_DTYPES)
    assert NAMES["bls_verify_request_output_len"] == "len(draft_input_ids) + 1"


def test_trtllm_repository_layout(tmp_path: Path) -> None:
    fill_model_repo(SPEC, tmp_path)
    facts = fill_trtllm_repo(SPEC, tmp_path)
    ref, repo = tmp_path / "model_repo", tmp_path / "model_repo_trtllm"
    assert sorted(p.name for p in repo.iterdir()) == sorted(p.name for p in ref.iterdir())  # same models
    for f in ref.rglob("*"):  # every model but target/draft (tensorrtllm) and dspark's adapter is model_repo/'s
        rel = f.relative_to(ref)
        if f.is_file() and rel.parts[0] not in ("target", "draft") and rel != Path("dspark/1/model.py"):
            assert (repo / rel).read_bytes() == f.read_bytes(), rel
    for role in ("target", "draft"):  # replaced whole: no python model left in a tensorrtllm model's directory
        assert not (repo / role / "1" / "model.py").exists()
    assert "TrtllmDsparkModel" in (repo / "dspark" / "1" / "model.py").read_text()
    assert not list(repo.rglob("STANDIN*")) and "trtllm_standin" not in "".join(
        p.read_text() for p in repo.rglob("*") if p.is_file())  # the testing stand-in is never shipped
    values = template_values(SPEC, tmp_path)
    tgt = (repo / "target" / "config.pbtxt").read_text()
    assert "${" not in tgt and f"max_batch_size: {values['MAX_BATCH_SIZE']}" in tgt
    assert _params(tgt)["gpt_model_path"] == f"{values['BUILD_DIR']}/engines/target"
    assert (repo / "target" / "1").is_dir() and (repo / "draft" / "1").is_dir()
    assert facts["path"] == "model_repo_trtllm" and "target/config.pbtxt" in facts["filled"]
    fill_trtllm_repo(SPEC, tmp_path / "nodraft", draft_engine=False)
    assert not (tmp_path / "nodraft" / "model_repo_trtllm" / "draft").exists()


def test_serving_option_and_dspark_drafters() -> None:
    assert BuildOptions().serving == "reference"
    assert BuildOptions(serving="both").serves_trtllm and BuildOptions(serving="both").serves_reference
    with pytest.raises(InvalidArgumentError, match="--serving"):
        BuildOptions(serving="engines")
    for serving in ("reference", "trtllm", "both"):  # DSpark pairs too: the tapped target (docs/gpu.md)
        for kind in ("lm", "dspark"):
            check_serving(BuildOptions(serving=serving), kind)
    with pytest.raises(BuildError, match="drafter kind"):
        check_serving(BuildOptions(serving="trtllm"), "medusa")


def test_templates_are_package_data() -> None:
    py = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    globs = py["tool"]["setuptools"]["package-data"]["dspark_trt"]
    assert "model_repo_trtllm/**/*" in globs and "model_repo/**/*" in globs
    assert TRTLLM_TEMPLATE_DIR.parent == TEMPLATE_DIR.parent


@pytest.mark.parametrize("serving, kind, repos", [("reference", "lm", ["model_repo"]),
                                                  ("trtllm", "lm", ["model_repo_trtllm"]),
                                                  ("both", "lm", ["model_repo", "model_repo_trtllm"]),
                                                  ("both", "dspark", ["model_repo", "model_repo_trtllm"]),
                                                  ("trtllm", "dspark", ["model_repo_trtllm"])])
def test_model_repo_stage_per_serving(tmp_path: Path, serving: str, kind: str, repos: list[str]) -> None:
    from types import SimpleNamespace

    from dspark_trt.builder.pipeline import BuildPipeline

    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"target_layer_ids": [0, 1]}))
    pipe = BuildPipeline(BuildOptions(serving=serving, output=str(tmp_path / "b")), quiet=True)
    facts = pipe._model_repos(SimpleNamespace(draft_kind=kind, draft=draft))  # noqa: SLF001 - the stage's own facts
    assert facts["paths"] == repos and sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(repos)
    assert facts["values"]["GAMMA"] == str(BuildOptions().gamma) and facts["serving"] == serving
    if "model_repo_trtllm" in repos:
        repo = tmp_path / "b" / "model_repo_trtllm"
        assert (repo / "draft").exists() == (kind == "lm")  # DSpark: no draft engine, the tapped target
        cfg = (repo / "target" / "config.pbtxt").read_text()
        assert ('name: "dspark_tap_0"' in cfg and 'name: "dspark_tap_1"' in cfg) == (kind == "dspark")
