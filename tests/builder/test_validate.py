"""Validate-stage errors: each failure is a DsparkError whose message names the problem (and the file) + the fix."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.validate import validate
from dspark_trt.errors import (BuildError, CheckpointError, InvalidArgumentError, UnsupportedArchitectureError,
                               VocabularyMismatchError)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _spec(tiny_pair, tmp_path: Path, target: Path | None = None, draft: Path | None = None) -> BuildOptions:  # noqa: ANN001
    return BuildOptions(target=str(target or tiny_pair.target), draft=str(draft or tiny_pair.draft),
                     output=str(tmp_path / "out"))


def test_valid_pair(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    v = validate(_spec(tiny_pair, tmp_path), tmp_path / "out")
    assert v.target_arch == "LlamaForCausalLM" and v.draft_kind == "lm" and v.input_bytes > 0


def test_vocab_size_mismatch(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    d = _copy(tiny_pair.draft, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 600
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VocabularyMismatchError) as e:
        validate(_spec(tiny_pair, tmp_path, draft=d), tmp_path / "out")
    msg = str(e.value)
    assert msg.startswith("The draft model and target model must have the same vocabulary")
    assert "600" in msg and "512" in msg


def test_special_token_mismatch(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    d = _copy(tiny_pair.draft, tmp_path / "d")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|im_end|>"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(VocabularyMismatchError, match="^The draft model and target model must have the same "
                                                      "vocabulary.*eos_token_id"):
        validate(_spec(tiny_pair, tmp_path, draft=d), tmp_path / "out")


def test_truncated_safetensors_is_named(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    t = _copy(tiny_pair.target, tmp_path / "t")
    f = t / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated.*re-download"):
        validate(_spec(tiny_pair, tmp_path, target=t), tmp_path / "out")


def test_corrupt_safetensors_header_is_named(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    d = _copy(tiny_pair.draft, tmp_path / "d")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"/d/model\.safetensors has a corrupt safetensors header"):
        validate(_spec(tiny_pair, tmp_path, draft=d), tmp_path / "out")


def test_unreadable_config(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    t = _copy(tiny_pair.target, tmp_path / "t")
    (t / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        validate(_spec(tiny_pair, tmp_path, target=t), tmp_path / "out")


def test_missing_dir_and_tokenizer(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(CheckpointError, match="does not exist.*--target"):
        validate(_spec(tiny_pair, tmp_path, target=tmp_path / "nope"), tmp_path / "out")
    t = _copy(tiny_pair.target, tmp_path / "t")
    (t / "tokenizer.json").unlink()
    (t / "tokenizer_config.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer"):
        validate(_spec(tiny_pair, tmp_path, target=t), tmp_path / "out")


def test_unsupported_architecture(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    t = _copy(tiny_pair.target, tmp_path / "t")
    cfg = json.loads((t / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        validate(_spec(tiny_pair, tmp_path, target=t), tmp_path / "out")


def test_not_enough_disk(tiny_pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import shutil as sh
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10, 10, 1024))
    with pytest.raises(BuildError, match="Not enough disk.*--output"):
        validate(_spec(tiny_pair, tmp_path), tmp_path / "out")


def test_dspark_drafter_vocab_checked(tiny_pair, tiny_dspark: Path, tmp_path: Path) -> None:  # noqa: ANN001
    opts = _spec(tiny_pair, tmp_path, draft=tiny_dspark)
    with pytest.raises(BuildError, match="--max-draft-len 7 exceeds the DSpark drafter's block size 4"):
        validate(opts, tmp_path / "out")
    v = validate(opts.replace(max_draft_len=4), tmp_path / "out")
    assert v.draft_kind == "dspark"
    d = _copy(tiny_dspark, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["target_vocab"]["size"] = 999
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VocabularyMismatchError, match="^The draft model and target model must have the same vocabulary"):
        validate(_spec(tiny_pair, tmp_path, draft=d).replace(max_draft_len=4), tmp_path / "out")


def test_cli_reports_error_without_traceback(tiny_pair, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    from dspark_trt.cli import main

    rc = main(["build", "--target", str(tmp_path / "missing"), "--draft", str(tiny_pair.draft), "--output",
               str(tmp_path / "o")])
    assert rc == 2


@pytest.mark.parametrize("kw, needle", [({"quant": "int4"}, "--quant"), ({"dtype": "fp64"}, "--dtype"),
                                        ({"tp_size": 3}, "--tp-size"), ({"max_k": 99}, "--max-k"),
                                        ({"kv_quant": "int8"}, "--kv-quant"), ({"max_seq_len": 4}, "--max-seq-len")])
def test_bad_options(kw: dict, needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        BuildOptions(**kw)


def test_policy_seed_is_stored_as_confidence() -> None:
    assert BuildOptions(policy="seed").policy == "confidence"
    assert BuildOptions().policy == "survival"  # the served default: never slower than plain decoding
    assert BuildOptions.from_dict({"policy": "seed"}) == BuildOptions(policy="confidence")  # pre-rename manifests
    with pytest.raises(InvalidArgumentError, match="--policy"):
        BuildOptions(policy="seeds")
