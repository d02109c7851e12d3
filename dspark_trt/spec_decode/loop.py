"""The speculative loop: requests in, committed tokens out, one round at a time, over a spec_decode.protocols.Backend.

Owns request admission (batched prefill), the round (draft → pick K per request → verify → accept → commit),
stop conditions (eos, max_new_tokens, stop sequences: nothing is emitted past them), cancellation, the drafter
fallback (an exception in backend.draft makes that round plain decoding, logged and counted) and per-request
statistics. Lossless: every committed token is the target's own greedy choice (or an exact rejection sample).
Knows nothing of model code, KV-cache layout, Triton or tritonclient: only the Backend protocol.

Positions: a request with n committed tokens (prompt + generated) has its anchor at position n − 1; d_1 sits at
position n, which is the `positions` RNG key the loop hands to backend.draft (STREAM_DRAFT) and backend.accept
(STREAM_ACCEPT / STREAM_RESAMPLE), and of the first-token sample.

Overload: `RoundScheduler.speculate` (a constructor argument, settable between steps) turns speculation off —
every request's K is 0 and the drafter is not run — without changing any output (plain rounds commit the
target's own tokens). The serving worker clears it while its queue is deeper than MAX_QUEUE.
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode import accept as spec_accept
from dspark_trt.spec_decode.accept import AcceptResult
from dspark_trt.spec_decode.limits import request_room
from dspark_trt.spec_decode.protocols import Backend, DraftBlock, SamplingParams
from dspark_trt.spec_decode.scheduler import (CostTable, GateMemory, PolicyConfig, PolicyState, observe,
                                              plan_drafting, schedule_batch, verify_cap)
from dspark_trt.spec_decode.stats import RoundRecord, SpecStats

log = logging.getLogger(__name__)

__all__ = ["LoopConfig", "Request", "RoundEvent", "RoundScheduler", "GenerateResult", "generate"]


@dataclass(frozen=True)
class LoopConfig:
    """Batch-level settings of the loop."""

    gamma: int = 7  # draft block size γ (the most any request verifies per round)
    cost_table: CostTable = field(default_factory=CostTable.linear)  # survival policy: SPS by batch tokens

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise InvalidArgumentError(f"gamma (draft block size) must be ≥ 0, got {self.gamma}")


@dataclass(frozen=True)
class Request:
    """One generation request."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    policy: PolicyConfig = PolicyConfig()
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences; output ends with the first one hit

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise InvalidArgumentError("prompt_ids must contain at least one token; pass a non-empty prompt")
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise InvalidArgumentError("stop sequences must be non-empty token-id sequences")

    def check_fits(self, vocab_size: int, max_seq: int, gamma: int) -> None:
        """Raise InvalidArgumentError unless the request fits an executor: prompt + new tokens within
        spec_decode.limits.request_room, every prompt id in the vocabulary. Both round executors ask this."""
        room = request_room(max_seq, gamma)
        if len(self.prompt_ids) + self.max_new_tokens > room:
            raise InvalidArgumentError(
                f"prompt ({len(self.prompt_ids)}) + max_new_tokens ({self.max_new_tokens}) exceeds the {room} tokens "
                f"max_seq {max_seq} leaves after a γ+1 block; shorten the prompt or lower max_new_tokens")
        bad = [t for t in self.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@dataclass
class RoundEvent:
    """What one step() did for one request."""

    request_id: int
    new_tokens: list[int]  # committed this step (may be empty)
    finished: bool
    finish_reason: str | None  # "eos" | "length" | "stop" | "cancelled" | None
    stats: SpecStats  # the request's running stats (live object)


@dataclass
class _Active:
    rid: int
    req: Request
    slot: int
    state: PolicyState
    tokens: list[int] = field(default_factory=list)  # generated so far
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def n_committed(self) -> int:
        return len(self.req.prompt_ids) + len(self.tokens)


def stop_reason(req: Request, tokens: list[int]) -> str | None:
    """Why a request with these generated tokens is finished ("eos" / "stop" / "length"), or None."""
    if tokens and tokens[-1] in req.eos_ids:
        return "eos"
    for s in req.stop_sequences:
        if len(tokens) >= len(s) and tuple(tokens[-len(s):]) == s:
            return "stop"
    if len(tokens) >= req.max_new_tokens:
        return "length"
    return None


def emit_committed(events: dict[int, RoundEvent], rid: int, req: Request, tokens: list[int], stats: SpecStats,
                   toks: Sequence[int]) -> bool:
    """Append a request's committed tokens to `tokens` up to the first stop condition and record them in its round
    event (events[rid], created or extended). True if the request finished."""
    taken: list[int] = []
    reason = None
    for t in toks:
        tokens.append(t)
        taken.append(t)
        reason = stop_reason(req, tokens)
        if reason:
            break
    ev = events.get(rid)
    if ev is None:
        events[rid] = RoundEvent(rid, taken, reason is not None, reason, stats)
    else:
        ev.new_tokens.extend(taken)
        ev.finished, ev.finish_reason = reason is not None, reason
    return reason is not None


class RoundScheduler:
    """Continuous batching of speculative rounds over one Backend.

    speculate: True → each request drafts and verifies up to its policy's K; False → plain rounds (K = 0 for
    everyone, drafter not called), same output, no drafting cost. Read at every step(), so a caller may flip it
    between steps (serve.worker does under overload).
    gate: the survival gate's memory across requests (GateMemory); pass the same one to schedulers that serve
    one stream of requests (SpeculativeDecodingEngine does), default a fresh one.
    """

    def __init__(self, backend: Backend, config: LoopConfig = LoopConfig(), speculate: bool = True,
                 gate: GateMemory | None = None) -> None:
        self.backend = backend
        self.config = config
        self.speculate = speculate
        self.gate = GateMemory() if gate is None else gate
        self._ids = itertools.count()
        self._waiting: list[tuple[int, Request]] = []
        self._active: dict[int, _Active] = {}
        self._free = list(range(backend.max_batch))
        self.totals = SpecStats(keep_rounds=False)  # finished + cancelled requests (counters only)
        self.batched_rounds = 0

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, request: Request) -> int:
        """Queue a request (admitted at the next step()); returns its id."""
        request.check_fits(self.backend.vocab_size, self.backend.max_seq, self.config.gamma)
        if not request.sampling.greedy and request.sampling.seed is None:
            request = replace(request, sampling=replace(request.sampling, seed=random.getrandbits(31)))
        rid = next(self._ids)
        self._waiting.append((rid, request))
        return rid

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or active request and free its slot; False if unknown/finished."""
        for i, (rid, _) in enumerate(self._waiting):
            if rid == request_id:
                del self._waiting[i]
                return True
        act = self._active.pop(request_id, None)
        if act is None:
            return False
        self._release(act)
        return True

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def pending(self) -> int:
        return len(self._waiting) + len(self._active)

    def _release(self, act: _Active) -> None:
        self.backend.release(act.slot)
        self._free.append(act.slot)
        self.totals = self.totals.merge([act.stats], keep_rounds=False)

    # ---- one round ------------------------------------------------------------------------------------
    def step(self) -> list[RoundEvent]:
        """Admit waiting requests (batched prefill), then run ONE speculative round for every active request."""
        events: dict[int, RoundEvent] = {}
        self._admit(events)
        if self._active:
            self._round(events)
        return list(events.values())

    def _emit(self, events: dict[int, RoundEvent], act: _Active, toks: list[int]) -> bool:
        return emit_committed(events, act.rid, act.req, act.tokens, act.stats, toks)

    def _first_tokens(self, logits: torch.Tensor, acts: list[_Active]) -> list[int]:
        """logits [B, V] at each prompt end → first generated token (argmax, or a sample keyed on position)."""
        logits = logits.float().cpu()  # [B, V]: one row per admitted request, cheap to move
        out = logits.argmax(dim=-1)  # [B]
        sampled = [i for i, a in enumerate(acts) if not a.req.sampling.greedy]
        if sampled:
            idx = torch.tensor(sampled)
            sp = [acts[i].req.sampling for i in sampled]
            p = spec_accept.target_probs(logits[idx].float(), torch.tensor([s.temperature for s in sp]),
                                         torch.tensor([s.top_p for s in sp]))  # [b, V]
            seeds = torch.tensor([int(s.seed or 0) for s in sp], dtype=torch.int64)
            pos = torch.tensor([acts[i].n_committed for i in sampled], dtype=torch.int64)
            out[idx] = spec_accept.exponential_race(p, seeds, pos)
        return [int(t) for t in out.tolist()]

    def _admit(self, events: dict[int, RoundEvent]) -> None:
        n = min(len(self._free), len(self._waiting))
        if n == 0:
            return
        batch, self._waiting = self._waiting[:n], self._waiting[n:]
        acts = [_Active(rid, req, self._free.pop(0), PolicyState.initial(req.policy, self.gate))
                for rid, req in batch]
        logits = self.backend.prefill([a.slot for a in acts], [list(a.req.prompt_ids) for a in acts])  # [B, V]
        for act, tok in zip(acts, self._first_tokens(logits, acts)):
            self._active[act.rid] = act
            act.stats.prefill_calls += 1
            act.stats.committed_tokens += 1
            if self._emit(events, act, [tok]):
                del self._active[act.rid]
                self._release(act)

    def _caps(self, acts: list[_Active]) -> list[int]:
        """The most each request may verify: γ, its policy's ceiling, tokens left − 1, cache room (0 for all
        while speculation is off)."""
        if not self.speculate:
            return [0] * len(acts)
        return [verify_cap(a.req.policy, a.state, self.config.gamma, a.req.max_new_tokens - len(a.tokens),
                           self.backend.max_seq, a.n_committed) for a in acts]

    def _draft(self, acts: list[_Active], caps: list[int]) -> tuple[DraftBlock | None, list[int], bool]:
        """Draft for rows with cap > 0 → (block over ALL rows or None, drafted row indices, failed?)."""
        rows = [i for i, c in enumerate(caps) if c > 0]
        if not rows:
            return None, [], False
        gamma = max(caps[i] for i in rows)
        anchors = torch.tensor([acts[i].tokens[-1] for i in rows], dtype=torch.long)  # [R]
        positions = torch.tensor([acts[i].n_committed for i in rows], dtype=torch.long)  # [R] position of d_1
        try:
            block = self.backend.draft([acts[i].slot for i in rows], anchors, gamma,
                                       [acts[i].req.sampling for i in rows], positions)
        except Exception as exc:  # noqa: BLE001 - any drafter failure → plain decoding this round
            log.warning("drafter failed (%s: %s); this round runs as plain decoding", type(exc).__name__, exc)
            return None, rows, True
        if block.tokens.shape != (len(rows), gamma):
            log.warning("drafter returned tokens %s, expected %s; plain decoding this round",
                        tuple(block.tokens.shape), (len(rows), gamma))
            return None, rows, True
        if block.q is None and any(not acts[i].req.sampling.greedy for i in rows):
            log.warning("drafter returned no draft distributions q for sampling requests; plain decoding this round")
            return None, rows, True
        return block, rows, False

    def _accept(self, logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor, q: torch.Tensor | None,
                acts: list[_Active]) -> AcceptResult:
        """Acceptance on the logits' device (kernels on CUDA via the backend); results come back on the CPU."""
        dev = logits.device
        sampling = [a.req.sampling for a in acts]
        positions = torch.tensor([a.n_committed for a in acts], dtype=torch.long, device=dev)  # [B] position of d_1
        draft, k = draft.to(dev), k.to(dev)
        if not all(s.greedy for s in sampling):
            if q is None:  # only reached with K = 0 everywhere (see _round): bonus sampling from p
                q = torch.zeros(logits.shape[0], logits.shape[1] - 1, logits.shape[2])  # [B, K, V]
            q = q.to(dev)
        res = self.backend.accept(logits, draft, k, q, sampling, positions)
        return AcceptResult(res.accepted.cpu(), res.next_token.cpu(), res.top1.cpu(), res.margin.cpu())

    def _round(self, events: dict[int, RoundEvent]) -> None:
        acts = list(self._active.values())
        b = len(acts)
        caps = plan_drafting([a.req.policy for a in acts], [a.state for a in acts], self._caps(acts),
                             self.config.cost_table, self.gate)  # survival rows the drafter cannot pay for: not drafted
        block, rows, failed = self._draft(acts, caps)
        gamma = max((caps[i] for i in rows), default=0)
        conf_all = None
        if block is not None and block.conf is not None:
            conf_all = torch.ones(b, max(gamma, 1))  # [B, γ]; undrafted rows have cap 0 anyway
            conf_all[rows, :gamma] = block.conf.float()
        if failed or block is None:
            caps = [0] * b
        ks = schedule_batch([a.req.policy for a in acts], [a.state for a in acts], caps, conf_all,
                            self.config.cost_table)
        kmax = max(ks)
        draft = torch.zeros(b, kmax, dtype=torch.long)  # [B, K]
        q = None
        if kmax > 0 and block is not None:
            draft[rows] = block.tokens[:, :kmax].long()
            if block.q is not None:
                q = torch.zeros(b, kmax, block.q.shape[-1])  # [B, K, V]
                q[rows] = block.q[:, :kmax].float()
        k = torch.tensor(ks, dtype=torch.long)  # [B]
        anchors = torch.tensor([a.tokens[-1] for a in acts], dtype=torch.long).unsqueeze(1)
        tokens = torch.cat([anchors, draft], dim=1)  # [B, K+1]
        slots = [a.slot for a in acts]
        logits = self.backend.verify(slots, tokens, k)  # [B, K+1, V]
        res = self._accept(logits, draft, k, q, acts)
        self.backend.commit(slots, res.accepted + 1)
        self.batched_rounds += 1
        for i, act in enumerate(acts):
            n_acc = int(res.accepted[i])
            conf = observe(act.req.policy, act.state, ks[i], n_acc, res.top1[i], res.margin[i], self.gate)
            toks = res.committed(draft, i)
            before = len(act.tokens)
            done = self._emit(events, act, toks)
            rec = RoundRecord(ks[i], n_acc, conf, len(act.tokens) - before, fallback=failed and i in rows)
            act.stats.record_round(rec, drafted=block is not None and i in rows,
                                   proposed=gamma if block is not None and i in rows else 0)
            log.debug("req %d: k=%d accepted=%d conf=%.3f next_k=%d", act.rid, ks[i], n_acc, conf, act.state.k)
            if done:
                del self._active[act.rid]
                self._release(act)


@dataclass
class GenerateResult:
    tokens: list[int]  # generated token ids (prompt excluded)
    finish_reason: str
    stats: SpecStats


def generate(
    backend: Backend,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    policy: PolicyConfig = PolicyConfig(),
    eos_ids: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    config: LoopConfig = LoopConfig(),
    gate: GateMemory | None = None,
) -> GenerateResult:
    """Run one request to completion (`gate`: the survival gate's memory of earlier requests, see RoundScheduler)."""
    sched = RoundScheduler(backend, config, gate=gate)
    rid = sched.add(Request(tuple(int(t) for t in prompt_ids), max_new_tokens, sampling, policy,
                            tuple(int(e) for e in eos_ids), tuple(tuple(int(t) for t in s) for s in stop_sequences)))
    tokens: list[int] = []
    while True:
        for ev in sched.step():
            if ev.request_id == rid:
                tokens.extend(ev.new_tokens)
                if ev.finished:
                    return GenerateResult(tokens, ev.finish_reason or "length", ev.stats)
