"""Build-test fixtures: a tiny DSpark drafter for the tiny target, and cached builds of the tiny pair per mode."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dspark_trt.builder.options import BuildOptions

FAST = dict(calib_samples=4, calib_seq_len=64, eval_tokens=128, max_seq_len=256, max_draft_len=4, bench=False)


@pytest.fixture(scope="session")
def tiny_dspark(tiny_pair, tmp_path_factory) -> Path:  # noqa: ANN001
    """A randomly initialised 1-layer DSpark drafter for the tiny target (taps 0, 1; γ = 4)."""
    from dspark_trt.runtime.drafters import DSparkModel, save_dspark
    from dspark_trt.train.model_init import new_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32)
    emb = hf.get_input_embeddings().weight
    cfg = new_config(tiny_pair.target, (0, 1), num_layers=1, gamma=4, markov_rank=8, draft_vocab_size=0,
                     embed_weight=emb)
    m = DSparkModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        m.mask_embedding.normal_(0, 1.0)
    return save_dspark(m, tmp_path_factory.mktemp("dspark") / "drafter", dtype=torch.float32)


class Builds:
    """Builds of the tiny pair, made once per session and shared by the tests that read them."""

    def __init__(self, root: Path, tiny_pair) -> None:  # noqa: ANN001
        self.root, self.pair, self.done = root, tiny_pair, {}

    def options(self, name: str, **kw: object) -> BuildOptions:
        args = dict(FAST, target=str(self.pair.target), draft=str(self.pair.draft), output=str(self.root / name))
        args.update(kw)
        return BuildOptions(**args)

    def get(self, name: str, **kw: object) -> Path:
        if name not in self.done:
            from dspark_trt.builder.pipeline import run_build

            run_build(self.options(name, **kw), quiet=True)
            self.done[name] = self.root / name
        return self.done[name]


@pytest.fixture(scope="session")
def builds(tiny_pair, tmp_path_factory) -> Builds:  # noqa: ANN001
    logging.getLogger("dspark_trt").setLevel(logging.WARNING)
    return Builds(tmp_path_factory.mktemp("builds"), tiny_pair)
