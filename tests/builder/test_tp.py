"""Tensor-parallel export: shards reassembled at load equal the unsharded model (ModelOpt's TP split and ours)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_trt.builder import export as ex
from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.tp import reassemble_ranks, shard_state
from dspark_trt.errors import BuildError
from dspark_trt.runtime.trtllm_checkpoint import load_checkpoint_state, load_trtllm_checkpoint


@pytest.fixture(scope="module")
def sq_model(tiny_pair):  # noqa: ANN001, ANN201
    """The tiny target ModelOpt-quantized with INT8 SmoothQuant (calibrated once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_trt.builder import calib, quantize

    tok = AutoTokenizer.from_pretrained(tiny_pair.target)
    m = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).eval()
    quantize.quantize_hf(m, "int8_sq", "fp8", calib.calibration_batches(tok, 4, 64))
    return m


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1 else a[k],
                           b[k].view(torch.uint8) if b[k].element_size() == 1 else b[k]), k


@pytest.mark.parametrize("quantized", [False, True])
def test_modelopt_tp2_reassembles_to_tp1(tiny_pair, sq_model, tmp_path: Path, quantized: bool) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model = sq_model if quantized else AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32)
    outs = {}
    for tp in (1, 2):
        opts = BuildOptions(dtype="bfloat16", tp_size=tp)
        outs[tp] = tmp_path / f"tp{tp}"
        cfg = ex.export_modelopt(model, "LlamaForCausalLM", tiny_pair.target, outs[tp], opts, {})
        assert cfg["mapping"]["tp_size"] == tp
    assert (outs[2] / "rank1.safetensors").is_file() and not (outs[2] / "quant_cfg.json").exists()
    cfg1, s1 = load_checkpoint_state(outs[1])
    cfg2, s2 = load_checkpoint_state(outs[2])  # rank0 + rank1 reassembled
    _states_equal(s1, s2)
    # and the runtime runs the TP checkpoint (all ranks) exactly like the TP=1 one
    ids = torch.randint(0, 512, (1, 12))
    m1, m2 = load_trtllm_checkpoint(outs[1], torch.float32), load_trtllm_checkpoint(outs[2], torch.float32)
    l1 = m1(ids, m1.new_cache(1, 16), [0]).logits
    l2 = m2(ids, m2.new_cache(1, 16), [0]).logits
    assert torch.equal(l1, l2)


def test_own_shard_roundtrip_and_values(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    opts = BuildOptions(dtype="float32", tp_size=2)
    ex.write_unquantized(tiny_pair.target, "LlamaForCausalLM", tmp_path / "c", opts, {})
    cfg, state = load_checkpoint_state(tmp_path / "c")
    from dspark_trt.runtime.hf_loader import hf_to_trtllm_names, load_config
    from safetensors.torch import load_file

    hf = hf_to_trtllm_names(load_file(str(tiny_pair.target / "model.safetensors")), load_config(tiny_pair.target), "t")
    _states_equal(state, {k: v.float() for k, v in hf.items()})
    ranks = [load_file(str(tmp_path / "c" / f"rank{r}.safetensors")) for r in range(2)]
    assert ranks[0]["transformer.layers.0.attention.qkv.weight"].shape[0] == (4 + 2 * 2) * 16 // 2
    # quantized-tensor rules: per-channel scales follow their rows, per-tensor ones are replicated
    synth = dict(state)
    synth["transformer.layers.0.attention.qkv.weights_scaling_factor"] = torch.rand(128)
    synth["transformer.layers.0.mlp.proj.prequant_scaling_factor"] = torch.rand(128)
    synth["transformer.layers.0.mlp.proj.weights_scaling_factor"] = torch.rand(64)
    synth["transformer.layers.0.mlp.fc.activation_scaling_factor"] = torch.rand(1)
    _states_equal(reassemble_ranks(shard_state(synth, cfg, 2), cfg), synth)


def test_tp_must_divide(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(BuildError, match="--tp-size 4 does not divide the key/value heads"):
        ex.write_unquantized(tiny_pair.target, "LlamaForCausalLM", tmp_path / "c", BuildOptions(dtype="float32", tp_size=4), {})


def test_inconsistent_ranks_fail(tiny_pair, tmp_path: Path) -> None:  # noqa: ANN001
    from dspark_trt.errors import CheckpointError

    ex.write_unquantized(tiny_pair.target, "LlamaForCausalLM", tmp_path / "c", BuildOptions(dtype="float32", tp_size=2), {})
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    from safetensors.torch import load_file

    ranks = [load_file(str(tmp_path / "c" / f"rank{r}.safetensors")) for r in range(2)]
    ranks[1]["transformer.ln_f.weight"] = ranks[1]["transformer.ln_f.weight"] + 1
    with pytest.raises(CheckpointError, match="transformer.ln_f.weight differs between rank0 and rank1"):
        reassemble_ranks(ranks, cfg)
