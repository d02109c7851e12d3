"""The round loop of the GPU-host repository (model_repo_trtllm/): DSpark's K scheduling over TensorRT-LLM engines
served by Triton's in-flight batcher (the `target` and `draft` models, backend "tensorrtllm").

Owns EngineCall / EngineReply / EngineClient (one request to a tensorrtllm model and what comes back, free of
pb_utils; serve.trtllm_bls.PbEngineClient sends them over BLS), `verify_outcome` (a verify reply → accepted and
committed tokens) and TrtllmRoundScheduler, which has spec_decode.loop.RoundScheduler's interface (add / cancel /
step / active / pending / speculate), so serve.worker.InflightBatcher drives it unchanged.

One round, for every active request at once:
1. Caps as RoundScheduler's (γ, the policy's ceiling, tokens left − 1, room), then survival's drafting gate.
2. Draft: one request per drafted row to `draft` (the committed sequence, request_output_len = cap, greedy), all
   concurrently. LM / PARD drafters only: the DSpark drafter needs target hidden states (docs/gpu.md).
3. K per row: spec_decode.scheduler.schedule_batch (LM drafters have no confidence head: survival uses the
   acceptance EMA, as in the reference runtime).
4. Verify: one request per row to `target`: input_ids = the committed sequence, draft_input_ids = d_1..d_K,
   request_output_len = K + 1 (tensorrtllm_backend's BLS rule), all concurrently so the in-flight batcher runs
   them as one batch; enable_kv_cache_reuse makes the resent prefix cheap. The engine verifies: a request with
   K external draft tokens is one step returning the draft's accepted prefix plus one target token (greedy:
   the longest prefix equal to the target's argmax).
5. Commit: accepted = the longest prefix of the returned tokens equal to the draft; every returned token is the
   target's own, so all are committed up to the first stop condition (eos, stop sequence, max_new_tokens — ours:
   no end_id is sent, the engine returns exactly what was asked). The K policies observe (k, accepted, top-1 /
   margin from generation_logits, which only confidence-policy rows request; they cover positions 0..accepted,
   where the reference runtime has all 0..K).

Sampling (temperature > 0) is the engine's: temperature / runtime_top_p / seed go to the target; drafts stay
greedy and the engine's token-match acceptance keeps the target's distribution, but not the reference runtime's
seeded draws. Greedy output equals the target's greedy decoding whatever the drafter and K.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from dspark_trt.errors import ServeError
from dspark_trt.spec_decode import accept as spec_accept
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundEvent, emit_committed
from dspark_trt.spec_decode.scheduler import (GateMemory, PolicyState, observe, plan_drafting, schedule_batch,
                                              verify_cap)
from dspark_trt.spec_decode.stats import RoundRecord, SpecStats

log = logging.getLogger(__name__)

__all__ = ["EngineCall", "EngineReply", "EngineClient", "TrtllmRoundScheduler", "verify_outcome"]


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


@dataclass
class EngineReply:
    """What came back for one EngineCall."""

    tokens: list[int]  # the new tokens (output_ids[0, 0, :sequence_length])
    logits: np.ndarray | None = None  # [n, V] float32 generation logits of those tokens, when asked and returned
    error: str | None = None  # the model's error message (tokens then empty)


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


@dataclass
class _Active:
    rid: int
    req: Request
    state: PolicyState
    tokens: list[int] = field(default_factory=list)  # generated so far
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def seq(self) -> tuple[int, ...]:
        return self.req.prompt_ids + tuple(self.tokens)


Observer = Callable[[str, float, BaseException | None], None]


class TrtllmRoundScheduler:
    """Continuous batching of speculative rounds over tensorrtllm models (RoundScheduler's interface).

    max_batch bounds the requests in flight (the engines' max_batch_size); the rest wait. observe(name, seconds,
    error) is called after each concurrent "draft" / "verify" fan-out (the serving latency histograms)."""

    def __init__(self, client: EngineClient, config: LoopConfig, max_batch: int, max_seq: int, vocab_size: int,
                 target_model: str = "target", draft_model: str | None = "draft", speculate: bool = True,
                 observe: Observer | None = None) -> None:
        self.client = client
        self.config = config
        self.max_batch, self.max_seq, self.vocab_size = max_batch, max_seq, vocab_size
        self.target_model, self.draft_model = target_model, draft_model
        self.speculate = speculate
        self._observe = observe
        self.gate = GateMemory()  # the survival gate across requests
        self._ids = itertools.count()
        self._waiting: list[tuple[int, Request]] = []
        self._active: dict[int, _Active] = {}
        self.totals = SpecStats(keep_rounds=False)
        self.batched_rounds = 0
        self._warned_logits = False

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, request: Request) -> int:
        request.check_fits(self.vocab_size, self.max_seq, self.config.gamma)
        rid = next(self._ids)
        self._waiting.append((rid, request))
        return rid

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or active request (nothing is in flight between rounds); False if unknown/finished."""
        for i, (rid, _) in enumerate(self._waiting):
            if rid == request_id:
                del self._waiting[i]
                return True
        act = self._active.pop(request_id, None)
        if act is None:
            return False
        self.totals = self.totals.merge([act.stats], keep_rounds=False)
        return True

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def pending(self) -> int:
        return len(self._waiting) + len(self._active)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> list[RoundEvent]:
        """Admit waiting requests (one prefill request each, concurrently), then ONE round for every active one."""
        events: dict[int, RoundEvent] = {}
        self._admit(events)
        if self._active:
            self._round(events)
        return list(events.values())

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

    def _call(self, act: _Active, output_len: int, draft: tuple[int, ...] = (), logits: bool = False,
              greedy: bool = False) -> EngineCall:
        """The request for one row; `greedy` forces argmax (drafts), else the request's own sampling settings."""
        s = act.req.sampling
        if greedy or s.greedy:
            return EngineCall(act.seq, output_len, draft, return_logits=logits, request_id=f"dspark-{act.rid}")
        return EngineCall(act.seq, output_len, draft, float(s.temperature), float(s.top_p),
                          None if s.seed is None else int(s.seed), logits, f"dspark-{act.rid}")

    def _emit(self, events: dict[int, RoundEvent], act: _Active, toks: list[int]) -> bool:
        return emit_committed(events, act.rid, act.req, act.tokens, act.stats, toks)

    def _finish(self, act: _Active) -> None:
        del self._active[act.rid]
        self.totals = self.totals.merge([act.stats], keep_rounds=False)

    def _admit(self, events: dict[int, RoundEvent]) -> None:
        n = min(self.max_batch - len(self._active), len(self._waiting))
        if n <= 0:
            return
        batch, self._waiting = self._waiting[:n], self._waiting[n:]
        acts = [_Active(rid, req, PolicyState.initial(req.policy, self.gate)) for rid, req in batch]
        replies = self._fan_out("prefill", self.target_model, [self._call(a, 1) for a in acts])
        for act, rep in zip(acts, replies):
            if rep.error or not rep.tokens:
                raise ServeError(f"the target engine failed the prefill of a request: {rep.error or 'no tokens'}")
            self._active[act.rid] = act
            act.stats.prefill_calls += 1
            act.stats.committed_tokens += 1
            if self._emit(events, act, [int(rep.tokens[0])]):
                self._finish(act)

    def _caps(self, acts: list[_Active]) -> list[int]:
        if not self.speculate or self.draft_model is None:
            return [0] * len(acts)
        return [verify_cap(a.req.policy, a.state, self.config.gamma, a.req.max_new_tokens - len(a.tokens),
                           self.max_seq, len(a.seq)) for a in acts]

    def _draft(self, acts: list[_Active], caps: list[int]) -> tuple[dict[int, tuple[int, ...]], set[int]]:
        """Draft the rows with cap > 0 → ({row: d_1..d_cap}, rows whose drafting failed → plain this round)."""
        rows = [i for i, c in enumerate(caps) if c > 0]
        if not rows or self.draft_model is None:
            return {}, set()
        try:
            replies = self._fan_out("draft", self.draft_model, [self._call(acts[i], caps[i], greedy=True)
                                                                  for i in rows])
        except Exception as exc:  # noqa: BLE001 - a drafter failure makes the round plain decoding
            log.warning("draft engine failed (%s: %s); this round runs as plain decoding", type(exc).__name__, exc)
            return {}, set(rows)
        out: dict[int, tuple[int, ...]] = {}
        failed: set[int] = set()
        for i, rep in zip(rows, replies):
            if rep.error or not rep.tokens:
                log.warning("draft engine failed for request %d (%s); plain decoding for it this round", acts[i].rid,
                            rep.error or "no tokens")
                failed.add(i)
            else:
                out[i] = tuple(int(t) for t in rep.tokens[: caps[i]])
        return out, failed

    def _signals(self, act: _Active, rep: EngineReply, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """top-1 / margin [n] of the target at the returned positions (NaN [1] without logits)."""
        if rep.logits is None or rep.logits.size == 0:
            if act.req.policy.policy == "confidence":
                if not self._warned_logits:
                    log.warning("the target engine returned no generation_logits for a confidence-policy request "
                                "(build it with --gather_generation_logits); its confidence signals count as 0")
                    self._warned_logits = True
                return torch.zeros(k + 1), torch.zeros(k + 1)
            return torch.full((1,), math.nan), torch.full((1,), math.nan)
        logits = torch.from_numpy(np.asarray(rep.logits, dtype=np.float32)).reshape(1, -1, rep.logits.shape[-1])
        s = act.req.sampling
        temp = torch.tensor([1.0 if s.greedy else float(s.temperature)])
        probs = spec_accept.target_probs(logits, temp, torch.tensor([float(s.top_p)]))  # [1, n, V]
        top1, margin = spec_accept.top_signals(probs, torch.ones(probs.shape[:2], dtype=torch.bool))
        return top1[0], margin[0]

    def _round(self, events: dict[int, RoundEvent]) -> None:
        acts = list(self._active.values())
        cfgs, states = [a.req.policy for a in acts], [a.state for a in acts]
        caps = plan_drafting(cfgs, states, self._caps(acts), self.config.cost_table, self.gate)
        drafts, failed = self._draft(acts, caps)
        caps = [len(drafts.get(i, ())) for i in range(len(acts))]
        ks = schedule_batch(cfgs, states, caps, None, self.config.cost_table)
        calls = [self._call(a, ks[i] + 1, drafts.get(i, ())[: ks[i]], a.req.policy.policy == "confidence")
                 for i, a in enumerate(acts)]
        replies = self._fan_out("verify", self.target_model, calls)
        self.batched_rounds += 1
        for i, (act, call, rep) in enumerate(zip(acts, calls, replies)):
            if rep.error:
                raise ServeError(f"the target engine failed a verify request: {rep.error}")
            n_acc, toks = verify_outcome(call.draft_ids, rep.tokens)
            top1, margin = self._signals(act, rep, ks[i])
            conf = observe(act.req.policy, act.state, ks[i], n_acc, top1, margin, self.gate)
            before = len(act.tokens)
            done = self._emit(events, act, toks)
            rec = RoundRecord(ks[i], n_acc, conf, len(act.tokens) - before, fallback=i in failed)
            act.stats.record_round(rec, drafted=i in drafts, proposed=len(drafts.get(i, ())))
            log.debug("req %d: k=%d accepted=%d committed=%d", act.rid, ks[i], n_acc, len(toks))
            if done:
                self._finish(act)
