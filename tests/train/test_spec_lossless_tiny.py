"""A DSpark drafter in the real spec loop (SpecBackend + spec_decode.loop) on the tiny target: output is lossless."""
from __future__ import annotations

import torch

from dspark_trt.runtime.drafters import load_drafter, save_dspark
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.train.evaluate import measure

from .conftest import make_model


def test_dspark_drafter_lossless_in_spec_loop(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    save_dspark(make_model(tiny_pair, tiny_target, draft_vocab=300), tmp_path / "d", dtype=torch.float32)
    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    drafter = load_drafter(tmp_path / "d", target, dtype=torch.float32, target_dir=tiny_pair.target)
    prompts = [("a", [5, 17, 99, 4, 250]), ("b", list(range(30, 60)))]
    res = measure(target, drafter, prompts, [2, 4], max_new=24, eos=[0])
    for g in (2, 4):
        r = res["by_gamma"][g]
        assert r["lossless_mismatches"] == 0
        assert 1.0 <= r["tau"] <= g + 1 and len(r["acceptance_per_position"]) == g
