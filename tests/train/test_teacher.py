"""The runtime teacher (train.features.RuntimeTarget): the same taps and distributions as the HF teacher, batched
and right-padded rows equal to each sequence alone, and a feature store built from it."""
from __future__ import annotations

import torch

from dspark_trt.train.features import FeatureStore, HFTarget, RuntimeTarget, cache_features


def _seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 23, 16, 40, 12)]


def test_runtime_teacher_matches_the_hf_teacher(tiny_pair) -> None:  # noqa: ANN001
    hf = HFTarget.load(tiny_pair.target, (0, 1), dtype=torch.float32)
    rt = RuntimeTarget.load(tiny_pair.target, (0, 1), dtype=torch.float32, max_rows=4, max_len=64)
    for s in _seqs():
        ids = torch.tensor([s])
        f_hf, l_hf = hf.run(ids)
        f_rt, l_rt = rt.run(ids)
        assert f_rt.shape == f_hf.shape and l_rt.shape == l_hf.shape
        torch.testing.assert_close(f_rt, f_hf, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(l_rt, l_hf, rtol=1e-4, atol=1e-3)


def test_runtime_teacher_rows_padded_in_a_batch_equal_each_row_alone(tiny_pair) -> None:  # noqa: ANN001
    rt = RuntimeTarget.load(tiny_pair.target, (0, 1), dtype=torch.bfloat16, max_rows=2, max_len=16)
    seqs = _seqs()
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s)
    f, lg = rt.run(ids, (ids != 0).long())  # grows its cache past max_rows / max_len
    for r, s in enumerate(seqs):
        f1, l1 = rt.run(torch.tensor([s]))
        assert torch.equal(f[r, :len(s)], f1[0]) and torch.equal(lg[r, :len(s)], l1[0])


def test_feature_store_from_the_runtime_teacher(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    rt = RuntimeTarget.load(tiny_pair.target, (0, 1), dtype=torch.bfloat16)
    seqs = _seqs()
    store = cache_features(rt, seqs, [2] * len(seqs), tmp_path / "features", topk=4, batch_tokens=64)
    assert store.num_sequences == len(seqs) and store.features.shape[1] == 2 * rt.model.config.hidden_size
    for i in range(store.num_sequences):
        a, b = store.seq(i)
        s = store.tokens[a:b].tolist()
        f, lg = rt.run(torch.tensor([s]))
        assert torch.equal(store.feature_rows(a, b), f[0].to(torch.bfloat16))
        top1 = torch.from_numpy(store.topk_ids[a:b, :1]).long()  # [n, 1]: a maximum (bf16 logits tie often)
        assert torch.equal(lg[0].gather(1, top1)[:, 0], lg[0].max(-1).values)
    assert isinstance(FeatureStore.open(tmp_path / "features"), FeatureStore)


def test_take_tokens_gives_nested_seeded_subsets_of_the_budget(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    from dspark_trt.train.batches import eligible, take_tokens

    rt = RuntimeTarget.load(tiny_pair.target, (0, 1), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, 200, (int(n),), generator=g).tolist() for n in torch.randint(12, 40, (30,), generator=g)]
    store = cache_features(rt, seqs, [3] * len(seqs), tmp_path / "f", topk=2, batch_tokens=256)
    refs = eligible([store], gamma=4)
    answer = {r: (lambda ab: ab[1] - ab[0] - 3)(store.seq(r.index)) for r in refs}
    small, big = take_tokens([store], refs, 150, seed=1), take_tokens([store], refs, 400, seed=1)
    assert set(small) < set(big) and big[:len(small)] == small  # nested: the same order, a longer prefix
    assert 150 <= sum(answer[r] for r in small) < 150 + max(answer.values())
    assert take_tokens([store], refs, 150, seed=1) == small and take_tokens([store], refs, 150, seed=2) != small
    assert set(take_tokens([store], refs, 10**9, seed=1)) == set(refs)
