"""DSpark drafter semantics: masks, Markov head, confidence head, Drafter protocol, save/load, vocab checks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dspark_trt.errors import DrafterError, VocabularyMismatchError
from dspark_trt.runtime.drafters import (DSparkDrafter, DSparkModel, VocabInfo, check_same_vocabulary, load_drafter,
                                         load_dspark_model, save_dspark)
from dspark_trt.spec_decode.protocols import SamplingParams

from .conftest import make_model

GREEDY = SamplingParams()


def _ids(n: int, seed: int = 0, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (B, n), generator=g)


def test_context_cut_at_anchor(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target)
    ids = _ids(24)
    feats, _ = tiny_target.run(ids)
    anchors = torch.tensor([[5, 12]])
    _, base, _ = m.forward_train(feats, ids, anchors, 4)  # [1, 2, 4, V]
    f2 = feats.clone()
    f2[:, 12:] += 3.0  # positions ≥ anchor 12 (and ≥ 5): invisible to both anchors
    _, out2, _ = m.forward_train(f2, ids, anchors, 4)
    torch.testing.assert_close(out2, base)
    f3 = feats.clone()
    f3[:, 8] += 3.0  # visible to anchor 12 only
    _, out3, _ = m.forward_train(f3, ids, anchors, 4)
    torch.testing.assert_close(out3[:, 0], base[:, 0])
    assert (out3[:, 1] - base[:, 1]).abs().max() > 1e-3


def test_block_is_bidirectional_and_blocks_are_separate(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target)
    ids = _ids(24)
    feats, _ = tiny_target.run(ids)
    anchors = torch.tensor([[5, 12]])
    hid, _, _ = m.forward_train(feats, ids, anchors, 4)
    with torch.no_grad():
        m.mask_embedding.add_(1.0)  # changes slots 1..3 of every block's input, not the anchor slot
    hid2, _, _ = m.forward_train(feats, ids, anchors, 4)
    assert (hid2[:, :, 0] - hid[:, :, 0]).abs().max() > 1e-4  # slot 0 sees later slots: bidirectional
    ids2 = ids.clone()
    ids2[0, 12] = (ids[0, 12] + 1) % 500  # anchor token of block 2 only
    with torch.no_grad():
        m.mask_embedding.sub_(1.0)
    _, l3, _ = m.forward_train(feats, ids2, anchors, 4)
    _, l0, _ = m.forward_train(feats, ids, anchors, 4)
    torch.testing.assert_close(l3[:, 0], l0[:, 0])  # block 1 ignores block 2
    assert (l3[:, 1] - l0[:, 1]).abs().max() > 1e-4


def _drafter(m, feats, ids, max_seq=64):  # noqa: ANN001, ANN202
    d = DSparkDrafter(m)
    d.allocate(2, max_seq)
    n = ids.shape[1]
    d.extend_context(torch.tensor([0]), ids, torch.tensor([n]), feats)
    return d


@pytest.mark.parametrize("draft_vocab", [0, 200])
def test_markov_head_matches_formula(tiny_pair, tiny_target, draft_vocab: int) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target, draft_vocab=draft_vocab)
    if draft_vocab:
        m.d2t.copy_(torch.arange(0, 400, 2))
        m.attach_target(tiny_target.model.get_input_embeddings().weight,
                        tiny_target.model.get_output_embeddings().weight)
    ids = _ids(16)
    feats, _ = tiny_target.run(ids)
    d = _drafter(m, feats, ids)
    anchor = torch.tensor([7])
    blk = d.propose(torch.tensor([0]), anchor, 4, [GREEDY])
    # reference: one backbone pass, then p_k = softmax(U_k + W2·W1[x_{k−1}]), x_0 = anchor
    pos = torch.arange(16, 20)[None]
    kv = m.context_kv(m.context(feats), torch.arange(16)[None])
    mask = torch.ones(1, 4, 20, dtype=torch.bool)
    hid = m.backbone(m.block_input(anchor, 4), pos, kv, mask)
    U = hid @ tiny_target.model.get_output_embeddings().weight[m.d2t].t()  # [1, 4, Vd]
    x = int(anchor)
    for k in range(4):
        p = torch.softmax(U[0, k] + m.markov_w2.weight @ m.markov_w1.weight[x], -1)
        x = int(m.d2t[p.argmax()])
        assert int(blk.tokens[0, k]) == x
        c = torch.sigmoid(m.confidence.weight[0] @ torch.cat([hid[0, k], m.markov_w1.weight[int(blk.tokens[0, k - 1]) if k else int(anchor)]]) + m.confidence.bias[0])
        torch.testing.assert_close(blk.conf[0, k], c.detach(), atol=1e-5, rtol=1e-5)
    assert blk.tokens.shape == (1, 4) and blk.q is None


def test_confidence_in_unit_interval_and_sampling_q(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target)
    ids = _ids(16)
    feats, _ = tiny_target.run(ids)
    d = _drafter(m, feats, ids)
    blk = d.propose(torch.tensor([0]), torch.tensor([3]), 4, [SamplingParams(temperature=0.8, top_p=0.9)])
    assert blk.conf is not None and bool(((blk.conf > 0) & (blk.conf < 1)).all())
    assert blk.q.shape == (1, 4, 512)
    torch.testing.assert_close(blk.q.sum(-1), torch.ones(1, 4))
    assert bool((blk.q.gather(2, blk.tokens[..., None]) > 0).all())  # sampled tokens have q > 0


def test_protocol_propose_pure_and_extend_consistent(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target)
    ids = _ids(20)
    feats, _ = tiny_target.run(ids)
    d = _drafter(m, feats[:, :12], ids[:, :12])
    s = torch.tensor([0])
    a = d.propose(s, ids[:, 12], 4, [GREEDY])
    b = d.propose(s, ids[:, 12], 4, [GREEDY])
    assert torch.equal(a.tokens, b.tokens) and d.context_length(0) == 12
    d.extend_context(s, ids[:, 12:20], torch.tensor([8]), feats[:, 12:20])
    after = d.propose(s, torch.tensor([5]), 4, [GREEDY])
    full = _drafter(m, feats, ids)
    ref = full.propose(s, torch.tensor([5]), 4, [GREEDY])
    assert torch.equal(after.tokens, ref.tokens)
    torch.testing.assert_close(after.conf, ref.conf)
    # batched, ragged: slot 1 holds a shorter context; right-padded extend
    full.extend_context(torch.tensor([1]), ids[:, :9].clone().resize_(1, 20).fill_(0).index_copy_(
        1, torch.arange(9), ids[:, :9]), torch.tensor([9]), torch.cat([feats[:, :9], feats[:, :11]], 1))
    both = full.propose(torch.tensor([0, 1]), torch.tensor([5, ids[0, 9].item()]), 3, [GREEDY, GREEDY])
    solo = _drafter(m, feats[:, :9], ids[:, :9]).propose(s, ids[:, 9], 3, [GREEDY])
    assert torch.equal(both.tokens[0], ref.tokens[0, :3]) and torch.equal(both.tokens[1], solo.tokens[0])
    full.release(1)
    assert full.context_length(1) == 0


def test_save_load_round_trip_bit_exact(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target, draft_vocab=300).to(torch.bfloat16)
    m.set_temperatures([1.0, 1.5, 2.0, 0.5])
    save_dspark(m, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDrafter"] and cfg["confidence_temperatures"] == [1.0, 1.5, 2.0, 0.5]
    m2 = load_dspark_model(tmp_path / "d", dtype=torch.bfloat16)
    s1, s2 = m.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not any(tuple(v.shape) == (512, 64) for v in s2.values())  # no target embeddings / lm_head inside
    assert m2.cfg == m.cfg.replace(torch_dtype="bfloat16")
    d = load_drafter(tmp_path / "d", tiny_target.model, dtype=torch.bfloat16, target_dir=tiny_pair.target)
    assert isinstance(d, DSparkDrafter) and d.gamma == 4 and d.target_layer_ids == (0, 1)


def test_invalid_checkpoints_raise_drafter_error(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    m = make_model(tiny_pair, tiny_target)
    save_dspark(m, tmp_path / "d")
    with pytest.raises(DrafterError, match="config.json"):
        load_drafter(tmp_path / "nothing", tiny_target.model)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "d", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["markov_head_type"] = "weird"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="markov_head_type"):
        load_drafter(bad, tiny_target.model)
    (bad / "config.json").write_text((tmp_path / "d" / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:100])
    with pytest.raises(DrafterError, match="corrupt"):
        load_drafter(bad, tiny_target.model)


def test_vocabulary_mismatch(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    a = VocabInfo(512, {"eos_token_id": 0}, tuple(f"t{i}" for i in range(512)))
    b = VocabInfo(512, {"eos_token_id": 1}, tuple(f"t{i}" if i != 77 else "x" for i in range(512)))
    with pytest.raises(VocabularyMismatchError) as e:
        check_same_vocabulary(a, b)
    msg = str(e.value)
    assert msg.startswith("The draft model and target model must have the same vocabulary")
    assert "eos_token_id" in msg and "id 77" in msg
    check_same_vocabulary(tiny_pair.draft, tiny_pair.target)  # same tokenizer: fine
    m = make_model(tiny_pair, tiny_target)
    save_dspark(m, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["target_vocab"]["size"] = 600
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VocabularyMismatchError, match="sizes differ"):
        load_drafter(tmp_path / "d", tiny_target.model, target_dir=tiny_pair.target)


def test_grow_layers_keeps_the_function_and_trains_the_new_layer(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    """--init-from with more --num-layers: the grown drafter gives the same logits as the checkpoint (the new layer's
    o_proj / down_proj start at zero), carries the new count in its config, and its new layer receives gradients."""
    from dspark_trt.train.model_init import grow_layers

    m = make_model(tiny_pair, tiny_target)  # 1 decoder layer
    ids = _ids(24)
    feats, _ = tiny_target.run(ids)
    anchors = torch.tensor([[5, 12]])
    with torch.no_grad():
        _, base, conf = m.forward_train(feats, ids, anchors, 4)
    g = grow_layers(m, 2)
    assert len(g.layers) == 2 and g.cfg.num_hidden_layers == 2 and grow_layers(g, 2) is g
    _, out, conf2 = g.forward_train(feats, ids, anchors, 4)
    torch.testing.assert_close(out.detach(), base)
    torch.testing.assert_close(conf2.detach(), conf)
    out.logsumexp(-1).sum().backward()
    assert float(g.layers[1].o_proj.weight.grad.abs().sum()) > 0  # the zeroed branch learns first
    assert float(g.layers[1].down_proj.weight.grad.abs().sum()) > 0


def test_grow_markov_rank_keeps_the_function_and_trains_the_new_components(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    """--init-from with a larger --markov-rank: the grown drafter gives the same logits and confidences as the
    checkpoint (new W2 columns and confidence weights zero), keeps the old components, carries the new rank in its
    config, and its new W2 columns receive gradients."""
    from dspark_trt.train.model_init import grow_markov_rank

    m = make_model(tiny_pair, tiny_target, draft_vocab=64, markov_rank=8)  # a reduced draft vocabulary too
    with torch.no_grad():  # a trained-looking head: W2 and the confidence head's W1 weights non-zero
        m.markov_w2.weight.normal_(0.0, 0.05)
        m.confidence.weight.normal_(0.0, 0.05)
    ids = _ids(24)
    feats, _ = tiny_target.run(ids)
    anchors = torch.tensor([[5, 12]])
    with torch.no_grad():
        _, base, conf = m.forward_train(feats, ids, anchors, 4)
    g = grow_markov_rank(m, 24)
    assert g.cfg.markov_rank == 24 and tuple(g.markov_w1.weight.shape[1:]) == (24,)
    assert grow_markov_rank(g, 24) is g and grow_markov_rank(g, 8) is g
    torch.testing.assert_close(g.markov_w1.weight.detach()[:, :8], m.markov_w1.weight.detach())
    assert float(g.markov_w1.weight.detach()[:, 8:].abs().sum()) > 0  # new features drawn, silent through W2 = 0
    _, out, conf2 = g.forward_train(feats, ids, anchors, 4)
    torch.testing.assert_close(out.detach(), base)
    torch.testing.assert_close(conf2.detach(), conf)
    out.logsumexp(-1).sum().backward()
    assert float(g.markov_w2.weight.grad[:, 8:].abs().sum()) > 0


def test_grow_taps_keeps_the_function_and_trains_the_new_tap(tiny_pair, tiny_target) -> None:  # noqa: ANN001
    """--init-from with more --layers: the grown drafter reads the new tap's features (wherever it sits in the list)
    yet gives the checkpoint's logits and confidences (its fc columns start at zero), carries the new taps in its
    config, and the new columns receive gradients; dropping a trained tap is refused."""
    from dspark_trt.train.model_init import grow_taps, new_config

    torch.manual_seed(0)
    emb = tiny_target.model.get_input_embeddings().weight
    m = DSparkModel(new_config(tiny_pair.target, (1,), num_layers=1, gamma=4, markov_rank=8, draft_vocab_size=0,
                               embed_weight=emb))  # a checkpoint tapping layer 1 only
    with torch.no_grad():
        m.markov_w2.weight.normal_(0, 0.5)
        m.mask_embedding.normal_(0, 1.0)
    m.attach_target(emb, tiny_target.model.get_output_embeddings().weight)
    d = m.cfg.hidden_size
    ids = _ids(24)
    feats, _ = tiny_target.run(ids)  # [1, L, 2·d]: taps 0, 1
    anchors = torch.tensor([[5, 12]])
    with torch.no_grad():
        _, base, conf = m.forward_train(feats[..., d:], ids, anchors, 4)
    g = grow_taps(m, (0, 1))  # the new tap first: the kept tap's columns move behind it
    assert g.cfg.target_layer_ids == (0, 1) and g.cfg.feature_size == 2 * d and grow_taps(g, (0, 1)) is g
    _, out, conf2 = g.forward_train(feats, ids, anchors, 4)
    torch.testing.assert_close(out.detach(), base)
    torch.testing.assert_close(conf2.detach(), conf)
    out.logsumexp(-1).sum().backward()
    assert float(g.fc.weight.grad[:, :d].abs().sum()) > 0
    with pytest.raises(DrafterError, match="must keep every target tap") as e:
        grow_taps(g, (0,))
    assert "Fix: pass its taps plus the new ones, e.g. --layers 0,1" in str(e.value)


def test_prune_draft_vocab_keeps_the_logits_of_the_kept_tokens(tiny_pair, tiny_target, tmp_path) -> None:  # noqa: ANN001
    """Pruning the draft vocabulary to its most frequent tokens: the pruned drafter's logits are the checkpoint's at
    the kept ids (head rows and Markov W2 rows gathered, nothing else changed), `always` ids stay, the rest of the
    checkpoint is untouched, it round-trips through save / load, and a size that does not shrink is refused."""
    from dspark_trt.runtime.drafters.loader import load_dspark_model, save_dspark
    from dspark_trt.train.model_init import prune_draft_vocab

    m = make_model(tiny_pair, tiny_target, draft_vocab=64, markov_rank=8)
    with torch.no_grad():
        m.markov_w2.weight.normal_(0.0, 0.05)
    ids = _ids(24)
    feats, _ = tiny_target.run(ids)
    anchors = torch.tensor([[5, 12]])
    with torch.no_grad():
        _, base, conf = m.forward_train(feats, ids, anchors, 4)  # [1, 2, 4, 64]
    counts = torch.zeros(m.cfg.vocab_size, dtype=torch.long)
    counts[m.d2t[::3]] = torch.arange(1, m.d2t[::3].numel() + 1)  # every third draft token seen, rising counts
    rare = int(m.d2t[1])  # never counted: kept only because `always` names it
    p = prune_draft_vocab(m, counts, 16, always=(rare,))
    assert p.cfg.head_vocab == 16 and tuple(p.d2t.shape) == (16,) and tuple(p.markov_w2.weight.shape) == (16, 8)
    assert rare in p.d2t.tolist() and bool((p.d2t[1:] > p.d2t[:-1]).all())  # sorted by id
    top = set(m.d2t[::3][-15:].tolist())  # the 15 most counted
    assert top | {rare} == set(p.d2t.tolist())
    keep = torch.tensor([m.d2t.tolist().index(t) for t in p.d2t.tolist()])
    with torch.no_grad():
        _, out, conf2 = p.forward_train(feats, ids, anchors, 4)
    torch.testing.assert_close(out, base[..., keep])
    torch.testing.assert_close(conf2, conf)
    torch.testing.assert_close(p.fc.weight, m.fc.weight)
    save_dspark(p, tmp_path / "p")
    q = load_dspark_model(tmp_path / "p")
    assert q.cfg.draft_vocab_size == 16 and q.d2t.tolist() == p.d2t.tolist()
    with pytest.raises(DrafterError, match="draft vocabulary 64"):
        prune_draft_vocab(m, counts, 64)


def test_answer_token_counts_count_answers_only(tmp_path) -> None:  # noqa: ANN001
    """The pruning command counts the answer tokens (ids past prompt_len) of every data file; no data is an error."""
    import gzip

    from dspark_trt.train.prune_vocab import answer_token_counts

    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps({"prompt": "x", "ids": [9, 9, 3, 4, 4], "prompt_len": 2}) + "\n")
        f.write(json.dumps({"prompt": "y", "ids": [7, 4], "prompt_len": 1}) + "\n")
    c = answer_token_counts(tmp_path, 10)
    assert c.tolist() == [0, 0, 0, 1, 3, 0, 0, 0, 0, 0]
    with pytest.raises(DrafterError, match="No \\*.jsonl.gz"):
        answer_token_counts(tmp_path / "missing", 10)
