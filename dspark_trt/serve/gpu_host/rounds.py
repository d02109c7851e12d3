"""The round executor of the GPU-host repository (model_repo_trtllm/): DSpark's rounds over TensorRT-LLM engines
served by Triton's in-flight batcher (the `target` and `draft` models, backend "tensorrtllm").

Owns EngineCall / EngineReply / EngineClient (one request to a tensorrtllm model and what comes back, free of
pb_utils; serve.gpu_host.bls.PbEngineClient sends them over BLS), `verify_outcome` (a verify reply → accepted and
committed tokens), TrtllmExecutor (spec_decode.protocols.RoundExecutor over an EngineClient: the engine calls of
prefill, draft and verify) and TrtllmRoundScheduler (spec_decode.loop.RoundScheduler over a TrtllmExecutor, the
one the `dspark` model hands to serve.worker.InflightBatcher). Requests, caps (spec_decode.scheduler.verify_cap),
the drafting gate, K per row (schedule_batch), stop conditions, cancellation and stats are the RoundScheduler's,
as for the reference runtime; what this module adds is how each step runs on the engines:

- Prefill: one request per admitted row to `target` (the prompt, request_output_len = 1), all concurrently.
- Draft: one request per drafted row to `draft` (the committed sequence, request_output_len = cap, greedy), all
  concurrently. LM / PARD drafters only: the DSpark drafter needs target hidden states (docs/gpu.md). No
  confidence head: survival uses the acceptance EMA, as for the reference runtime's LM drafters.
- Verify: one request per row to `target`: input_ids = the committed sequence, draft_input_ids = d_1..d_K,
  request_output_len = K + 1 (tensorrtllm_backend's BLS rule), all concurrently so the in-flight batcher runs
  them as one batch; enable_kv_cache_reuse makes the resent prefix cheap. The engine verifies: a request with
  K external draft tokens is one step returning the draft's accepted prefix plus one target token (greedy:
  the longest prefix equal to the target's argmax), and keeps nothing between rounds, so the commit is the reply.
  accepted = the longest prefix of the returned tokens equal to the draft; every returned token is the target's
  own, so all are committed (no end_id is sent: the engine returns exactly what was asked; the scheduler applies
  eos / stop sequences / max_new_tokens). Top-1 / margin for the K policies come from generation_logits, which
  only confidence-policy rows request; they cover positions 0..accepted, where the reference runtime has all 0..K.

Sampling (temperature > 0) is the engine's: temperature / runtime_top_p / seed go to the target; drafts stay
greedy and the engine's token-match acceptance keeps the target's distribution, but not the reference runtime's
seeded draws. Greedy output equals the target's greedy decoding whatever the drafter and K.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from dspark_trt.errors import ServeError
from dspark_trt.spec_decode import accept as spec_accept
from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler
from dspark_trt.spec_decode.protocols import DraftBlock, DraftOutcome, RoundRow, VerifyOutcome

log = logging.getLogger(__name__)

__all__ = ["EngineCall", "EngineReply", "EngineClient", "TrtllmExecutor", "TrtllmRoundScheduler", "verify_outcome"]


@dataclass(frozen=True)
class EngineCall:
    """One request to a tensorrtllm model (non-streaming, beam 1, exclude_input_in_output)."""

    input_ids: tuple[int, ...]  # the committed sequence (prompt + generated)
    output_len: int  # request_output_len
    draft_ids: tuple[int, ...] = ()  # draft_input_ids (target only; empty: a plain step)
    temperature: float = 0.0  # 0: greedy (nothing sent)
    top_p: float = 1.0
    seed: int | None = None
    return_logits: bool = False  # return_generation_logits
    request_id: str = ""
    context_logits: bool = False  # return_context_logits (the tapped target: logits of the computed input rows)
    taps: tuple[str, ...] = ()  # the tapped target's extra outputs to return ("dspark_tap_<layer>")


@dataclass
class EngineReply:
    """What came back for one EngineCall."""

    tokens: list[int]  # the new tokens (output_ids[0, 0, :sequence_length])
    logits: np.ndarray | None = None  # [n, V] float32 generation logits of those tokens, when asked and returned
    error: str | None = None  # the model's error message (tokens then empty)
    context_logits: np.ndarray | None = None  # [n, V] float32: the last n input positions' logits (n < input
    # length where the engine reused cached KV blocks for the prefix)
    taps: dict[str, np.ndarray] | None = None  # name → [n, H] float32 residual rows of the same n input positions


class EngineClient(Protocol):
    """Sends EngineCalls to a model concurrently (so Triton's batcher sees them together); one reply each, in order."""

    def generate(self, model: str, calls: Sequence[EngineCall]) -> list[EngineReply]: ...


def verify_outcome(draft: Sequence[int], new: Sequence[int]) -> tuple[int, list[int]]:
    """draft d_1..d_K sent, new tokens returned → (accepted, committed): accepted = the longest prefix of `new`
    equal to the draft (at most len(committed) − 1), committed = new[:K + 1] (all target tokens)."""
    if not new:
        raise ServeError("the target engine returned no tokens for a verify request; check the tensorrtllm model's "
                         "log (request_output_len must be ≥ 1 and the engine built with --max_draft_len ≥ K)")
    committed = [int(t) for t in new[: len(draft) + 1]]
    a = 0
    while a < len(draft) and a < len(committed) and committed[a] == int(draft[a]):
        a += 1
    return min(a, len(committed) - 1), committed


Observer = Callable[[str, float, BaseException | None], None]


class TrtllmExecutor:
    """spec_decode.protocols.RoundExecutor over tensorrtllm models: one engine request per row and step, each step's
    requests sent at once (one batch for Triton's in-flight batcher). Slots only bound the rows in flight (the
    engines' max_batch_size); the engines keep no per-request state between rounds. observe(name, seconds, error)
    is called after each "draft" / "verify" fan-out (the serving latency histograms)."""

    keyed_sampling = False  # the engine samples; a request's seed goes through as given

    def __init__(self, client: EngineClient, max_batch: int, max_seq: int, vocab_size: int,
                 target_model: str = "target", draft_model: str | None = "draft",
                 observe: Observer | None = None) -> None:
        self.client = client
        self.max_batch, self.max_seq, self.vocab_size = max_batch, max_seq, vocab_size
        self.target_model, self.draft_model = target_model, draft_model
        self.can_draft = draft_model is not None
        self._observe = observe
        self._warned_logits = False

    def release(self, slot: int) -> None:
        """Nothing to free: the engines hold no state of a request between rounds."""

    def _fan_out(self, name: str, model: str, calls: list[EngineCall]) -> list[EngineReply]:
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            replies = self.client.generate(model, calls)
            if len(replies) != len(calls):
                raise ServeError(f"{model}: {len(replies)} replies for {len(calls)} requests")
            return replies
        except BaseException as exc:
            error = exc
            raise
        finally:
            if self._observe is not None and name in ("draft", "verify"):
                self._observe(name, time.perf_counter() - t0, error)

    @staticmethod
    def _call(row: RoundRow, output_len: int, draft: tuple[int, ...] = (), logits: bool = False,
              greedy: bool = False) -> EngineCall:
        """The request for one row; `greedy` forces argmax (drafts), else the request's own sampling settings."""
        s = row.sampling
        if greedy or s.greedy:
            return EngineCall(row.sequence, output_len, draft, return_logits=logits, request_id=f"dspark-{row.rid}")
        return EngineCall(row.sequence, output_len, draft, float(s.temperature), float(s.top_p),
                          None if s.seed is None else int(s.seed), logits, f"dspark-{row.rid}")

    def prefill(self, rows: Sequence[RoundRow]) -> list[int]:
        """One request per row (its prompt, one new token), concurrently → each row's first token."""
        replies = self._fan_out("prefill", self.target_model, [self._call(r, 1) for r in rows])
        first: list[int] = []
        for rep in replies:
            if rep.error or not rep.tokens:
                raise ServeError(f"the target engine failed the prefill of a request: {rep.error or 'no tokens'}")
            first.append(int(rep.tokens[0]))
        return first

    def draft(self, rows: Sequence[RoundRow], caps: Sequence[int]) -> DraftOutcome:
        """One greedy request of caps[r] tokens per row to the draft engine, concurrently; a row whose request failed
        gets proposed 0."""
        assert self.draft_model is not None  # can_draft
        replies = self._fan_out("draft", self.draft_model, [self._call(r, c, greedy=True) for r, c in zip(rows, caps)])
        drafts: list[list[int]] = []
        for row, cap, rep in zip(rows, caps, replies):
            if rep.error or not rep.tokens:
                log.warning("draft engine failed for request %d (%s); plain decoding for it this round", row.rid,
                            rep.error or "no tokens")
                drafts.append([])
            else:
                drafts.append([int(t) for t in rep.tokens[:cap]])
        tokens = torch.zeros(len(rows), max(caps), dtype=torch.long)  # [R, γ'] right-padded
        for r, d in enumerate(drafts):
            tokens[r, :len(d)] = torch.tensor(d, dtype=torch.long)
        return DraftOutcome(DraftBlock(tokens, None, None), tuple(len(d) for d in drafts))

    def verify(self, rows: Sequence[RoundRow], draft: DraftBlock, k: Sequence[int]) -> VerifyOutcome:
        """One request per row to the target engine (sequence + d_1..d_k, K + 1 tokens back), concurrently; the
        reply is the commit (verify_outcome)."""
        calls = [self._call(r, k[i] + 1, tuple(int(t) for t in draft.tokens[i, :k[i]].tolist()),
                            r.policy.policy == "confidence") for i, r in enumerate(rows)]
        replies = self._fan_out("verify", self.target_model, calls)
        accepted: list[int] = []
        committed: list[tuple[int, ...]] = []
        top1: list[torch.Tensor] = []
        margin: list[torch.Tensor] = []
        for row, call, rep, k_r in zip(rows, calls, replies, k):
            if rep.error:
                raise ServeError(f"the target engine failed a verify request: {rep.error}")
            n_acc, toks = verify_outcome(call.draft_ids, rep.tokens)
            t1, m = self._signals(row, rep, k_r)
            accepted.append(n_acc)
            committed.append(tuple(toks))
            top1.append(t1.tolist())
            margin.append(m.tolist())
        return VerifyOutcome(tuple(accepted), tuple(committed), tuple(top1), tuple(margin))

    def _signals(self, row: RoundRow, rep: EngineReply, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """top-1 / margin [n] of the target at the returned positions (NaN [1] without logits)."""
        if rep.logits is None or rep.logits.size == 0:
            if row.policy.policy == "confidence":
                if not self._warned_logits:
                    log.warning("the target engine returned no generation_logits for a confidence-policy request "
                                "(build it with --gather_generation_logits); its confidence signals count as 0")
                    self._warned_logits = True
                return torch.zeros(k + 1), torch.zeros(k + 1)
            return torch.full((1,), math.nan), torch.full((1,), math.nan)
        logits = torch.from_numpy(np.asarray(rep.logits, dtype=np.float32)).reshape(1, -1, rep.logits.shape[-1])
        s = row.sampling
        temp = torch.tensor([1.0 if s.greedy else float(s.temperature)])
        probs = spec_accept.target_probs(logits, temp, torch.tensor([float(s.top_p)]))  # [1, n, V]
        top1, margin = spec_accept.top_signals(probs, torch.ones(probs.shape[:2], dtype=torch.bool))
        return top1[0], margin[0]


class TrtllmRoundScheduler(RoundScheduler):
    """spec_decode.loop.RoundScheduler over a TrtllmExecutor (the GPU-host `dspark` model's scheduler): the same
    admission, caps, K policies, stops, cancel and stats as the reference runtime's, with the engines' steps.

    max_batch bounds the requests in flight (the engines' max_batch_size); the rest wait. observe: see
    TrtllmExecutor. The survival gate is this scheduler's own (one per served model)."""

    def __init__(self, client: EngineClient, config: LoopConfig, max_batch: int, max_seq: int, vocab_size: int,
                 target_model: str = "target", draft_model: str | None = "draft", speculate: bool = True,
                 observe: Observer | None = None) -> None:
        super().__init__(TrtllmExecutor(client, max_batch, max_seq, vocab_size, target_model, draft_model, observe),
                         config, speculate)
