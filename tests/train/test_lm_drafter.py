"""LM drafter (runtime CausalLM): greedy proposals equal the draft's own greedy decoding, protocol
invariants, PARD one-pass mode, vocabulary checks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dspark_trt.errors import VocabularyMismatchError
from dspark_trt.runtime.drafters import LMDrafter, load_drafter
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.spec_decode.protocols import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(tiny_pair):  # noqa: ANN001, ANN201
    return load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy_ref(lm, ids: torch.Tensor, n: int) -> list[int]:  # noqa: ANN001
    out, x = [], ids.clone()
    for _ in range(n):
        cache = lm.new_cache(1, 128)
        t = int(lm(x, cache, torch.tensor([0]), logits="last").logits[0, -1].argmax())
        out.append(t)
        x = torch.cat([x, torch.tensor([[t]])], 1)
    return out


def test_lm_drafter_greedy_matches_draft_model(tiny_pair, target) -> None:  # noqa: ANN001
    d = load_drafter(tiny_pair.draft, target, dtype=torch.float32, target_dir=tiny_pair.target, gamma=5)
    assert isinstance(d, LMDrafter) and d.target_layer_ids == ()
    d.allocate(2, 64)
    ids = _ids(12)
    s = torch.tensor([0])
    d.extend_context(s, ids[:, :-1], torch.tensor([11]), None)
    blk = d.propose(s, ids[:, -1], 5, [GREEDY])
    assert blk.tokens[0].tolist() == _greedy_ref(d.model, ids, 5)
    again = d.propose(s, ids[:, -1], 5, [GREEDY])  # propose leaves the context unchanged
    assert torch.equal(again.tokens, blk.tokens) and int(d.cache.lengths[0]) == 11
    more = _ids(6, seed=1)
    d.extend_context(s, torch.cat([ids[:, -1:], more[:, :-1]], 1), torch.tensor([6]), None)
    longer = torch.cat([ids, more], 1)
    assert d.propose(s, more[:, -1], 3, [GREEDY]).tokens[0].tolist() == _greedy_ref(d.model, longer, 3)
    samp = d.propose(s, more[:, -1], 3, [SamplingParams(temperature=1.0, top_p=0.8)])
    torch.testing.assert_close(samp.q.sum(-1), torch.ones(1, 3))
    d.release(0)
    assert int(d.cache.lengths[0]) == 0


def test_pard_one_pass(tiny_pair, target, tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "pard"
    shutil.copytree(tiny_pair.draft, p)
    cfg = json.loads((p / "config.json").read_text())
    cfg["pard"] = True
    (p / "config.json").write_text(json.dumps(cfg))
    d = load_drafter(p, target, dtype=torch.float32, gamma=4)
    assert d.pard and d.mask_token_id == cfg["mask_token_id"]
    d.allocate(1, 64)
    ids = _ids(10)
    d.extend_context(torch.tensor([0]), ids[:, :-1], torch.tensor([9]), None)
    blk = d.propose(torch.tensor([0]), ids[:, -1], 4, [GREEDY])
    x = torch.cat([ids, torch.full((1, 3), cfg["mask_token_id"])], 1)
    ref = d.model(x, d.model.new_cache(1, 64), torch.tensor([0])).logits[0, -4:].argmax(-1)
    assert blk.tokens[0].tolist() == ref.tolist()
    assert int(d.cache.lengths[0]) == 9


def test_lm_drafter_vocab_mismatch(tiny_pair, target, tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "bad"
    shutil.copytree(tiny_pair.draft, p)
    cfg = json.loads((p / "config.json").read_text())
    cfg["vocab_size"] = 640
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VocabularyMismatchError, match="^The draft model and target model must have the same vocabulary"):
        load_drafter(p, target)
