"""runtime.profile.profile_costs on the real tiny target + a DSpark drafter: every token count 1..γ+1 and the sparse
pass sizes up to the cache room (what saturated batches and prefill sharing a pass cost), a step column that never
falls, a drafter cost, and the backend's slots left free for serving; each cost priced against the same rep's
one-token pass (`_paired`)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.runtime.profile import LONG_CONTEXT, PASS_POINTS, _paired, profile_costs
from dspark_trt.spec_decode.costs import CostTable, RoundLoad


def _backend(tiny_pair, max_seq: int) -> SpecBackend:  # noqa: ANN001
    from dspark_trt.runtime.drafters import DSparkConfig, DSparkDrafter, DSparkModel

    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    c = target.config
    cfg = DSparkConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=c.vocab_size, target_layer_ids=(0, 1),
                       num_target_layers=c.num_layers, mask_token_id=3, num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    model = DSparkModel(cfg).float()
    model.attach_target(target.embed_tokens.weight, target.lm_head_weight)
    return SpecBackend(target, DSparkDrafter(model), max_batch=2, max_seq=max_seq)


@pytest.fixture(scope="module")
def backend(tiny_pair) -> SpecBackend:  # noqa: ANN001
    return _backend(tiny_pair, 256)


def test_profile_covers_verify_and_pass_sizes(backend: SpecBackend, tmp_path: Path) -> None:
    table = profile_costs(backend, 5, reps=1, pass_tokens=512)
    room = 256 - 64 - 2  # max_seq − cached context − 2
    assert table.tokens == (1, 2, 3, 4, 5) + tuple(n for n in PASS_POINTS if 5 < n <= room)
    assert table.tokens[-1] == 128
    assert all(b > a for a, b in zip(table.seconds, table.seconds[1:]))  # never falls (noise clipped)
    assert table.draft_t0 + table.draft_t1 > 0
    assert table.sampled_t1 > 0  # a sampled row's q, draws and their acceptance cost more than a greedy row's
    # a round that shares its pass with a 100-token prompt is priced from measured points, above the verify alone
    assert table.round_seconds(8, RoundLoad(100, fused=True)) > table.round_seconds(8)
    path = tmp_path / "cost_table.json"
    path.write_text(json.dumps(table.to_json()))
    assert CostTable.from_json(path) == table
    assert int(backend.cache.lengths[:2].sum()) == 0  # the profile's slots are free again
    assert table.context == table.ctx_t0 == table.ctx_t1 == 0  # no room for a long context: context-blind


class _ContextPriced:
    """The real target, each pass made dearer by a known cost per cached token of its rows (a sleep): a long
    context's price the profile must find. The tiny target's own attention over 1,024 keys is a few µs — within
    the timer's noise on a 2-core VM, where a test that asked the profile to find it failed now and then."""

    def __init__(self, target: object, per_token: float) -> None:
        self._target, self._per_token = target, per_token

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)

    def __call__(self, ids: torch.Tensor, cache, slots: torch.Tensor, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN204
        time.sleep(self._per_token * int(cache.lengths[slots].max()))
        return self._target(ids, cache, slots, *a, **kw)


def test_profile_measures_what_a_long_context_adds(tiny_pair) -> None:  # noqa: ANN001
    """With room for LONG_CONTEXT cached tokens, the same passes are timed at 64 and at LONG_CONTEXT: what a row's
    cached tokens add to a pass is priced per cached token (the table's context terms) — here a known 2 µs each."""
    backend = _backend(tiny_pair, LONG_CONTEXT + 64)
    per_token = 2e-6
    backend.target = _ContextPriced(backend.target, per_token)
    table = profile_costs(backend, 5, reps=3, pass_tokens=16)
    assert table.context == 64
    extra = per_token * (LONG_CONTEXT - 64)  # one token over 1,024 cached ones costs this much more than over 64
    assert 0.5 * extra < table.row_seconds(LONG_CONTEXT, 1) < 2.0 * extra
    assert min(table.ctx_t0, table.ctx_t1, table.draft_ctx) >= 0
    assert int(backend.cache.lengths[:2].sum()) == 0


def test_a_small_cache_is_profiled_without_overflowing(tiny_pair) -> None:  # noqa: ANN001
    """A backend sized for short requests (an engine's max_length of a few dozen tokens, `dspark-trt bench` on short
    prompts): every rep starts from a fresh prefill, so the drafter's context grows by one rep's timed passes (and
    its γ proposed tokens) only, and the profile fits (it overflowed the cache before, failing the whole command)."""
    from dspark_trt.runtime.drafters import load_drafter

    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    lm = load_drafter(tiny_pair.draft, target, dtype=torch.float32)  # an LM drafter: its proposals need cache room
    backend = SpecBackend(target, lm, max_batch=2, max_seq=24)  # a 14-token prompt + 8 new + 2 (bench's sizing)
    table = profile_costs(backend, lm.gamma + 1, reps=5)
    assert table.tokens[:lm.gamma + 1] == tuple(range(1, lm.gamma + 2)) and table.draft_t0 + table.draft_t1 > 0
    assert int(backend.cache.lengths[:2].sum()) == 0


def test_pass_tokens_bounds_the_sparse_points(backend: SpecBackend) -> None:
    assert profile_costs(backend, 5, reps=1, pass_tokens=32).tokens == (1, 2, 3, 4, 5, 16, 32)


def test_a_cost_is_priced_against_the_same_reps_one_token_pass() -> None:
    """A 4-token pass that ran in a fast spell once (0.6 s where it took 1.3 s twice) does not make verify tokens
    look cheap, as the fastest of the reps did (0.6 / 1.0): the median of the paired ratios; a slow rep of the whole
    machine (both passes twice as long) moves neither the ratio nor, past the median, the one-token price."""
    step1 = [1.0, 1.0, 1.0]
    assert _paired([1.3, 0.6, 1.3], step1) == pytest.approx(1.3)
    assert min([1.3, 0.6, 1.3]) / min(step1) == pytest.approx(0.6)  # what fastest-of-reps priced
    assert _paired([1.3, 2.6, 1.3], [1.0, 2.0, 1.0]) == pytest.approx(1.3)
    assert _paired([1.3, 1.4], [1.0, 1.0, 1.0]) == pytest.approx(1.35)  # counts measured in the first reps only
