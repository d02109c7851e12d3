"""Every trtllm-build flag, BuildConfig/PluginConfig key, QuantAlgo and checkpoint config key we emit is a
TensorRT-LLM 1.2.1 name (tests/builder/trtllm_1_2_1_names.json, read from the 1.2.x sources)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dspark_trt.builder import trtllm
from dspark_trt.builder.options import KV_QUANT_ALGO, QUANT_ALGO, BuildOptions

NAMES = json.loads((Path(__file__).parent / "trtllm_1_2_1_names.json").read_text())
ALGOS = [None, "FP8", "W8A8_SQ_PER_CHANNEL", "W8A16"]
OPTIONS = [BuildOptions(), BuildOptions(kv_quant="fp8", tp_size=2, max_draft_len=5, dtype="float16")]


def _parse(argv: list[str]) -> dict[str, str | None]:
    """--flag [value] pairs of a trtllm-build argv (store_true flags map to None)."""
    assert argv[0] == "trtllm-build"
    out: dict[str, str | None] = {}
    i = 1
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), f"stray token {flag!r}"
        if flag in NAMES["store_true_flags"]:
            out[flag] = None
            i += 1
        else:
            out[flag] = argv[i + 1]
            i += 2
    return out


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("algo", ALGOS)
def test_trtllm_build_flags_are_121_names(opts: BuildOptions, role: str, algo: str | None) -> None:
    flags = _parse(trtllm.trtllm_build_command(Path("c"), Path("e"), opts, role, algo))
    for flag, value in flags.items():
        assert flag in NAMES["trtllm_build_flags"], flag
        if flag in NAMES["flag_choices"]:
            assert value in NAMES["flag_choices"][flag], (flag, value)
        if flag in NAMES["int_flags"]:
            assert int(value) > 0 or flag == "--max_draft_len", (flag, value)
    if role == "target":  # the draft/target recipe (examples/draft_target_model/README.md)
        assert flags["--speculative_decoding_mode"] == "draft_tokens_external"
        assert int(flags["--max_draft_len"]) == opts.max_draft_len
        assert flags["--use_paged_context_fmha"] == "enable"
        assert set(NAMES["draft_target_recipe"]["target_flags"]) <= set(flags)
    else:
        assert "--speculative_decoding_mode" not in flags
        assert set(NAMES["draft_target_recipe"]["draft_flags"]) <= set(flags)
    assert int(flags["--max_input_len"]) <= int(flags["--max_seq_len"])


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("role", ["target", "draft"])
@pytest.mark.parametrize("algo", ALGOS)
def test_build_config_keys_are_121_names(opts: BuildOptions, role: str, algo: str | None) -> None:
    bc = trtllm.build_config_json(opts, role, algo)
    assert set(bc) <= set(NAMES["build_config_fields"]), set(bc) - set(NAMES["build_config_fields"])
    pc = bc["plugin_config"]
    assert set(pc) <= set(NAMES["plugin_config_fields"]), set(pc) - set(NAMES["plugin_config_fields"])
    assert pc["gpt_attention_plugin"] in NAMES["plugin_dtype_values"]
    assert pc["gemm_plugin"] in NAMES["gemm_plugin_values"]
    assert pc["use_paged_context_fmha"] is True and pc["paged_kv_cache"] is True
    assert bc["kv_cache_type"] in NAMES["kv_cache_type_names"]
    modes = NAMES["speculative_decoding_mode_values"]
    assert bc["speculative_decoding_mode"] == (modes["DRAFT_TOKENS_EXTERNAL"] if role == "target" else modes["NONE"])
    assert bc["max_draft_len"] == (opts.max_draft_len if role == "target" else 0)


def test_quant_algo_names_are_121_names() -> None:
    assert {a for a in QUANT_ALGO.values() if a} <= set(NAMES["quant_algos"])
    assert {a for a in KV_QUANT_ALGO.values() if a} <= set(NAMES["kv_cache_quant_algos"])


def test_engine_plan_without_trtllm(tmp_path: Path) -> None:
    assert trtllm.trtllm_version() is None  # this machine has no TensorRT-LLM
    engines = tmp_path / "b" / "engines"
    opts = BuildOptions(max_draft_len=5)
    facts = trtllm.build_engines(engines, opts, tmp_path / "b/target/checkpoint", tmp_path / "b/draft/checkpoint",
                                 "lm", "FP8", "FP8")
    assert facts["built"] is False and "not importable" in facts["reason"]
    assert "NOT built" in (engines / "NOT_BUILT.txt").read_text()
    script = (engines / "build_engines.sh").read_text()
    assert subprocess.run(["bash", "-n", str(engines / "build_engines.sh")]).returncode == 0
    cmds = [ln for ln in script.splitlines() if ln.startswith("trtllm-build")]
    assert len(cmds) == 2
    for ln in cmds:  # every flag of the script is a 1.2.1 flag
        for flag in re.findall(r"(--[a-z_]+)", ln):
            assert flag in NAMES["trtllm_build_flags"], flag
    tgt = json.loads((engines / "target.build_config.json").read_text())
    assert tgt["max_draft_len"] == 5 and tgt["speculative_decoding_mode"] == 2
    # a DSpark drafter has no TRT-LLM model class: no draft command, and it says why; the target is the tapped
    # target, built through the Python API (tests/builder/test_trtllm_taps.py)
    facts = trtllm.build_engines(tmp_path / "c" / "engines", opts, tmp_path / "t", tmp_path / "d", "dspark", None, None,
                                 (0, 1))
    script = (tmp_path / "c/engines/build_engines.sh").read_text()
    assert script.count("trtllm-build --") == 0 and "DSparkDrafter" in script and "--tap_layers 0,1" in script
    assert "not buildable" in facts["draft_engine"] and facts["tap_outputs"] == ["dspark_tap_0", "dspark_tap_1"]


MODELOPT_EXTRAS = {"producer", "rank", "decoder", "rmsnorm", "lm_head_bias", "share_embedding_table", "residual_mlp",
                   "bias", "rotary_pct", "dspark"}  # accepted by PretrainedConfig's implicit setattr (see names file)


@pytest.mark.parametrize("which, quant", [("target", "fp8"), ("qwen2", "none"), ("target32", "none")])
def test_exported_checkpoint_keys_are_121_names(tiny_pair, tmp_path: Path, which: str, quant: str) -> None:  # noqa: ANN001
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_trt.builder import calib, export, quantize

    src = tiny_pair.qwen2 if which == "qwen2" else tiny_pair.target
    arch = "Qwen2ForCausalLM" if which == "qwen2" else "LlamaForCausalLM"
    out = tmp_path / "ckpt"
    if which == "target32":
        cfg = export.write_unquantized(src, arch, out, BuildOptions(dtype="float32"), {})
    else:
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        if quant != "none":
            quantize.quantize_hf(m, quant, "fp8", calib.calibration_batches(AutoTokenizer.from_pretrained(src), 2, 32))
        cfg = export.export_modelopt(m, arch, src, out, BuildOptions(dtype="bfloat16", quant=quant), {})
    known = set(NAMES["pretrained_config_keys"]) | set(NAMES["llama_config_keys"]) | set(NAMES["qwen_config_keys"])
    assert set(cfg) - known - MODELOPT_EXTRAS == set()
    assert {"architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_size", "intermediate_size", "norm_epsilon", "rotary_base", "mapping",
            "quantization", "position_embedding_type", "hidden_act"} <= set(cfg)
    assert cfg["position_embedding_type"] in NAMES["position_embedding_types"]
    assert set(cfg["mapping"]) <= set(NAMES["mapping_keys"])
    assert set(cfg["quantization"]) <= set(NAMES["quant_config_fields"])
    assert cfg["quantization"]["quant_algo"] in NAMES["quant_algos"] + [None]
    assert cfg["quantization"].get("kv_cache_quant_algo") in NAMES["kv_cache_quant_algos"] + [None]
    if which == "qwen2":
        assert cfg["qwen_type"] in NAMES["qwen_types"] and cfg["attn_bias"] is True
    hf_theta = json.loads((src / "config.json").read_text())["rope_parameters"]["rope_theta"]
    assert cfg["rotary_base"] == hf_theta
    pats = [re.compile("^" + re.escape(n).replace(r"\{i\}", r"\d+").rsplit(r"\.", 1)[0]
                       + r"\.(weight|bias|" + "|".join(NAMES["quantized_tensor_suffixes"]) + r")$")
            for n in NAMES["llama_weight_names"]]
    pats.append(re.compile(r"^transformer\.layers\.\d+\.attention\.kv_cache_scaling_factor$"))
    # ModelOpt 0.47 also writes these (not 1.2.1 names: the documented version catch; TRT-LLM warns and ignores)
    extra = re.compile(r"^transformer\.layers\.\d+\.attention\.[kv]_cache_scaling_factor$")
    with safe_open(str(out / "rank0.safetensors"), "pt") as f:
        for key in f.keys():
            assert any(p.match(key) for p in pats) or extra.match(key), key
