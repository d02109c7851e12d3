"""Fixtures for drafter/training tests: the tiny HF target with taps and a fresh tiny DSpark drafter."""
from __future__ import annotations

import pytest
import torch

from dspark_trt.runtime.drafters import DSparkModel
from dspark_trt.train.features import HFTarget
from dspark_trt.train.model_init import new_config


@pytest.fixture(scope="session")
def tiny_target(tiny_pair) -> HFTarget:  # noqa: ANN001
    torch.manual_seed(0)
    return HFTarget.load(tiny_pair.target, (0, 1), dtype=torch.float32)


def make_model(tiny_pair, tiny_target, draft_vocab: int = 0, markov_rank: int = 8, gamma: int = 4,  # noqa: ANN001
               seed: int = 0) -> DSparkModel:
    torch.manual_seed(seed)
    emb = tiny_target.model.get_input_embeddings().weight
    cfg = new_config(tiny_pair.target, (0, 1), num_layers=1, gamma=gamma, markov_rank=markov_rank,
                     draft_vocab_size=draft_vocab, embed_weight=emb)
    m = DSparkModel(cfg)
    with torch.no_grad():  # make the Markov head and mask embedding non-trivial
        if cfg.has_markov:
            m.markov_w2.weight.normal_(0, 0.5)
        m.mask_embedding.normal_(0, 1.0)
    m.attach_target(emb, tiny_target.model.get_output_embeddings().weight)
    return m
