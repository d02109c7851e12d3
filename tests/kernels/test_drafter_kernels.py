"""The drafters' own sampling path on the kernel branch (Triton interpreter) equals the reference branch.

runtime.dispatch picks the block_draft kernel when tensors are on CUDA; here the routing is forced on CPU
(`use_kernels` → True) so the interpreted kernel runs what a drafter would run on a GPU: same keys
(seed, position, STREAM_DRAFT) → the same token bits; q and confidences to float32 rounding.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from dspark_trt.runtime import dispatch
from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.spec_decode.protocols import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

PROMPTS = [[5, 17, 99, 4, 250, 31], [300, 12, 8]]
SAMPLING = [SamplingParams(temperature=0.9, seed=11), SamplingParams()]  # one sampled row, one greedy row


def _drafter(tiny_pair: Any, target: Any, kind: str) -> Any:
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.testing.tiny import tiny_dspark_drafter

    if kind == "lm":
        return load_drafter(tiny_pair.draft, target, dtype=torch.float32)
    return tiny_dspark_drafter(target, draft_vocab=200 if kind == "dspark_d2t" else 0,
                               markov=kind != "dspark_no_markov")


@pytest.mark.parametrize("kind", ["lm", "dspark", "dspark_d2t", "dspark_no_markov"])
def test_drafter_kernel_branch_equals_reference(interpreted_kernels: ModuleType, tiny_pair: Any,
                                                monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    target = load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)
    be = SpecBackend(target, _drafter(tiny_pair, target, kind), max_batch=2, max_seq=32)
    be.prefill([0, 1], PROMPTS)
    anchors, pos = torch.tensor([7, 9]), torch.tensor([len(p) + 1 for p in PROMPTS])
    want = be.draft([0, 1], anchors, 3, SAMPLING, pos)
    launched: list[int] = []
    real = interpreted_kernels.markov_block

    def spy(*args: Any, **kwargs: Any) -> Any:
        launched.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "use_kernels", lambda *tensors: True)
    monkeypatch.setattr(interpreted_kernels, "markov_block", spy)
    got = be.draft([0, 1], anchors, 3, SAMPLING, pos)
    assert launched, "the kernel branch did not run"
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    torch.testing.assert_close(got.q, want.q, atol=1e-5, rtol=1e-4)
    if want.conf is None:
        assert got.conf is None
    else:
        torch.testing.assert_close(got.conf, want.conf, atol=1e-5, rtol=1e-5)
