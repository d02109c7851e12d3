"""Fixtures for spec tests: a slow-but-obviously-correct reference Backend over Hugging Face models.

RefBackend recomputes every forward from the full token history (no KV cache), so it is a test oracle for
the loop, independent of the runtime package. The drafter is an autoregressive HF LM: greedy or sampled at
the request's temperature/top-p (spec_decode.accept.target_probs) with spec_decode.rng's STREAM_DRAFT uniforms; its
confidence c_k is its own top-1 probability.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest
import torch

from dspark_trt.spec_decode import rng
from dspark_trt.spec_decode.accept import AcceptResult, greedy_accept, sample_accept, target_probs
from dspark_trt.spec_decode.protocols import DraftBlock, SamplingParams


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny-model forwards are ~15x faster single-threaded on the shared 2-core box; restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class RefBackend:
    """spec_decode.protocols.Backend over HF models, full recompute per call."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None, max_batch: int = 4,
                 max_seq: int = 512, fail_draft: Callable[[int], bool] | None = None) -> None:
        self.target, self.drafter = target.eval(), (draft.eval() if draft is not None else None)
        self.vocab_size = int(target.config.vocab_size)
        self.max_batch, self.max_seq = max_batch, max_seq
        self.ctx: dict[int, list[int]] = {}  # committed tokens in the "cache" (anchor excluded)
        self.pending: dict[int, list[int]] = {}
        self.fail_draft = fail_draft
        self.draft_calls = 0
        self.verify_calls = 0

    @torch.no_grad()
    def _logits(self, model: torch.nn.Module, seq: list[int], last: int) -> torch.Tensor:
        with one_thread():
            return model(torch.tensor([seq])).logits[0, -last:].float()  # [last, V]

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = []
        for s, p in zip(slots, prompts):
            self.ctx[s] = list(p)
            rows.append(self._logits(self.target, list(p), 1)[0])
        return torch.stack(rows)  # [B, V]

    def draft(self, slots: Sequence[int], anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
              positions: torch.Tensor) -> DraftBlock:
        self.draft_calls += 1
        if self.fail_draft is not None and self.fail_draft(self.draft_calls):
            raise RuntimeError("injected drafter failure")
        assert self.drafter is not None
        toks, qs, confs = [], [], []
        for s, a, sp, pos in zip(slots, anchors.tolist(), sampling, positions.tolist()):
            seq = self.ctx[s] + [int(a)]
            assert len(seq) == pos, (len(seq), pos)  # d_1 sits at the committed length
            row_t, row_q, row_c = [], [], []
            for j in range(gamma):
                logits = self._logits(self.drafter, seq, 1)  # [1, V]
                q = target_probs(logits, torch.tensor([sp.temperature]), torch.tensor([sp.top_p]))[0]  # [V]
                if sp.greedy:
                    t = int(logits[0].argmax())
                else:
                    u = rng.uniform(torch.tensor(sp.seed or 0), torch.tensor(len(seq)), rng.STREAM_DRAFT)
                    t = int(torch.searchsorted(q.cumsum(0), u.reshape(1)).clamp_max(self.vocab_size - 1))
                row_c.append(float(torch.softmax(logits[0], -1).max()))
                row_t.append(t)
                row_q.append(q)
                seq.append(t)
            toks.append(row_t)
            qs.append(torch.stack(row_q) if row_q else torch.zeros(0, self.vocab_size))
            confs.append(row_c)
        greedy = all(sp.greedy for sp in sampling)
        return DraftBlock(torch.tensor(toks, dtype=torch.long).reshape(len(slots), gamma),
                          None if greedy else torch.stack(qs), torch.tensor(confs).reshape(len(slots), gamma))

    def verify(self, slots: Sequence[int], tokens: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        self.verify_calls += 1
        out = torch.zeros(len(slots), tokens.shape[1], self.vocab_size)
        for i, s in enumerate(slots):
            n = int(k[i]) + 1
            toks = [int(t) for t in tokens[i, :n]]
            out[i, :n] = self._logits(self.target, self.ctx[s] + toks, n)
            self.pending[s] = toks
        return out  # [B, K+1, V]

    def commit(self, slots: Sequence[int], n_keep: torch.Tensor) -> None:
        for s, n in zip(slots, n_keep.tolist()):
            self.ctx[s] += self.pending.pop(s)[: int(n)]

    def accept(self, logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor, q: torch.Tensor | None,
               sampling: Sequence[SamplingParams], positions: torch.Tensor) -> AcceptResult:
        if q is None:
            return greedy_accept(logits, draft, k)
        return sample_accept(logits, draft, q, k, torch.tensor([s.temperature for s in sampling]),
                             torch.tensor([s.top_p for s in sampling]),
                             torch.tensor([int(s.seed or 0) for s in sampling]), positions)

    def release(self, slot: int) -> None:
        self.ctx.pop(slot, None)
        self.pending.pop(slot, None)


@pytest.fixture(scope="session")
def tiny_models(tiny_pair):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM

    def load(p: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()

    return {"target": load(tiny_pair.target), "draft": load(tiny_pair.draft), "draft_small": load(tiny_pair.draft_small)}


@pytest.fixture()
def ref_backend(tiny_models):  # noqa: ANN001, ANN201
    def make(draft: str = "draft", **kw: object) -> RefBackend:
        return RefBackend(tiny_models["target"], tiny_models[draft], **kw)

    return make


@torch.no_grad()
def plain_greedy(model: torch.nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    """Plain greedy decoding by full recompute (the oracle for losslessness)."""
    seq = list(prompt)
    with one_thread():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="session")
def greedy_oracle():  # noqa: ANN201
    return plain_greedy


@pytest.fixture(autouse=True)
def _single_thread():  # noqa: ANN202
    """Spec tests run tiny models: one thread is far faster on the shared box (restored after each test)."""
    with one_thread():
        yield
