"""End to end: build the tiny pair in every quant mode, then generate from the built artifacts.

Lossless: DSpark decoding of the built pair == the runtime's own plain greedy decoding of the same
(quantized) exported target. The unquantized float32 export reproduces Hugging Face greedy output.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_trt.builder.artifacts import load_built_pair
from dspark_trt.builder.options import BuildOptions

MODES = {  # build name → BuildOptions overrides
    "none32": dict(quant="none", dtype="float32"),
    "fp8": dict(quant="fp8", kv_quant="fp8"),
    "int8_sq": dict(quant="int8_sq"),
    "w8a16": dict(quant="w8a16"),
}
PROMPTS = ["def parse_args(argv):\n    ", "import os\nimport sys\n\n"]
NEW = 20


@torch.no_grad()
def plain_greedy(model: torch.nn.Module, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """The runtime's own plain decoding: one token per forward, argmax."""
    cache = model.new_cache(1, len(prompt) + n + 1)
    logits = model(torch.tensor([prompt]), cache, [0], logits="last").logits
    out: list[int] = []
    for _ in range(n):
        t = int(logits[0, -1].argmax())
        out.append(t)
        if t in eos:
            break
        logits = model(torch.tensor([[t]]), cache, [0], logits="last").logits
    return out


def _spec_decode(pair, prompt: list[int], n: int, policy: str) -> list[int]:  # noqa: ANN001
    from dspark_trt.engine import SpeculativeDecodingEngine

    eng = SpeculativeDecodingEngine(pair.target, pair.drafter, tokenizer=pair.tokenizer, max_length=256,
                                    draft_length=pair.options.max_draft_len, policy=policy)
    res = eng.run(prompt, n)
    return list(res.tokens), eng.eos_ids


@pytest.mark.parametrize("name", list(MODES))
def test_build_and_generate_lossless(builds, name: str) -> None:  # noqa: ANN001
    out = builds.get(name, **MODES[name])
    m = json.loads((out / "manifest.json").read_text())
    st = m["stages"]
    assert list(st) == ["validate", "quantize", "export", "verify", "engines", "model_repo"]
    assert m["inputs"]["target"]["files"]["model.safetensors"] and m["packages"]["nvidia-modelopt"] == "0.47.0"
    assert m["packages"]["tensorrt-llm"] is None and st["engines"]["outputs"]["built"] is False
    assert (out / "engines" / "build_engines.sh").is_file() and (out / "model_repo").is_dir()
    assert "version_catch" in st["export"]["outputs"]
    tcfg = json.loads((out / "target" / "checkpoint" / "config.json").read_text())
    assert tcfg["quantization"]["quant_algo"] == BuildOptions(**MODES[name]).quant_algo
    q = st["verify"]["outputs"]["target"]
    assert 0.0 <= q["greedy_agreement"] <= 1.0 and q["ppl_quantized"] > 0
    if name == "none32":
        assert q["greedy_agreement"] == 1.0 and q["ppl_change_pct"] == pytest.approx(0.0, abs=1e-3)
    else:
        assert q["greedy_agreement"] > 0.8, q  # quantized, yet close to the float model
        assert st["quantize"]["outputs"]["target_fake_quant"]["greedy_agreement"] > 0.8
        path = {"fp8": "fp8-emulated", "int8_sq": "torch._int_mm", "w8a16": "torch._weight_int8pack_mm"}[name]
        assert q["linear_paths"] == {path: 8}  # 2 layers × (qkv, dense, fused_fc, proj); lm_head stays float

    # float32 around the quantized kernels: in bf16 a K+1-token verify pass and a 1-token decode step round
    # differently, so a near-tie can flip (docs/build.md); the int8/fp8 arithmetic is the same in both dtypes.
    pair = load_built_pair(out, dtype=torch.float32)
    assert pair.options == BuildOptions.from_dict(m["options"])
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt)["input_ids"]
        got, eos = _spec_decode(pair, ids, NEW, "fixed")
        want = plain_greedy(pair.target, ids, NEW, set(eos))
        assert got == want, (name, prompt)


def test_unquantized_export_equals_hf_greedy(builds, tiny_pair) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = builds.get("none32", **MODES["none32"])
    pair = load_built_pair(out)
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_pair.target)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
        assert plain_greedy(pair.target, ids, NEW, set()) == ref, prompt


def test_rerun_skips_unchanged_stages(builds, tmp_path: Path) -> None:  # noqa: ANN001
    import shutil

    from dspark_trt.builder.pipeline import run_build

    out = builds.get("w8a16", **MODES["w8a16"])
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    opts = builds.options("w8a16", **MODES["w8a16"]).replace(output=str(copy))
    ckpt = copy / "target" / "checkpoint" / "rank0.safetensors"
    mtime = ckpt.stat().st_mtime_ns

    def skipped(m: dict) -> dict[str, bool]:
        return {k: v["skipped"] for k, v in m["stages"].items()}

    m = run_build(opts, quiet=True)  # new BUILD_DIR → only the model repository is redone
    assert skipped(m) == {"validate": False, "quantize": True, "export": True, "verify": True, "engines": True,
                          "model_repo": False}
    m = run_build(opts, quiet=True)
    assert skipped(m)["model_repo"] is True
    m = run_build(opts.replace(max_batch_size=5), quiet=True)  # engine/server flag → engines + repo only
    assert skipped(m) == {"validate": False, "quantize": True, "export": True, "verify": True, "engines": False,
                          "model_repo": False}
    assert ckpt.stat().st_mtime_ns == mtime
    assert m["stages"]["model_repo"]["outputs"]["values"]["MAX_BATCH_SIZE"] == "5"


def test_dspark_drafter_build(builds, tiny_dspark: Path) -> None:  # noqa: ANN001
    """A DSpark drafter: ModelOpt-quantized with real target features, exported as "DSparkDrafter", lossless."""
    from dspark_trt.runtime.drafters import DSparkDrafter

    out = builds.get("dspark_sq", quant="int8_sq", draft=str(tiny_dspark))
    m = json.loads((out / "manifest.json").read_text())
    dcfg = json.loads((out / "draft" / "checkpoint" / "config.json").read_text())
    assert dcfg["architecture"] == "DSparkDrafter" and dcfg["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert "fc" in dcfg["quantization"]["exclude_modules"] and len(dcfg["dspark"]["quantized_modules"]) == 7
    rep = m["stages"]["verify"]["outputs"]["draft"]
    assert rep["proposals"] > 0 and rep["first_token_agreement"] >= 0.5, rep
    assert "dspark" not in m["stages"]["engines"]["outputs"].get("build_configs", [""])[-1]
    pair = load_built_pair(out, dtype=torch.float32)
    assert isinstance(pair.drafter, DSparkDrafter)
    for prompt in PROMPTS[:1]:
        ids = pair.tokenizer(prompt)["input_ids"]
        got, eos = _spec_decode(pair, ids, NEW, "confidence")
        assert got == plain_greedy(pair.target, ids, NEW, set(eos)), prompt


def test_build_puts_the_suffix_corpus_in_the_build(builds, tiny_pair, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """--corpus FILE: the corpus (of this target's vocabulary) lands in the build and the server's loader reads it;
    --corpus auto on a target that is not the embedded default, or none: no corpus; another vocabulary: a clear
    error before anything is written."""
    from types import SimpleNamespace

    import numpy as np

    from dspark_trt.builder.pipeline import run_build
    from dspark_trt.errors import InvalidArgumentError
    from dspark_trt.serve.build_loader import load_build_corpus
    from dspark_trt.spec_decode.corpus import save_corpus

    vocab = json.loads((tiny_pair.target / "config.json").read_text())["vocab_size"]
    good = tmp_path / "good.npz"
    save_corpus(good, np.array([-1, 5, 6, 7, 8, -1, 5, 6, 9, -1], dtype=np.int32), {"vocab_size": vocab})
    out = builds.get("corpus", corpus=str(good), **MODES["none32"])
    m = json.loads((out / "manifest.json").read_text())
    assert m["stages"]["export"]["outputs"]["corpus"]["positions"] == 7
    index = load_build_corpus(SimpleNamespace(build=out), vocab)
    assert index is not None and index.match([1, 5, 6], 2).tokens in ((7, 8), (9,))
    from dspark_trt.cli import main

    capsys.readouterr()
    assert main(["generate", "--build-dir", str(out), "--prompt", "class A:", "--max-new-tokens", "4", "--json",
                 "--policy", "survival", "--proposers", "suffix"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["suffix_corpus_positions"] == 7  # the build's own corpus
    assert main(["generate", "--build-dir", str(out), "--prompt", "class A:", "--max-new-tokens", "4", "--json",
                 "--policy", "survival", "--proposers", "suffix", "--corpus", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["suffix_corpus_positions"] == 0  # --corpus none wins
    plain = builds.get("none32", **MODES["none32"])  # --corpus auto (the default): the tiny target is not the default
    assert not (plain / "corpus.npz").exists() and load_build_corpus(SimpleNamespace(build=plain), vocab) is None
    bad = tmp_path / "bad.npz"
    save_corpus(bad, np.array([-1, 1, 2, -1], dtype=np.int32), {"vocab_size": vocab + 1})
    with pytest.raises(InvalidArgumentError, match="vocabulary of"):
        run_build(builds.options("corpus_bad", corpus=str(bad), **MODES["none32"]), quiet=True)
