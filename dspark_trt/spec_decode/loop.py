"""The speculative loop: requests in, committed tokens out, one round at a time, over a RoundExecutor.

Owns the one RoundScheduler of every execution path: requests and their KV slots, admission (batched prefill),
the round (caps → suffix proposals → drafting gate → proposer choice → draft → pick K per request → verify →
accept → commit; spec_decode.proposers chooses DSpark / suffix / nothing per row), stop conditions (eos,
max_new_tokens, stop sequences: nothing is emitted past them), cancellation, the drafter fallback (an exception in
the draft step, or a row the executor could not draft, makes that round plain decoding for it, logged and counted)
and per-request statistics. Lossless: every committed token is the target's own greedy choice (or an exact
rejection sample). The model side is a spec_decode.protocols.RoundExecutor: spec_decode.executor.BackendExecutor
(the reference runtime, built from any protocols.Backend passed here) or serve.gpu_host.rounds.TrtllmExecutor
(TensorRT-LLM engines). Knows nothing of model code, KV-cache layout, Triton or tritonclient.

Positions: a request with n committed tokens (prompt + generated) has its anchor at position n − 1; d_1 sits at
position n, the `positions` RNG key of draft sampling (STREAM_DRAFT), acceptance (STREAM_ACCEPT /
STREAM_RESAMPLE) and the first-token sample (RoundRow.n_committed).

Overload: `RoundScheduler.speculate` (a constructor argument, settable between steps) turns speculation off —
every request's K is 0 and the drafter is not run — without changing any output (plain rounds commit the
target's own tokens). The serving worker clears it while its queue is deeper than MAX_QUEUE.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.calibrate import Calibration
from dspark_trt.spec_decode.confidence import survival
from dspark_trt.spec_decode.costs import NO_PREFILL, RoundLoad
from dspark_trt.spec_decode.executor import BackendExecutor
from dspark_trt.spec_decode.limits import check_room, check_token_ids
from dspark_trt.spec_decode.proposers import (DSPARK, NONE, SUFFIX, assemble, first_token_floor, skip_drafter,
                                              worth_proposing)
from dspark_trt.spec_decode.protocols import Backend, DraftOutcome, RoundExecutor, SamplingParams
from dspark_trt.spec_decode.scheduler import (CostTable, GateMemory, PolicyConfig, PolicyState, observe,
                                              plan_drafting, schedule_batch, verify_cap)
from dspark_trt.spec_decode.stats import RoundRecord, SpecStats
from dspark_trt.spec_decode.suffix import SuffixProposal, SuffixProposer

log = logging.getLogger(__name__)

__all__ = ["LoopConfig", "Request", "RoundEvent", "RoundScheduler", "GenerateResult", "generate"]


@dataclass(frozen=True)
class LoopConfig:
    """Batch-level settings of the loop."""

    gamma: int = 7  # draft block size γ (the most any request verifies per round)
    cost_table: CostTable = field(default_factory=CostTable.linear)  # survival policy: SPS by batch tokens
    # chunked prefill: at most this many prompt tokens per step (0: whole prompts at admission). A long prompt is
    # then prefilled over several steps while the generating requests keep their rounds; it starts generating
    # when its prompt is in. Needs an executor with chunked_prefill (else whole prompts).
    prefill_chunk: int = 0
    # the table is refitted from the loop's own timed rounds and the drafter's c_j from what it verified
    # (spec_decode.calibrate.Calibration); False: both as given (reproducible K choices, e.g. to compare policies
    # against one fixed price list)
    calibrate: bool = True

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise InvalidArgumentError(f"gamma (draft block size) must be ≥ 0, got {self.gamma}")
        if self.prefill_chunk < 0:
            raise InvalidArgumentError(f"prefill_chunk must be ≥ 0 (0 = whole prompts), got {self.prefill_chunk}")


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
        spec_decode.limits.request_room, every prompt id in the vocabulary (limits.check_room / check_token_ids, the
        checks served requests pass at their entry point too). RoundScheduler.add asks this: the loop's own
        invariant, for in-process callers; a served request reaches it already validated."""
        check_room(len(self.prompt_ids), self.max_new_tokens, max_seq, gamma)
        check_token_ids(self.prompt_ids, vocab_size)


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
    """An admitted request: a spec_decode.protocols.RoundRow for the executor, plus what the scheduler keeps."""

    rid: int
    req: Request
    slot: int
    state: PolicyState
    tokens: list[int] = field(default_factory=list)  # generated so far
    stats: SpecStats = field(default_factory=SpecStats)
    prefilled: int = 0  # prompt tokens in the slot's cache (chunked prefill; the whole prompt once generating)

    @property
    def sampling(self) -> SamplingParams:
        return self.req.sampling

    @property
    def policy(self) -> PolicyConfig:
        return self.req.policy

    @property
    def sequence(self) -> tuple[int, ...]:
        return self.req.prompt_ids + tuple(self.tokens)

    @property
    def n_committed(self) -> int:
        return len(self.req.prompt_ids) + len(self.tokens)

    @property
    def anchor(self) -> int:
        return self.tokens[-1]


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


class RoundScheduler:
    """Continuous batching of speculative rounds over one RoundExecutor (or a protocols.Backend, which runs through
    spec_decode.executor.BackendExecutor).

    speculate: True → each request drafts and verifies up to its policy's K; False → plain rounds (K = 0 for
    everyone, drafter not called), same output, no drafting cost. Read at every step(), so a caller may flip it
    between steps (serve.worker does under overload).
    gate: the survival gate's memory across requests (GateMemory); pass the same one to schedulers that serve
    one stream of requests (SpeculativeDecodingEngine does), default a fresh one.
    Each round is priced with the prompt tokens its step admitted (spec_decode.costs.RoundLoad), fused into the
    verify pass when the executor says so (an optional `fused_prefill` attribute, default False: both executors
    today prefill in a pass of their own, which does not move K).
    suffix: the suffix proposer (spec_decode.suffix: its cross-request index of recent outputs and its learned
    confidences) for requests whose policy lists "suffix" in proposers; share one like `gate`; default: made on
    first use.
    calibration: config.cost_table refitted from this loop's timed rounds and the drafter's confidences corrected
    by its acceptance (spec_decode.calibrate.Calibration); share one like `gate`; default: a fresh one (None with
    config.calibrate off).
    """

    def __init__(self, executor: RoundExecutor | Backend, config: LoopConfig = LoopConfig(), speculate: bool = True,
                 gate: GateMemory | None = None, suffix: SuffixProposer | None = None,
                 calibration: Calibration | None = None) -> None:
        self.executor: RoundExecutor = executor if isinstance(executor, RoundExecutor) else BackendExecutor(executor)
        self.config = config
        self.speculate = speculate
        self.gate = GateMemory() if gate is None else gate
        self.suffix = suffix
        self.calibration = calibration if calibration is not None or not config.calibrate else \
            Calibration(config.cost_table)
        self.clock: Callable[[], float] = time.perf_counter  # what the rounds are timed with (seconds)
        self._key = object()  # this scheduler's part of its requests' keys in a shared SuffixProposer
        self._ids = itertools.count()
        self._waiting: list[tuple[int, Request]] = []
        self._active: dict[int, _Active] = {}
        self._prefilling: list[_Active] = []  # chunked prefill: admitted (a slot), prompt not yet all in, FIFO
        self._free = list(range(self.executor.max_batch))  # KV slots of no request
        self.totals = SpecStats(keep_rounds=False)  # finished + cancelled requests (counters only)
        self.batched_rounds = 0

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, request: Request) -> int:
        """Queue a request (admitted at the next step()); returns its id."""
        ex = self.executor
        request.check_fits(ex.vocab_size, ex.max_seq, self.config.gamma)
        if ex.keyed_sampling and not request.sampling.greedy and request.sampling.seed is None:
            request = replace(request, sampling=replace(request.sampling, seed=random.getrandbits(31)))
        rid = next(self._ids)
        self._waiting.append((rid, request))
        return rid

    def cancel(self, request_id: int) -> bool:
        """Drop a waiting or active request (nothing is in flight between steps) and free its slot; False if
        unknown or finished."""
        for i, (rid, _) in enumerate(self._waiting):
            if rid == request_id:
                del self._waiting[i]
                return True
        for i, act in enumerate(self._prefilling):
            if act.rid == request_id:
                del self._prefilling[i]
                self._release(act)
                return True
        act = self._active.pop(request_id, None)
        if act is None:
            return False
        self._release(act)
        return True

    @property
    def active(self) -> int:
        """Requests holding a KV slot (generating, or their prompt being prefilled in chunks)."""
        return len(self._active) + len(self._prefilling)

    @property
    def pending(self) -> int:
        return len(self._waiting) + self.active

    def _release(self, act: _Active) -> None:
        if self.suffix is not None:  # its output joins the cross-request index
            self.suffix.release((self._key, act.rid), act.sequence, len(act.req.prompt_ids))
        self.executor.release(act.slot)
        self._free.append(act.slot)
        self.totals = self.totals.merge([act.stats], keep_rounds=False)

    def _finish(self, act: _Active) -> None:
        del self._active[act.rid]
        self._release(act)

    def _emit(self, events: dict[int, RoundEvent], act: _Active, toks: Sequence[int]) -> bool:
        """Append committed tokens to the request up to its first stop condition and record them in its round event
        (created or extended). True if the request finished."""
        taken: list[int] = []
        reason = None
        for t in toks:
            act.tokens.append(t)
            taken.append(t)
            reason = stop_reason(act.req, act.tokens)
            if reason:
                break
        ev = events.get(act.rid)
        if ev is None:
            events[act.rid] = RoundEvent(act.rid, taken, reason is not None, reason, act.stats)
        else:
            ev.new_tokens.extend(taken)
            ev.finished, ev.finish_reason = reason is not None, reason
        return reason is not None

    # ---- one step -------------------------------------------------------------------------------------
    def step(self, on_admit: Callable[[list[RoundEvent]], None] | None = None) -> list[RoundEvent]:
        """Admit waiting requests (batched prefill), then run ONE speculative round for every active request.
        on_admit: receives the admission's events (each admitted request's first token) before the round runs, so
        a server can send them without waiting for the round (its drafter pass included); the returned events then
        hold the round's tokens only. Without it, one event per request holds both."""
        events: dict[int, RoundEvent] = {}
        prefilled = self._admit(events)
        if on_admit is not None and events:
            on_admit(list(events.values()))
            events = {}
        if self._active:  # the survival rule prices the round with the prompts it admitted (spec_decode.costs)
            self._round(events, RoundLoad(prefilled, bool(getattr(self.executor, "fused_prefill", False))))
        return list(events.values())

    def _admit(self, events: dict[int, RoundEvent]) -> int:
        """Prefill as many waiting requests as there are free slots → the prompt tokens prefilled (chunked: within
        the step's budget, LoopConfig.prefill_chunk)."""
        if self.config.prefill_chunk and getattr(self.executor, "chunked_prefill", False):
            return self._admit_chunks(events, self.config.prefill_chunk)
        n = min(len(self._free), len(self._waiting))
        if n == 0:
            return 0
        batch, self._waiting = self._waiting[:n], self._waiting[n:]
        acts = [_Active(rid, req, self._free.pop(0), PolicyState.initial(req.policy, self.gate))
                for rid, req in batch]
        try:
            first = self.executor.prefill(acts)
        except BaseException:
            self._free[:0] = [a.slot for a in acts]  # the requests fail (the caller answers them), the slots stay
            raise
        for act, tok in zip(acts, first):
            self._start(events, act, tok)
        return sum(len(a.req.prompt_ids) for a in acts)

    def _start(self, events: dict[int, RoundEvent], act: _Active, first: int) -> None:
        """A request whose prompt is all in its slot: its first token, then its rounds."""
        act.prefilled = len(act.req.prompt_ids)
        self._active[act.rid] = act
        act.stats.prefill_calls += 1
        act.stats.committed_tokens += 1
        if self._emit(events, act, [first]):
            self._finish(act)

    def _admit_chunks(self, events: dict[int, RoundEvent], budget: int) -> int:
        """Chunked prefill: continue the prompts being prefilled (oldest first), then admit waiting requests into
        free slots, all within `budget` prompt tokens, in one batched pass → the prompt tokens prefilled."""
        rows: list[_Active] = []
        spans: list[tuple[int, int]] = []
        left = budget
        for act in self._prefilling:
            if left <= 0:
                break
            n = min(len(act.req.prompt_ids) - act.prefilled, left)
            rows.append(act)
            spans.append((act.prefilled, act.prefilled + n))
            left -= n
        new: list[_Active] = []
        while left > 0 and self._free and self._waiting:
            rid, req = self._waiting.pop(0)
            act = _Active(rid, req, self._free.pop(0), PolicyState.initial(req.policy, self.gate))
            new.append(act)
            n = min(len(req.prompt_ids), left)
            rows.append(act)
            spans.append((0, n))
            left -= n
        if not rows:
            return 0
        try:
            first = self.executor.prefill(rows, spans)
        except BaseException:  # the requests fail (the caller answers them); the slots return
            self._free[:0] = [a.slot for a in new]
            for act in rows:
                if act in self._prefilling:
                    self._prefilling.remove(act)
                    self._free.insert(0, act.slot)
            raise
        self._prefilling.extend(new)
        for act, (_, end), tok in zip(rows, spans, first):
            act.prefilled = end
            if end == len(act.req.prompt_ids):  # (prefill_calls counts a prompt once, however many chunks)
                self._prefilling.remove(act)
                self._start(events, act, tok)
        return budget - left

    def _caps(self, acts: list[_Active]) -> list[int]:
        """The most each request may verify: γ, its policy's ceiling, tokens left − 1, cache room (0 for all
        while speculation is off; an executor without a drafter gets 0 for DSpark in _round, the suffix may still
        propose)."""
        if not self.speculate:
            return [0] * len(acts)
        return [verify_cap(a.req.policy, a.state, self.config.gamma, a.req.max_new_tokens - len(a.tokens),
                           self.executor.max_seq, a.n_committed) for a in acts]

    def _draft(self, acts: list[_Active], caps: list[int]) -> tuple[list[int], DraftOutcome | None]:
        """Draft the rows with cap > 0 → (their indices, the executor's outcome for them; None: no row drafts)."""
        rows = [i for i, c in enumerate(caps) if c > 0]
        if not rows:
            return rows, None
        try:
            return rows, self.executor.draft([acts[i] for i in rows], [caps[i] for i in rows])
        except Exception as exc:  # noqa: BLE001 - any drafter failure → plain decoding this round
            log.warning("drafter failed (%s: %s); this round runs as plain decoding", type(exc).__name__, exc)
            return rows, DraftOutcome.failed(len(rows))

    def _suffix_proposals(self, acts: list[_Active], caps: list[int]) -> list[SuffixProposal | None]:
        """[B] each row's suffix proposal (None: not asked for, cap 0 or no match); the proposer is made on first use."""
        want = [c > 0 and a.req.policy.uses(SUFFIX) for a, c in zip(acts, caps)]
        if not any(want) or not worth_proposing(len(acts), max(caps), self.config.cost_table):
            return [None] * len(acts)  # (a batch where even a proposal accepted whole cannot pay: no lookups)
        if self.suffix is None:
            self.suffix = SuffixProposer()
        floor = first_token_floor(len(acts), self.config.cost_table)  # below it no first token is verified
        return [self.suffix.propose((self._key, a.rid), a.sequence, c, min_first=floor) if w else None
                for a, c, w in zip(acts, caps, want)]

    @property
    def cost_table(self) -> CostTable:
        """What the next round prices with: the calibrated table, else config.cost_table."""
        return self.calibration.table if self.calibration is not None else self.config.cost_table

    def _round(self, events: dict[int, RoundEvent], load: RoundLoad = NO_PREFILL) -> None:
        start = self.clock()
        acts = list(self._active.values())
        b = len(acts)
        cfgs, states = [a.req.policy for a in acts], [a.state for a in acts]
        table = self.cost_table
        caps = self._caps(acts)  # the most each row may verify, whoever proposes
        sfx = self._suffix_proposals(acts, caps)  # [B]: a dict probe per match order, no model pass
        dcaps = [c if cfg.uses(DSPARK) and self.executor.can_draft else 0 for c, cfg in zip(caps, cfgs)]
        sampled = [not a.sampling.greedy for a in acts]  # [B] their drafting costs more (q, draws, its acceptance)
        ctx = [a.n_committed for a in acts]  # [B] cached tokens: a long context makes verify tokens dearer
        dcaps = plan_drafting(cfgs, states, dcaps, table, self.gate, load, sampled, ctx)  # rows that cannot pay
        dcaps = skip_drafter(dcaps, sfx, states, table, sampled, ctx)  # rows the suffix serves as well: undrafted
        t_draft = self.clock()
        rows, drafted = self._draft(acts, dcaps)
        t_draft = self.clock() - t_draft if drafted is not None else 0.0
        asked, proposed = [False] * b, [0] * b  # per row: drafting asked for, tokens drafted (0 asked: failed)
        for i, n in zip(rows, drafted.proposed if drafted is not None else ()):
            asked[i], proposed[i] = True, n
        block = drafted.block if drafted is not None else None
        raw = None  # [R, γ'] the head's own c_j (the calibration learns from them; the round uses the corrected)
        row_of = {i: j for j, i in enumerate(rows)}  # batch row → its row in the drafter's block
        if block is not None and block.conf is not None and self.calibration is not None:
            raw = block.conf
            block = replace(block, conf=self.calibration.acceptance.correct(raw, [acts[i].sampling.greedy
                                                                                   for i in rows]))
        models = {}  # row → the drafter's calibrated survival over its block (the gate's estimate folds it)
        if block is not None and block.conf is not None:
            surv = survival(block.conf).tolist()  # [R, γ'] one product over the drafted rows
            models = {i: surv[j][:min(proposed[i], dcaps[i])] for j, i in enumerate(rows) if proposed[i] > 0}
        plan = assemble(cfgs, states, [a.sampling for a in acts], caps, dcaps, rows, proposed, block, sfx,
                        self.executor.vocab_size, table)
        ks = schedule_batch(cfgs, states, plan.avail, plan.conf, table, load=load, contexts=ctx)
        t_verify = self.clock()
        out = self.executor.verify(acts, plan.block(max(ks)), ks)  # tokens [B, K], q [B, K, V] | None
        t_verify = self.clock() - t_verify
        self.batched_rounds += 1
        if self.calibration is not None and not (load.fused and load.prefill_tokens):  # (calibrate.OnlineCosts:
            self.calibration.costs.observe(  # not a round whose prompt tokens shared its verify pass)
                t_verify, ks, ctx, rows, sum(sampled[i] for i in rows),
                sum(drafted.flushed) if drafted is not None else 0, t_draft, self.clock() - start)
        for i, act in enumerate(acts):
            n_acc, src = out.accepted[i], plan.source[i] if ks[i] > 0 else NONE
            if sfx[i] is not None and self.suffix is not None:  # c_j learns from every round it proposed in
                if src == SUFFIX:
                    self.suffix.observe(sfx[i], ks[i], n_acc)  # type: ignore[arg-type]
                elif act.sampling.greedy:  # the committed tokens are the target's argmax: what it would have kept
                    self.suffix.observe_committed(sfx[i], out.committed[i])  # type: ignore[arg-type]
            k_d, acc_d = (ks[i], n_acc) if src == DSPARK else (0, 0)  # the policy state learns the drafter only
            if raw is not None and k_d and act.sampling.greedy:
                self.calibration.acceptance.observe(raw[row_of[i]].tolist(), k_d, acc_d)  # type: ignore[union-attr]
            c = observe(act.req.policy, act.state, k_d, acc_d, out.top1[i], out.margin[i], self.gate,
                        model=models.get(i))
            before = len(act.tokens)
            done = self._emit(events, act, out.committed[i])
            chosen = sfx[i] if src == SUFFIX else None  # the suffix proposal verified this round, if any
            offered = tuple((name, n) for name, n in ((DSPARK, proposed[i]),
                                                      (SUFFIX, len(sfx[i].tokens) if sfx[i] is not None else 0)) if n)
            rec = RoundRecord(ks[i], n_acc, c, len(act.tokens) - before, fallback=asked[i] and proposed[i] == 0,
                              proposer=src, offered=offered,
                              source=chosen.source if chosen is not None else "")
            act.stats.record_round(rec, drafted=proposed[i] > 0, proposed=proposed[i])
            log.debug("req %d: %s k=%d accepted=%d committed=%d conf=%.3f next_k=%d", act.rid, src, ks[i], n_acc,
                      len(out.committed[i]), c, act.state.k)
            if done:
                self._finish(act)


@dataclass
class GenerateResult:
    tokens: list[int]  # generated token ids (prompt excluded)
    finish_reason: str
    stats: SpecStats


def generate(
    backend: Backend | RoundExecutor,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    policy: PolicyConfig = PolicyConfig(),
    eos_ids: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    config: LoopConfig = LoopConfig(),
    gate: GateMemory | None = None,
    suffix: SuffixProposer | None = None,
    calibration: Calibration | None = None,
) -> GenerateResult:
    """Run one request to completion (`gate`: the survival gate's memory of earlier requests, `suffix`: the suffix
    proposer's, `calibration`: what earlier rounds measured, see RoundScheduler)."""
    sched = RoundScheduler(backend, config, gate=gate, suffix=suffix, calibration=calibration)
    rid = sched.add(Request(tuple(int(t) for t in prompt_ids), max_new_tokens, sampling, policy,
                            tuple(int(e) for e in eos_ids), tuple(tuple(int(t) for t in s) for s in stop_sequences)))
    tokens: list[int] = []
    while True:
        for ev in sched.step():
            if ev.request_id == rid:
                tokens.extend(ev.new_tokens)
                if ev.finished:
                    return GenerateResult(tokens, ev.finish_reason or "length", ev.stats)
