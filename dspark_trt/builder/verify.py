"""Stage "verify": the reference runtime runs the EXPORTED checkpoints; their quality and speed go to the manifest.

Owns: teacher-forced greedy agreement and perplexity of the exported target (and LM draft) vs the
unquantized Hugging Face model in float32 on the shipped held-out text; for a DSpark drafter, agreement
of the exported drafter's proposals with the unquantized drafter's; plain greedy decode speed of the
exported target in the runtime (informational: measured once, never asserted); which kernel path each
quantized linear took. Must not write checkpoints.
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dspark_trt.builder import calib as calib_mod
from dspark_trt.builder.quantize import logits_hf, quality
from dspark_trt.builder.options import BuildOptions
from dspark_trt.builder.validate import ValidatedPair

log = logging.getLogger(__name__)


@torch.no_grad()
def runtime_logits(model: torch.nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """[N, T, V] float32 logits of a runtime CausalLM, one sequence per slot-0 pass."""
    out = []
    for i in range(seqs.shape[0]):
        cache = model.new_cache(1, seqs.shape[1])
        out.append(model(seqs[i:i + 1], cache, [0]).logits.float())
    return torch.cat(out, 0)


@torch.no_grad()
def decode_speed(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int = 16, repeats: int = 2) -> float:
    """Median tokens/s of plain greedy decoding (one token per forward) after prompt [1, P]."""
    rates = []
    for _ in range(repeats):
        cache = model.new_cache(1, prompt.shape[1] + new_tokens + 1)
        nxt = model(prompt, cache, [0], logits="last").logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            nxt = model(nxt, cache, [0], logits="last").logits[:, -1].argmax(-1, keepdim=True)
        rates.append(new_tokens / (time.perf_counter() - t0))
    return round(statistics.median(rates), 2)


def _lm_report(ckpt: Path, hf_dir: Path, opts: BuildOptions, held: torch.Tensor, speed: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from dspark_trt.runtime.quant_linear import linear_paths
    from dspark_trt.runtime.trtllm_checkpoint import STR_DTYPES, load_trtllm_checkpoint

    ref_model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ref = logits_hf(ref_model, held)
    del ref_model
    rt = load_trtllm_checkpoint(ckpt, dtype=STR_DTYPES[opts.dtype])
    rep = quality(ref, runtime_logits(rt, held), held)
    rep["runtime_dtype"] = opts.dtype
    rep["linear_paths"] = linear_paths(rt) or {"nn.Linear": "unquantized"}
    rep["kv_cache"] = (f"{rt.kv_cache_quant_algo} scales exported; the reference runtime keeps KV in {opts.dtype}"
                       if getattr(rt, "kv_cache_quant_algo", None) else opts.dtype)
    if speed:
        rep["decode_tok_per_s"] = decode_speed(rt, held[:1, :64])
    return rep


@torch.no_grad()
def _dspark_report(ckpt: Path, pair: ValidatedPair, opts: BuildOptions, held: torch.Tensor) -> dict[str, Any]:
    """Agreement of the exported drafter's greedy proposals with the unquantized drafter's."""
    from dspark_trt.builder.artifacts import load_dspark_export
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint
    from dspark_trt.spec_decode.protocols import SamplingParams

    target = load_hf_checkpoint(pair.target, dtype=torch.float32)
    ref = load_drafter(pair.draft, target, dtype=torch.float32)
    exp = load_dspark_export(ckpt, target, torch.float32)
    taps = tuple(ref.target_layer_ids)
    gamma = ref.gamma
    first = full = n = 0
    for i in range(min(held.shape[0], 4)):
        seq = held[i:i + 1]
        T = seq.shape[1]
        feats = target(seq, target.new_cache(1, T), [0], taps=taps, logits="none").hidden  # [1, T, F]
        for d in (ref, exp):
            d.allocate(1, T + gamma + 1)
        for b in range(16, T - 1, 16):
            for d in (ref, exp):
                a = d.context_length(0)
                d.extend_context(torch.tensor([0]), seq[:, a:b], torch.tensor([b - a]), feats[:, a:b])
            pr = ref.propose(torch.tensor([0]), seq[:, b], gamma, [SamplingParams()]).tokens
            pe = exp.propose(torch.tensor([0]), seq[:, b], gamma, [SamplingParams()]).tokens
            first += int(pr[0, 0] == pe[0, 0])
            full += int(torch.equal(pr, pe))
            n += 1
    return {"proposals": n, "first_token_agreement": round(first / max(n, 1), 4),
            "block_agreement": round(full / max(n, 1), 4), "compared_with": "unquantized drafter, float32"}


def verify_build(build_dir: Path, opts: BuildOptions, pair: ValidatedPair,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_dir / "tokenizer"))
    held = calib_mod.heldout_tokens(tok, opts.eval_tokens)  # [M, 128]
    facts: dict[str, Any] = {"heldout_sequences": int(held.shape[0]), "heldout_tokens_each": int(held.shape[1])}
    facts["target"] = _lm_report(build_dir / "target" / "checkpoint", pair.target, opts, held, speed=opts.bench)
    if progress:
        progress("target")
    if pair.draft_kind == "lm":
        facts["draft"] = _lm_report(build_dir / "draft" / "checkpoint", pair.draft, opts, held, speed=False)
    else:
        facts["draft"] = _dspark_report(build_dir / "draft" / "checkpoint", pair, opts, held)
    if progress:
        progress("draft")
    return facts
