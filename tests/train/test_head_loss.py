"""train.head_loss: the chunked log-probs at the teacher's top-k give the loss, the accuracy and every gradient of
the reference path (forward_train's full logits → log_softmax → gather), in fp32 and under bf16 autocast."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dspark_trt.train.batches import eligible, make_batch
from dspark_trt.train.features import cache_features
from dspark_trt.train.head_loss import draft_logprobs
from dspark_trt.train.loss import make_t2d
from dspark_trt.train.trainer import TrainConfig, forward_loss

from .conftest import make_model


@pytest.fixture(scope="module")
def batch(tiny_pair, tiny_target, tmp_path_factory):  # noqa: ANN001, ANN201
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(30, 70, (6,), generator=g)]
    st = cache_features(tiny_target, seqs, [6] * len(seqs), tmp_path_factory.mktemp("hl") / "f", topk=6, max_len=96)
    refs = eligible([st], 4)
    return make_batch([st], refs[:4], np.random.default_rng(1), 8, 4, 96)


def _grads(model, b, t2d, cfg):  # noqa: ANN001, ANN202
    model.zero_grad(set_to_none=True)
    lo, draft, _ = forward_loss(model, b, t2d, cfg)
    lo.total.backward()
    return lo, draft, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("draft_vocab,markov", [(256, 8), (0, 0)])
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_head_equals_the_full_logits_path(tiny_pair, tiny_target, batch, draft_vocab, markov, autocast) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target, draft_vocab=draft_vocab, markov_rank=markov, gamma=4)
    t2d = make_t2d(m.d2t, m.cfg.vocab_size)
    ref_cfg = TrainConfig(gamma=4, anchors=8, batch_seqs=4, max_len=96, autocast_bf16=autocast, fused_head=False)
    lo_r, draft_r, g_r = _grads(m, batch, t2d, ref_cfg)
    lo_f, draft_f, g_f = _grads(m, batch, t2d, dataclasses.replace(ref_cfg, fused_head=True))
    tol = 2e-2 if autocast else 1e-5
    for name in ("total", "ce", "l1", "bce"):
        assert abs(float(getattr(lo_f, name).detach()) - float(getattr(lo_r, name).detach())) <= tol * max(1.0, abs(float(getattr(lo_r, name).detach()))), name
    assert draft_f.shape == draft_r.shape and float((draft_f == draft_r).float().mean()) >= (0.97 if autocast else 1.0)
    assert torch.equal(lo_f.acc, lo_r.acc) or autocast
    assert g_f.keys() == g_r.keys() and len(g_r) > 5
    for n, gr in g_r.items():  # every parameter's gradient, Markov W2 and the layers below the head included
        err = float((g_f[n] - gr).norm() / gr.norm().clamp(min=1e-12))
        assert err <= (5e-2 if autocast else 1e-4), (n, err)


def test_draft_logprobs_chunking_and_gradcheck() -> None:
    torch.manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    head = torch.randn(11, 5, dtype=torch.float64)
    m = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(11, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (7, 4))
    z = h @ head.t() + m @ w2.t()
    want = torch.log_softmax(z, -1).gather(1, ids)
    for chunk in (1, 3, 7, 64):  # any chunking: the same values
        lp, am = draft_logprobs(h, head, m, w2, ids, chunk=chunk)
        assert lp.dtype == torch.float64 and torch.allclose(lp, want, atol=1e-12)
        assert torch.equal(am, z.argmax(-1))
    assert torch.autograd.gradcheck(lambda a, b, c: draft_logprobs(a, head, b, c, ids, chunk=3)[0],
                                    (h, m, w2), eps=1e-6, atol=1e-3)
