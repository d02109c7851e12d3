"""SpecBackend on real tiny checkpoints: plain decoding via prefill/verify/commit, speculative rounds with a
real LM drafter and with a feature-checking drafter, slot reuse, and error paths."""
from __future__ import annotations

from typing import Sequence

import pytest
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.runtime.backend import SpecBackend
from dspark_trt.runtime.hf_loader import load_hf_checkpoint
from dspark_trt.runtime.model import CausalLM, greedy_decode
from dspark_trt.spec_decode.protocols import DraftBlock, SamplingParams

GREEDY = SamplingParams()
PROMPTS = [[5, 17, 99, 200, 3, 41, 7], [300, 12], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def target(tiny_pair) -> CausalLM:
    return load_hf_checkpoint(tiny_pair.target, dtype=torch.float32)


def _reference(target: CausalLM, prompt: list[int], n: int) -> list[int]:
    return greedy_decode(target, prompt, n)


def test_plain_decoding_through_prefill_verify_commit(target: CausalLM) -> None:
    n = 12
    be = SpecBackend(target, None, max_batch=4, max_seq=64)
    slots = [2, 0, 3]  # non-contiguous and out of order
    logits = be.prefill(slots, PROMPTS)  # [B, V]
    assert logits.shape == (3, target.config.vocab_size) and logits.dtype == torch.float32
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(n - 1):
        anchors = torch.tensor([[o[-1]] for o in out])  # [B, 1]
        step = be.verify(slots, anchors, torch.zeros(3, dtype=torch.long))  # [B, 1, V]
        res = be.accept(step, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), None,
                        [GREEDY] * 3, torch.tensor([be.committed_length(s) for s in slots]))
        be.commit(slots, res.accepted + 1)
        assert res.accepted.tolist() == [0, 0, 0]
        for o, t in zip(out, res.next_token.tolist()):
            o.append(int(t))
    for o, p, slot in zip(out, PROMPTS, slots):
        assert o == _reference(target, p, n)
        assert be.committed_length(slot) == len(p) + n  # cache = all committed but the anchor


def test_verify_rows_with_different_k_and_rollback(target: CausalLM) -> None:
    """Row 0 verifies its true greedy continuation (all accepted), row 1 a wrong draft (rejected at d_1)."""
    be = SpecBackend(target, None, max_batch=2, max_seq=64)
    ref0, ref1 = _reference(target, PROMPTS[0], 6), _reference(target, PROMPTS[1], 6)
    first = be.prefill([0, 1], PROMPTS[:2]).argmax(-1)
    assert first.tolist() == [ref0[0], ref1[0]]
    wrong = (ref1[1] + 1) % target.config.vocab_size
    tokens = torch.tensor([[ref0[0], ref0[1], ref0[2], ref0[3]], [ref1[0], wrong, 0, 0]])  # [B, K+1]
    k = torch.tensor([3, 1])
    logits = be.verify([0, 1], tokens, k)
    positions = torch.tensor([len(PROMPTS[0]) + 1, len(PROMPTS[1]) + 1])  # [B] d_1 = committed length
    res = be.accept(logits, tokens[:, 1:], k, None, [GREEDY] * 2, positions)
    assert res.accepted.tolist() == [3, 0]
    assert res.next_token.tolist() == [ref0[4], ref1[1]]
    be.commit([0, 1], res.accepted + 1)
    assert be.cache.lengths[:2].tolist() == [len(PROMPTS[0]) + 4, len(PROMPTS[1]) + 1]
    nxt = be.verify([0, 1], res.next_token.reshape(2, 1), torch.zeros(2, dtype=torch.long)).argmax(-1)[:, 0]
    assert nxt.tolist() == [ref0[5], ref1[2]]


def test_speculative_loop_with_lm_drafter_is_lossless(tiny_pair, target: CausalLM) -> None:
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.spec_decode.loop import generate
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    drafter = load_drafter(tiny_pair.draft, target, dtype=torch.float32)
    be = SpecBackend(target, drafter, max_batch=2, max_seq=96)
    n = 40
    res = generate(be, PROMPTS[0], max_new_tokens=n, policy=PolicyConfig(policy="fixed", k=4))
    assert res.tokens == _reference(target, PROMPTS[0], n)
    assert res.stats.accepted_tokens > 0 and res.stats.verify_calls < n - 1  # speculation saved target calls


class FeatureProbeDrafter:
    """A protocol-conforming drafter that checks what the backend feeds it against the target itself.

    Its context (tokens + features) must equal the committed sequence minus the anchor, and the features
    must equal the target's taps over that sequence computed in one independent forward. It proposes the
    target's true greedy continuation for even rounds and a wrong token for odd rounds.
    """

    gamma = 4

    def __init__(self, target: CausalLM, taps: tuple[int, ...]) -> None:
        self.target = target
        self.target_layer_ids = taps
        self.ctx: dict[int, list[int]] = {}
        self.feats: dict[int, list[torch.Tensor]] = {}
        self.rounds = 0
        self.released: list[int] = []

    def allocate(self, max_batch: int, max_seq: int) -> None:
        self.allocated = (max_batch, max_seq)

    def extend_context(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                       features: torch.Tensor | None) -> None:
        assert features is not None and features.shape[:2] == tokens.shape
        for row, slot in enumerate(slots.tolist()):
            n = int(lengths[row])
            self.ctx.setdefault(slot, []).extend(tokens[row, :n].tolist())
            self.feats.setdefault(slot, []).append(features[row, :n].clone())

    def check(self, slot: int) -> None:
        seq = self.ctx[slot]
        ref = self.target(torch.tensor([seq]), self.target.new_cache(1, len(seq)), [0],
                          taps=self.target_layer_ids, logits="none").hidden[0]  # [n, F]
        torch.testing.assert_close(torch.cat(self.feats[slot]), ref, rtol=1e-4, atol=1e-4)

    def propose(self, slots: torch.Tensor, anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
                positions: torch.Tensor | None = None) -> DraftBlock:
        assert positions is not None and positions.tolist() == [len(self.ctx[s]) + 1 for s in slots.tolist()]
        self.rounds += 1
        toks = []
        for slot, anchor in zip(slots.tolist(), anchors.tolist()):
            cont = greedy_decode(self.target, self.ctx[slot] + [anchor], gamma)
            if self.rounds % 2:
                cont[1 % gamma] = (cont[1 % gamma] + 1) % self.target.config.vocab_size
            toks.append(cont)
        return DraftBlock(tokens=torch.tensor(toks), q=None, conf=None)

    def release(self, slot: int) -> None:
        self.released.append(slot)
        self.ctx.pop(slot, None)
        self.feats.pop(slot, None)


def test_backend_feeds_drafter_committed_tokens_and_target_features(target: CausalLM) -> None:
    from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    probe = FeatureProbeDrafter(target, taps=(1, 0))
    be = SpecBackend(target, probe, max_batch=2, max_seq=64)
    sched = RoundScheduler(be, LoopConfig(gamma=4, calibrate=False))
    n = 14
    ids = [sched.add(Request(tuple(p), n, policy=PolicyConfig(policy="fixed", k=3))) for p in PROMPTS[:2]]
    got: dict[int, list[int]] = {i: [] for i in ids}
    checked = 0
    while sched.active or sched.pending:
        for ev in sched.step():
            got[ev.request_id].extend(ev.new_tokens)
        for slot in list(probe.ctx):
            probe.check(slot)  # context = committed minus anchor, features = target taps, every round
            checked += 1
    for i, p in zip(ids, PROMPTS[:2]):
        assert got[i] == _reference(target, p, n)
    assert checked > 4 and sorted(probe.released) == [0, 0, 1, 1]  # prefill resets + final release


def test_release_and_slot_reuse(target: CausalLM) -> None:
    be = SpecBackend(target, None, max_batch=1, max_seq=32)
    slot = 0
    be.prefill([slot], [PROMPTS[0]])
    be.release(slot)
    assert int(be.cache.lengths[slot]) == 0
    first = be.prefill([slot], [PROMPTS[1]]).argmax(-1)
    assert int(first) == _reference(target, PROMPTS[1], 1)[0]


def test_backend_errors(target: CausalLM) -> None:
    be = SpecBackend(target, None, max_batch=2, max_seq=8)
    with pytest.raises(InvalidArgumentError, match="exceeds max_seq"):
        be.prefill([0], [list(range(1, 10))])
    with pytest.raises(InvalidArgumentError, match="commit without"):
        be.commit([0], torch.tensor([1]))
    with pytest.raises(InvalidArgumentError, match="no drafter"):
        be.draft([0], torch.tensor([1]), 2, [GREEDY])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        be.prefill([2], [[1, 2]])
    be.prefill([0], [[1, 2]])
    be.verify([0], torch.tensor([[3]]), torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="n_keep"):
        be.commit([0], torch.tensor([2]))


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_speculative_loop_with_dspark_drafter_is_lossless(target: CausalLM, policy: str) -> None:
    """A (random-init) DSpark drafter consumes the target's tapped features; output stays the target's greedy."""
    from dspark_trt.runtime.drafters import DSparkConfig, DSparkDrafter, DSparkModel
    from dspark_trt.spec_decode.loop import LoopConfig, generate
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    c = target.config
    cfg = DSparkConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=c.vocab_size, target_layer_ids=(0, 1),
                       num_target_layers=c.num_layers, mask_token_id=3, num_hidden_layers=1, block_size=4)
    torch.manual_seed(0)
    model = DSparkModel(cfg).float()
    model.attach_target(target.embed_tokens.weight, target.lm_head_weight)
    be = SpecBackend(target, DSparkDrafter(model), max_batch=2, max_seq=64)
    n = 20
    res = generate(be, PROMPTS[0], max_new_tokens=n, policy=PolicyConfig(policy=policy, k=3),
                   config=LoopConfig(gamma=4))
    assert res.tokens == _reference(target, PROMPTS[0], n)
    assert res.stats.drafted_tokens > 0  # the drafter ran and its tokens were verified
