"""The one dispatch point between the runtime and the kernels: acceptance and draft sampling.

Owns the routing decision only: CUDA tensors + importable OpenAI Triton → dspark_trt/kernels/ kernels;
anything else → the torch reference (dspark_trt.spec_decode.accept for acceptance;
dspark_trt/kernels/block_draft/reference.py, written in the DSpark drafter's own terms, for draft sampling).
Every drafter samples through here (`markov_block` for the DSpark Markov head, `draft_tokens` for drafters
without one), so drafting and acceptance share one counter-based RNG (spec_decode.rng, keyed on seed, absolute
position and draw stream) and one temperature + top-p transform (spec_decode.accept.target_probs). It holds no
algorithm code of its own and never imports tensorrt. Kernel and reference modules are imported lazily.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any, Sequence

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.protocols import SamplingParams

log = logging.getLogger(__name__)

# DSPARK_KERNELS=0 forces the torch reference even on CUDA (debugging / A-B parity).
_ENV_SWITCH = "DSPARK_KERNELS"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when OpenAI Triton imports (checked once; never raises)."""
    try:
        importlib.import_module("triton")
        return True
    except Exception as exc:  # noqa: BLE001 - any import failure means "no kernels"
        log.info("OpenAI Triton unavailable (%s): using torch reference", exc)
        return False


def use_kernels(*tensors: torch.Tensor | None) -> bool:
    """Kernels run when every given tensor is on CUDA, Triton imports and DSPARK_KERNELS != 0.

    Callers pass the big tensor (logits / backbone logits) that decides the device; small companions (draft
    tokens, k, positions, a CPU q) are moved to it, so a CPU DraftBlock with CUDA logits still uses kernels."""
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return False
    present = [t for t in tensors if t is not None]
    if not present or not all(t.is_cuda for t in present):
        return False
    return triton_available()


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _result_to(res: Any, device: torch.device) -> Any:
    """AcceptResult with every tensor field moved to `device`."""
    return type(res)(**{f: getattr(res, f).to(device) for f in ("accepted", "next_token", "top1", "margin")})


def _spec_accept() -> Any:
    return importlib.import_module("dspark_trt.spec_decode.accept")


def sampling_tensors(
    sampling: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-request (temperature [B] f32, top_p [B] f32, seeds [B] int64); a None seed becomes 0."""
    temperature = torch.tensor([s.temperature for s in sampling], dtype=torch.float32, device=device)
    top_p = torch.tensor([s.top_p for s in sampling], dtype=torch.float32, device=device)
    seeds = torch.tensor([0 if s.seed is None else int(s.seed) for s in sampling], dtype=torch.int64, device=device)
    return temperature, top_p, seeds


def _check_accept_args(
    logits: torch.Tensor,  # [B, K+1, V]
    draft: torch.Tensor,  # [B, K]
    k: torch.Tensor,  # [B]
    q: torch.Tensor | None,  # [B, K, V]
    n: int,  # number of sampling params
) -> None:
    if logits.dim() != 3 or draft.dim() != 2 or k.dim() != 1:
        raise InvalidArgumentError(
            f"accept expects logits [B, K+1, V], draft [B, K], k [B]; got {tuple(logits.shape)}, "
            f"{tuple(draft.shape)}, {tuple(k.shape)}"
        )
    b, kp1, v = logits.shape
    if draft.shape != (b, kp1 - 1) or k.shape[0] != b or n != b:
        raise InvalidArgumentError(
            f"accept: batch/verify-length mismatch: logits {tuple(logits.shape)}, draft {tuple(draft.shape)}, "
            f"k {tuple(k.shape)}, {n} sampling params; pass draft [B, K] for logits [B, K+1, V]"
        )
    if q is not None and q.shape != (b, kp1 - 1, v):
        raise InvalidArgumentError(f"accept: q must be [B, K, V] = {(b, kp1 - 1, v)}, got {tuple(q.shape)}")


def accept(
    logits: torch.Tensor,  # [B, K+1, V] target logits (fp32 or bf16)
    draft: torch.Tensor,  # [B, K] long draft tokens
    k: torch.Tensor,  # [B] long per-request verify length (≤ K)
    q: torch.Tensor | None,  # [B, K, V] draft distributions (sampling) or None (all greedy)
    sampling: Sequence[SamplingParams],
    positions: torch.Tensor | None = None,  # [B] long absolute position of d_1 (RNG key); needed when sampling
) -> Any:
    """Fused acceptance → spec_decode.accept.AcceptResult (greedy_accept / sample_accept semantics).

    Greedy when every request is greedy. Sampled batches need `positions` (= committed length incl. prompt,
    the absolute position of d_1). Kernels on CUDA; the torch reference on CPU, and on CUDA for top_p < 1
    (nucleus filtering is not fused) or a sampled row with a deterministic proposal (the coupled rule of
    `sample_accept` is not fused)."""
    _check_accept_args(logits, draft, k, q, len(sampling))
    greedy = all(s.greedy for s in sampling)
    if not greedy and positions is None:
        raise InvalidArgumentError(
            "accept: sampled requests need positions [B] (absolute position of d_1 = committed length incl. "
            "the prompt) for the counter-based RNG; pass positions=...")
    dev = logits.device
    fused = use_kernels(logits) and (greedy or (all(s.top_p >= 1.0 for s in sampling)
                                                and not _coupled_sampled_rows(q, draft, k, sampling)))
    if fused:
        from dspark_trt.kernels import api  # local import: keeps triton out of CPU-only imports

        draft, k = draft.to(dev), k.to(dev)
        if greedy:
            return api.greedy_accept(logits, draft, k)
        temperature, top_p, seeds = sampling_tensors(sampling, dev)
        assert positions is not None
        return api.sample_accept(logits, draft, _on(q, dev), k, temperature, top_p, seeds, positions.to(dev))
    # torch reference (spec_decode.accept is written for one device: run it on CPU, hand results back on `dev`)
    cpu = torch.device("cpu")
    ref = _spec_accept()
    if greedy:
        res = _native_greedy_accept(logits, draft, k) if dev == cpu else None
        if res is None:
            res = ref.greedy_accept(logits.to(cpu), draft.to(cpu), k.to(cpu))
    else:
        temperature, top_p, seeds = sampling_tensors(sampling, cpu)
        assert positions is not None
        res = ref.sample_accept(logits.to(cpu), draft.to(cpu), _on(q, cpu), k.to(cpu), temperature, top_p, seeds,
                                positions.to(cpu))
    return res if dev == cpu else _result_to(res, dev)


def _coupled_sampled_rows(q: torch.Tensor | None, draft: torch.Tensor, k: torch.Tensor,
                          sampling: Sequence[SamplingParams]) -> bool:
    """Whether a sampled row has a deterministic proposal (spec_decode.accept.deterministic_rows)."""
    sampled = torch.tensor([not s.greedy for s in sampling], device=draft.device)
    return bool((_spec_accept().deterministic_rows(q, draft, k) & sampled).any())


def _native_greedy_accept(logits: torch.Tensor, draft: torch.Tensor, k: torch.Tensor) -> Any:
    """Greedy acceptance on the CPU engine where `ops.choose_kernel` says native: the argmax, top-1 and margin of
    each verified row in one native pass (runtime/native/greedy.cpp; ATen's softmax + topk + argmax over
    [B, K+1, V] cost 0.25 ms per decode step and ~3 ms per round of 8 requests × 4 tokens), then
    spec_decode.accept.greedy_chain. Tokens equal greedy_accept's; top1 / margin agree to float32 rounding.
    None → the torch reference (no engine, or a row with NaN / only −inf)."""
    from dspark_trt.runtime import native, ops

    if not ops.choose_kernel(logits).native:
        return None
    stats = native.greedy_stats(logits, k)
    if stats is None:
        return None
    target, top1, margin = stats  # [B, K+1] each
    return _spec_accept().greedy_chain(target, draft, k, top1, margin)


@functools.lru_cache(maxsize=8)
def _zero_head(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-1 all-zero Markov head (W1 [V, 1], W2 [V, 1]): bias 0, so the kernel samples each position from U
    alone — bit-for-bit what the reference does without a head (U + 0.0 = U)."""
    z = torch.zeros(vocab, 1, dtype=torch.float32, device=device)
    return z, z


def markov_block(
    backbone_logits: torch.Tensor,  # [B, γ, Vd] U_1..U_γ (float32)
    anchor: torch.Tensor,  # [B] long target ids x_0
    w1: torch.Tensor | None,  # [Vt, r] markov_w1.weight; None (with w2): no Markov head, see draft_tokens
    w2: torch.Tensor | None,  # [Vd, r] markov_w2.weight (nn.Linear layout)
    sampling: Sequence[SamplingParams],
    positions: torch.Tensor,  # [B] int64 absolute position of d_1 (RNG key)
    d2t: torch.Tensor | None = None,  # [Vd] long draft id → target id
    conf_bias: torch.Tensor | None = None,  # [B, γ] f32: w_h·h_k + b of the confidence head
    w_conf: torch.Tensor | None = None,  # [r] f32: the W1 half of the confidence weight
    conf_temp: torch.Tensor | None = None,  # [γ] f32 confidence temperatures
    need_q: bool = True,  # False: all-greedy callers that drop q may get q = None (skips a [B, γ, Vd] one-hot)
) -> Any:
    """γ DSpark Markov steps left to right → dspark_trt.kernels.block_draft.reference.MarkovBlock(tokens [B, γ]
    target ids, q [B, γ, Vd] f32 over the draft vocabulary, conf [B, γ] | None). Sampled rows draw token k with
    the STREAM_DRAFT race keyed (seed, positions + k − 1). The block_draft kernel on CUDA (top_p = 1); the torch
    reference (same semantics, same bits for the tokens) elsewhere."""
    if backbone_logits.dim() != 3 or backbone_logits.shape[0] != len(sampling):
        raise InvalidArgumentError(
            f"markov_block expects U [B, γ, V] and B sampling params; got {tuple(backbone_logits.shape)} and "
            f"{len(sampling)}")
    if (w1 is None) != (w2 is None) or (w1 is None and (d2t is not None or conf_bias is not None)):
        raise InvalidArgumentError("markov_block: pass W1 and W2 together; without a Markov head (W1 = W2 = None) "
                                   "also pass d2t = conf_bias = None (map draft ids and compute confidences "
                                   "outside)")
    dev = backbone_logits.device
    temperature, top_p, seeds = sampling_tensors(sampling, dev)
    positions = positions.to(device=dev, dtype=torch.int64)
    anchor = anchor.to(dev)
    extra = dict(d2t=_on(d2t, dev), conf_bias=_on(conf_bias, dev), w_conf=_on(w_conf, dev),
                 conf_temp=_on(conf_temp, dev))
    if use_kernels(backbone_logits, w1, w2) and all(s.top_p >= 1.0 for s in sampling):
        from dspark_trt.kernels import api

        if w1 is None:  # no head: ids stay < Vd, so a [Vd, 1] W1 covers every anchor the kernel gathers
            w1, w2 = _zero_head(backbone_logits.shape[-1], dev)
            anchor = torch.zeros_like(anchor)
        return api.markov_block(backbone_logits, anchor, w1, w2, temperature, seeds, positions, **extra)
    from dspark_trt.kernels.block_draft import reference

    if w1 is not None and w2 is not None and all(s.greedy for s in sampling):
        blk = _native_greedy(backbone_logits, anchor, w1, w2, **extra, need_q=need_q)
        if blk is not None:
            return blk
    return reference.markov_block(backbone_logits, anchor, w1, w2, temperature, seeds, positions, top_p, **extra,
                                  linear=_native_bias(w2))


def _native_greedy(u: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   d2t: torch.Tensor | None, conf_bias: torch.Tensor | None, w_conf: torch.Tensor | None,
                   conf_temp: torch.Tensor | None, need_q: bool = True) -> Any:
    """All-greedy rows on the CPU: the γ steps in one native call (runtime/native/draft.cpp: the reference's bias
    product, add and argmax), confidences from the chosen tokens afterwards (the reference's per-row sums) →
    reference.MarkovBlock, bit for bit the reference's (q = None unless need_q); None where `ops.choose_kernel`
    answers torch for the bias product W1[x] · W2ᵀ, or W1 and W2 differ in dtype (the kernel's product is unscaled)."""
    from dspark_trt.runtime import native, ops

    kern = ops.choose_kernel(w1, u, w2, weight=w2, autograd=True)
    if not kern.native or w1.dtype != w2.dtype:
        return None
    b, gamma, vd = u.shape
    ids, toks = native.markov_greedy(u, anchor, w1, w2, d2t, kern.kind)  # [B, γ] draft-vocab ids, target ids
    conf = None
    if conf_bias is not None and w_conf is not None:
        prev = torch.cat([anchor.long()[:, None], toks[:, :-1]], dim=1)  # [B, γ] x_{k-1}
        s = (w1[prev].float() * w_conf.float()).sum(-1)  # [B, γ]
        ct = torch.ones(gamma) if conf_temp is None else conf_temp.float()[:gamma]
        conf = torch.sigmoid((conf_bias.float() + s) / ct)  # [B, γ]
    from dspark_trt.kernels.block_draft.reference import MarkovBlock

    return MarkovBlock(toks, torch.nn.functional.one_hot(ids, vd).to(torch.float32) if need_q else None, conf)


def _native_bias(w2: torch.Tensor | None) -> Any:
    """The Markov bias product w1x [B, r] · W2ᵀ, rounded to the param dtype, as float32, on the runtime's native
    kernels where `ops.choose_kernel` sends it (native_product: F.linear's result, several times faster for one row),
    else F.linear; None without a Markov head."""
    if w2 is None:
        return None
    from dspark_trt.runtime.drafters.layers import native_product

    def bias(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = native_product(x, w, out_f32=True)  # None where the native kernels do not apply
        return torch.nn.functional.linear(x, w).float() if y is None else y

    return bias


def draft_tokens(
    logits: torch.Tensor,  # [B, T, V] draft logits at T independent positions (float32)
    sampling: Sequence[SamplingParams],
    positions: torch.Tensor,  # [B] int64 absolute position of the first of the T tokens
) -> Any:
    """Token choice of a drafter without a Markov head (LM drafters: T = 1 per step; PARD: T = γ in one pass)
    → MarkovBlock(tokens [B, T], q [B, T, V] f32, conf None): greedy rows take the argmax, sampled rows the
    STREAM_DRAFT race over target_probs(logits, T, top_p) keyed (seed, positions + t). The same kernel as
    markov_block on CUDA (with an all-zero head), reference.sample_block elsewhere."""
    if logits.dim() != 3:
        raise InvalidArgumentError(f"draft_tokens expects logits [B, T, V], got {tuple(logits.shape)}")
    anchor = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return markov_block(logits, anchor, None, None, sampling, positions)
