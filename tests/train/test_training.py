"""Training on the tiny target: a few steps reduce the loss; the CLI trains, calibrates, exports, resumes."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from dspark_trt.runtime.drafters import DSparkDrafter, load_drafter
from dspark_trt.testing.tiny import corpus_files
from dspark_trt.train.batches import eligible, make_batch
from dspark_trt.train.corpus import load_corpus
from dspark_trt.train.features import cache_features
from dspark_trt.train.loss import make_t2d
from dspark_trt.train.trainer import TrainConfig, forward_loss

from .conftest import make_model


def _store(tiny_pair, tiny_target, tmp_path):  # noqa: ANN001, ANN202
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair.tokenizer)
    seqs, starts = load_corpus(corpus_files(3), tok, max_tokens=3000, window=96)
    return cache_features(tiny_target, seqs, starts, tmp_path / "f", topk=8, max_len=96)


def test_few_steps_reduce_loss(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    st = _store(tiny_pair, tiny_target, tmp_path)
    assert st.features.shape[1] == 128 and st.tokens.shape[0] == st.offsets[-1]
    m = make_model(tiny_pair, tiny_target, draft_vocab=0)
    cfg = TrainConfig(gamma=4, anchors=8, batch_seqs=4, max_len=96, autocast_bf16=False)
    refs = eligible([st], cfg.gamma)
    b = make_batch([st], refs[:4], np.random.default_rng(0), cfg.anchors, cfg.gamma, cfg.max_len)
    t2d = make_t2d(m.d2t, 512)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = float(forward_loss(m, b, t2d, cfg)[0].total.detach())
    for _ in range(15):
        lo = forward_loss(m, b, t2d, cfg)[0]
        opt.zero_grad()
        lo.total.backward()
        opt.step()
    assert float(forward_loss(m, b, t2d, cfg)[0].total.detach()) < 0.8 * first


def test_cli_trains_calibrates_exports_and_resumes(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    from dspark_trt.cli import main

    files = [str(p) for p in corpus_files(3)]
    argv = ["train-drafter", "--target", str(tiny_pair.target), "--corpus", *files, "--out", str(tmp_path / "o"),
            "--gamma", "4", "--layers", "0,1", "--num-layers", "1", "--markov-rank", "8", "--draft-vocab", "256",
            "--max-steps", "6", "--max-tokens", "4000", "--batch-seqs", "2", "--anchors", "4", "--seed", "3"]
    assert main(argv) == 0
    met = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert met["steps"] == 6 and len(met["calibration"]["temperatures"]) == 4
    d = load_drafter(tmp_path / "o" / "drafter", tiny_target.model, dtype=torch.float32)
    assert isinstance(d, DSparkDrafter) and d.cfg.draft_vocab_size == 256
    assert d.cfg.confidence_temperatures == tuple(met["calibration"]["temperatures"])
    argv[argv.index("--max-steps") + 1] = "8"
    assert main(argv + ["--resume"]) == 0
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["steps"] == 8


def test_cli_init_from_continues_from_a_drafter_checkpoint(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    """--init-from starts a new run from exported weights (train_state.pt gone): same d2t, other weights move on;
    a block size that does not match is refused with the fix."""
    from safetensors.torch import load_file

    from dspark_trt.cli import main

    files = [str(p) for p in corpus_files(3)]
    argv = ["train-drafter", "--target", str(tiny_pair.target), "--corpus", *files, "--gamma", "4", "--layers", "0,1",
            "--num-layers", "1", "--markov-rank", "8", "--draft-vocab", "256", "--max-steps", "4", "--max-tokens",
            "4000", "--batch-seqs", "2", "--anchors", "4", "--seed", "3"]
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    first = load_file(str(tmp_path / "a" / "drafter" / "model.safetensors"))
    assert main(argv + ["--out", str(tmp_path / "b"), "--init-from", str(tmp_path / "a" / "drafter"),
                        "--loss-ce", "1", "--loss-l1", "0.2"]) == 0  # a greedy-weighted loss, recorded with the run
    second = load_file(str(tmp_path / "b" / "drafter" / "model.safetensors"))
    loss_cfg = json.loads((tmp_path / "b" / "metrics.json").read_text())["config"]["loss"]
    assert (loss_cfg["ce"], loss_cfg["l1"]) == (1.0, 0.2)
    assert torch.equal(first["d2t"], second["d2t"])
    assert not torch.equal(first["fc.weight"], second["fc.weight"])  # trained further
    bad = argv + ["--out", str(tmp_path / "c"), "--init-from", str(tmp_path / "a" / "drafter")]
    bad[bad.index("--gamma") + 1] = "5"
    assert main(bad) != 0
    assert main(argv + ["--out", str(tmp_path / "d"), "--loss-l1", "-1"]) != 0  # refused, with the fix


def test_loss_weights_weigh_the_terms_and_refuse_nonsense() -> None:
    """LossWeights: total = ce·CE + l1·L1 + bce·BCE for any weights given; negative or all-zero weights are refused."""
    import pytest

    from dspark_trt.errors import InvalidArgumentError
    from dspark_trt.train.loss import LossWeights, dspark_loss

    g = torch.Generator().manual_seed(0)
    logits, conf = torch.randn(3, 4, 32, generator=g), torch.randn(3, 4, generator=g)  # [N, γ, Vd], [N, γ]
    ids = torch.stack([torch.randperm(32, generator=g)[:5] for _ in range(12)]).reshape(3, 4, 5)  # [N, γ, k]
    logp = torch.log_softmax(torch.randn(3, 4, 5, generator=g), -1) - 0.1  # top-k log-probs, some tail mass
    t2d, valid = torch.arange(32), torch.ones(3, 4, dtype=torch.bool)
    for w in (LossWeights(), LossWeights(ce=1.0, l1=0.2), LossWeights(ce=1.0, l1=0.0, bce=0.0)):
        lo = dspark_loss(logits, conf, ids, logp, t2d, valid, w)
        assert torch.allclose(lo.total, w.ce * lo.ce + w.l1 * lo.l1 + w.bce * lo.bce)
    assert torch.allclose(dspark_loss(logits, conf, ids, logp, t2d, valid, LossWeights(1.0, 0.0, 0.0)).total,
                          -torch.log_softmax(logits, -1).gather(-1, ids[..., :1]).mean())  # pure CE on the top-1
    for bad in (dict(l1=-0.1), dict(ce=0.0, l1=0.0), dict(decay=0.0)):
        with pytest.raises(InvalidArgumentError, match="loss weights"):
            LossWeights(**bad)
