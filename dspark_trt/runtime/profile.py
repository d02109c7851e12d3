"""Measured round costs for the survival K policy: target step seconds by tokens in one pass, and the
drafter's pass seconds, on the backend that will serve (same model, dtype, threads).

Owns `profile_costs(backend, ...)` → spec_decode.costs.CostTable (target step by tokens in one pass: every count
1..γ+1, then sparse counts up to `pass_tokens` — what a saturated batch's verify (rows × (1 + K)) and a prefill
sharing the pass cost, where the step turns compute-bound — and a linear drafter cost by drafted rows). Runs on
slots it frees again, before the backend serves requests. Knows nothing about policies beyond building the table.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Sequence

import torch

from dspark_trt.spec_decode.protocols import SamplingParams
from dspark_trt.spec_decode.costs import CostTable

log = logging.getLogger(__name__)


def _fastest(fn, reps: int, setup=None) -> float:  # noqa: ANN001 - zero-argument callables
    """Fastest of `reps` timed calls of fn; `setup` (untimed) runs before each one."""
    best = float("inf")
    for _ in range(reps):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _paired(xs: Sequence[float], step1: Sequence[float]) -> float:
    """A cost measured once per rep, priced against the one-token pass of the same rep: median_r(xs[r] / step1[r]) ·
    median(step1). On a shared VM a neighbour's load moves the compute-bound passes (several tokens, the drafter's)
    and hardly the memory-bound one-token step; a fastest-of-reps per count took each from its own best moment and
    priced 2–5 verify tokens anywhere from 1.03× to 1.39× a step on one 2-core Zen 3 (bootstrap over 20 reps; this
    ratio's spread about half that, the same mean)."""
    return statistics.median(x / s for x, s in zip(xs, step1)) * statistics.median(step1)


def _after_target_pass(backend, slots: list[int]) -> None:  # noqa: ANN001 - a SpecBackend
    """Put the drafter where a round's drafter pass finds it: right after a target pass (whose weights have pushed
    the drafter's out of the caches), with the one committed token that pass fed it still to project."""
    s = torch.tensor(slots)
    start = backend.cache.lengths[s].clone()  # [R]
    toks = torch.full((len(slots), 1), 7, dtype=torch.long)  # [R, 1]
    out = backend.target(toks, backend.cache, s, taps=backend.taps, logits="last")
    backend.cache.truncate(s, start)
    backend.drafter.extend_context(s, toks, torch.ones(len(slots), dtype=torch.long), out.hidden)


DRAFT_SAMPLES = 3  # drafter passes timed per rep (each after a target pass); its fastest is the rep's sample
SAMPLED_T = 0.7  # the temperature of the sampled drafter pass timed for CostTable.sampled_t1
PASS_POINTS = (16, 32, 64, 128, 256, 512)  # token counts profiled past γ + 1 (up to pass_tokens and the cache room)


def profile_costs(backend, max_tokens: int, context: int = 64, reps: int = 5, gamma: int | None = None,  # noqa: ANN001
                  draft_rows: Sequence[int] = (1, 2), pass_tokens: int = 256) -> CostTable:
    """Seconds of one target pass over n = 1..max_tokens tokens and over the PASS_POINTS up to `pass_tokens`
    (measured in min(reps, 2) reps) — batch 1, `context` tokens cached, taps and every position's logits included (a
    verify pass; a fused prefill chunk needs only its last logits, so its price is a slight overestimate) — and of
    one drafter pass of γ tokens over 1 and 2 rows as a round pays it (after a target pass, with a committed token to
    project; → draft_t0 + draft_t1·rows). Each is the median over the reps of its time relative to the same rep's
    one-token pass, times the median one-token pass (`_paired`); the step column never falls with more tokens
    (timer noise is clipped). `backend` is a runtime.backend.SpecBackend."""
    vocab = int(backend.vocab_size)
    n_slots = min(int(backend.max_batch), max(draft_rows))
    slots = list(range(n_slots))
    drafter = getattr(backend, "drafter", None)
    g = gamma or int(getattr(drafter, "gamma", 0) or 0)
    rows_list = [r for r in draft_rows if r <= n_slots] if g > 0 and drafter is not None else []
    # each timed drafter pass (greedy over every row count, then the sampled one) follows a target pass that feeds
    # the drafter one more context token, and its block needs γ positions past them: every rep starts from a fresh
    # prefill of `ctx` tokens, so a small cache (a short max_length) holds one rep's growth, not all of them
    grow = (len(rows_list) + 1) * DRAFT_SAMPLES + g if rows_list else 0
    ctx = max(1, min(context, int(backend.max_seq) - max_tokens - 2 - grow))
    prompt = [(17 + 31 * i) % vocab for i in range(ctx)]
    target, cache = backend.target, backend.cache
    slot0 = torch.tensor([0])
    greedy = SamplingParams()
    room = int(backend.max_seq) - ctx - 2
    counts = list(range(1, max_tokens + 1)) + [n for n in PASS_POINTS if max_tokens < n <= min(pass_tokens, room)]
    runs: list[list[float]] = [[] for _ in counts]  # [count][rep] seconds of one pass
    d0 = d1 = s1 = 0.0
    drafts: list[list[float]] = [[] for _ in rows_list]  # [rows][rep] a drafter pass (fastest of DRAFT_SAMPLES)
    sampled: list[float] = []  # [rep] a 1-row sampled drafter pass (its q and draws)
    hot = SamplingParams(temperature=SAMPLED_T, seed=1)
    with torch.inference_mode():
        # Interleaved: every rep times every count (and the drafter) once, so a spell of machine load (a shared VM's
        # neighbour) slows all of them alike instead of inflating a few counts — whose clipping to a non-decreasing
        # column would then flatten the table and make verify tokens look free. Fastest of the reps per count.
        for rep in range(reps):
            backend.prefill(slots, [prompt] * n_slots)  # the target and the drafter at ctx tokens again
            start = cache.lengths[slot0].clone()  # [1]
            for i, n in enumerate(counts):
                if n > max_tokens and rep >= min(reps, 2):
                    continue
                toks = torch.tensor([[(101 + 7 * j) % vocab for j in range(n)]])  # [1, n]: anchor + n-1 draft tokens

                def one_pass(toks: torch.Tensor = toks) -> None:  # the verify pass (taps included), then back
                    target(toks, cache, slot0, taps=backend.taps, logits="all")
                    cache.truncate(slot0, start)

                runs[i].append(_fastest(one_pass, 1))
            for i, rows in enumerate(rows_list):
                anchors = torch.full((rows,), 42, dtype=torch.long)
                drafts[i].append(_fastest(  # DRAFT_SAMPLES per rep: a short pass, so a noisy VM's spikes
                    lambda rows=rows, anchors=anchors: backend.draft(slots[:rows], anchors, g, [greedy] * rows),
                    DRAFT_SAMPLES, setup=lambda rows=rows: _after_target_pass(backend, slots[:rows])))
            if rows_list:
                one = torch.full((1,), 42, dtype=torch.long)
                sampled.append(_fastest(
                    lambda: backend.draft(slots[:1], one, g, [hot], torch.tensor([ctx + 1])), DRAFT_SAMPLES,
                    setup=lambda: _after_target_pass(backend, slots[:1])))
        step1 = runs[0]  # counts[0] = 1: the one-token pass of every rep
        secs = [_paired(r, step1) for r in runs]
        times = [_paired(d, step1) for d in drafts]
        sampled_s = _paired(sampled, step1) if sampled else 0.0
        if rows_list:
            if len(times) >= 2:
                d1 = max((times[1] - times[0]) / (rows_list[1] - rows_list[0]), 0.0)
                d0 = max(times[0] - d1 * rows_list[0], 0.0)
            else:
                d0 = times[0]
            s1 = max(sampled_s - times[0], 0.0) + _sampled_accept_extra(backend, g, vocab, hot)
    for slot in slots:
        backend.release(slot)
    for i in range(1, len(secs)):
        secs[i] = max(secs[i], secs[i - 1] * 1.0001)
    context = _profile_context(backend, ctx, max_tokens, reps, g if rows_list else 0)
    table = CostTable(tuple(counts), tuple(secs), draft_t0=d0, draft_t1=d1, sampled_t1=s1, **context)
    log.info("cost table: step by tokens %s ms; drafter %.2f + %.2f·rows ms (+ %.2f ms a sampled row); per cached "
             "token past %d: %.2f µs a row + %.2f µs a query token, drafter %.2f µs",
             {n: round(s * 1e3, 2) for n, s in zip(counts, secs)}, d0 * 1e3, d1 * 1e3, s1 * 1e3, ctx,
             context.get("ctx_t0", 0.0) * 1e6, context.get("ctx_t1", 0.0) * 1e6, context.get("draft_ctx", 0.0) * 1e6)
    return table


LONG_CONTEXT = 1024  # the second context the pass and the drafter are timed at (room permitting)


def _profile_context(backend, ctx: int, max_tokens: int, reps: int, gamma: int) -> dict[str, float]:  # noqa: ANN001
    """What a row's cached tokens add to a pass: one-row passes of 1 and max_tokens tokens (and a 1-row drafter pass
    when gamma > 0) timed at `ctx` and at a long context side by side, fastest of reps each → CostTable's context
    fields (linear in the cached tokens); {} (context-blind) without two slots or room for a long context."""
    room = int(backend.max_seq) - max_tokens - 4 - 2 * reps * DRAFT_SAMPLES
    long_ctx = min(LONG_CONTEXT, room)
    if int(backend.max_batch) < 2 or long_ctx < ctx + 256 or max_tokens < 2:
        return {}
    vocab = int(backend.vocab_size)
    backend.prefill([0, 1], [[(17 + 31 * i) % vocab for i in range(n)] for n in (ctx, long_ctx)])
    target, cache = backend.target, backend.cache
    greedy = SamplingParams()
    t = {}  # (slot, n | "draft") → fastest seconds
    with torch.inference_mode():
        for _ in range(reps):
            for slot in (0, 1):
                s = torch.tensor([slot])
                start = cache.lengths[s].clone()  # [1]
                for n in (1, max_tokens):
                    toks = torch.tensor([[(101 + 7 * j) % vocab for j in range(n)]])  # [1, n]

                    def one_pass(toks: torch.Tensor = toks, s: torch.Tensor = s, start: torch.Tensor = start) -> None:
                        target(toks, cache, s, taps=backend.taps, logits="all")
                        cache.truncate(s, start)

                    t[slot, n] = min(t.get((slot, n), float("inf")), _fastest(one_pass, 1))
                if gamma > 0:
                    one = torch.full((1,), 42, dtype=torch.long)
                    t[slot, "draft"] = min(t.get((slot, "draft"), float("inf")), _fastest(
                        lambda slot=slot: backend.draft([slot], one, gamma, [greedy]), DRAFT_SAMPLES,
                        setup=lambda slot=slot: _after_target_pass(backend, [slot])))
    for slot in (0, 1):
        backend.release(slot)
    span = float(long_ctx - ctx)
    row = max(t[1, 1] - t[0, 1], 0.0) / span  # ctx_t0 + ctx_t1
    per_token = max((t[1, max_tokens] - t[0, max_tokens]) / span - row, 0.0) / (max_tokens - 1)
    draft = max(t[1, "draft"] - t[0, "draft"], 0.0) / span if gamma > 0 else 0.0
    return {"context": ctx, "ctx_t0": max(row - per_token, 0.0), "ctx_t1": per_token, "draft_ctx": draft}


def _sampled_accept_extra(backend, gamma: int, vocab: int, hot: SamplingParams) -> float:  # noqa: ANN001
    """Seconds the acceptance of one sampled row's γ-token block with a drafter's q costs over a greedy row's
    (fastest of a few, on random logits)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, gamma + 1, vocab, generator=g)  # [1, γ+1, V]
    q = torch.softmax(torch.randn(1, gamma, vocab, generator=g), -1)  # [1, γ, V]
    draft, k, pos = q.argmax(-1), torch.tensor([gamma]), torch.tensor([0])
    greedy = _fastest(lambda: backend.accept(logits, draft, k, None, [SamplingParams()], pos), 3)
    sampled = _fastest(lambda: backend.accept(logits, draft, k, q, [hot], pos), 3)
    return max(sampled - greedy, 0.0)
