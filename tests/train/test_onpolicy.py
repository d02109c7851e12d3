"""train.onpolicy on the tiny pair: the rolled-out greedy loop's path (anchors, accepted drafts) from teacher-forced
blocks, the reach weights, on-policy batches, and a training run that mixes them with replay."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.train.batches import eligible
from dspark_trt.train.features import RuntimeTarget, cache_features
from dspark_trt.train.onpolicy import (OnPolicyConfig, acceptance_at_every_anchor, onpolicy_batch, path_tau,
                                       reach_weights, rollout)
from tests.train.conftest import make_model


@pytest.fixture(scope="module")
def store(tiny_pair, tmp_path_factory):  # noqa: ANN001, ANN201
    rt = RuntimeTarget.load(tiny_pair.target, (0, 1), dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(5, 300, (int(n),), generator=g).tolist() for n in torch.randint(20, 60, (8,), generator=g)]
    return cache_features(rt, seqs, [4] * len(seqs), tmp_path_factory.mktemp("op") / "f", topk=4, batch_tokens=256)


def test_reach_weights_follow_the_loop() -> None:
    w = reach_weights(np.array([0, 2, 4]), 4, 3.0)
    assert w.tolist() == [[3, 0, 0, 0], [1, 1, 3, 0], [1, 1, 1, 1]]


def test_rollout_walks_the_greedy_loop_path(tiny_pair, tiny_target, store) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target, draft_vocab=128, gamma=4).eval()
    refs = eligible([store], 4)
    paths = rollout(m, [store], refs, 4, max_len=512, autocast_bf16=False)
    assert len(paths) == len(refs)
    for p in paths:
        a0, b0 = store.seq(p.ref.index)
        assert p.anchors[0] == int(store.start[p.ref.index]) and (0 <= p.accepted).all() and (p.accepted <= 4).all()
        assert (np.diff(p.anchors) == p.accepted[:-1] + 1).all() and p.anchors[-1] <= p.length - 5
        feats = store.feature_rows(a0, b0)[None]
        toks = torch.from_numpy(store.tokens[a0:b0].astype(np.int64))[None]
        acc = acceptance_at_every_anchor(m, feats, toks, int(p.anchors[0]), 4, chunk=3)
        assert (acc[p.anchors] == p.accepted).all()  # chunking does not change a block
        for a in p.anchors[:3]:  # each block's accepted count: leading drafts equal to the sequence
            _, logits, _ = m.forward_train(feats, toks, torch.tensor([[int(a)]]), 4)
            draft = m.d2t[logits.argmax(-1)[0, 0]]
            same = (draft == toks[0, int(a) + 1:int(a) + 5]).long().cumprod(0).sum()
            assert int(same) == int(acc[a])
    assert path_tau(paths) >= 1.0
    b = onpolicy_batch([store], paths, np.random.default_rng(0), 3, 5, 4, 2.0)
    assert b.valid.dtype == torch.float32 and b.valid.shape == (3, 5, 4) and set(b.valid.unique().tolist()) <= {0, 1, 2}


def test_on_policy_settings_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="Fix"):
        OnPolicyConfig(frac=1.5)


def test_cli_on_policy_phase_trains_and_records_its_rollouts(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    from dspark_trt.cli import main
    from dspark_trt.testing.tiny import corpus_files

    argv = ["train-drafter", "--target", str(tiny_pair.target), "--corpus", *map(str, corpus_files(3)), "--out",
            str(tmp_path / "o"), "--gamma", "4", "--layers", "0,1", "--num-layers", "1", "--markov-rank", "8",
            "--draft-vocab", "256", "--max-steps", "6", "--max-tokens", "4000", "--batch-seqs", "2", "--anchors", "4",
            "--onpolicy-every", "3", "--onpolicy-start", "2", "--onpolicy-frac", "1.0"]
    assert main(argv) == 0
    met = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert met["steps"] == 6 and [r["step"] for r in met["onpolicy_rollouts"]] == [2, 5]
    assert all(r["paths"] > 0 and r["loop_tau"] >= 1.0 for r in met["onpolicy_rollouts"])
    # the held-out loop path, walked once at the end: τ along the loop's own anchors, never above uniform τ_tf's
    # ceiling of γ + 1
    assert met["heldout_paths"] > 0 and 1.0 <= met["heldout_path_tau"] <= 5.0
