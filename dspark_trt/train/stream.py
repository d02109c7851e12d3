"""Streamed drafter training: the teacher pass chunk by chunk, each chunk trained on right after its pass, so no
whole-corpus feature store is ever kept (the 5M-answer-token data set would be 43 GB of taps) and a run can stop
and continue — in the same directory (`--resume`) or on another machine (`--init-from` + `--start-step`).

Owns: the chunk plan (a seeded permutation of the corpus' sequences cut into chunks of about `chunk_tokens`
tokens; it depends only on the corpus and the seed), each chunk's step range (`anchors_per_token` × the chunk's
answer tokens / anchors per step: the same training per token in every chunk, one LR schedule over the whole
stream), the loop over chunks (teacher pass into OUT/chunk, `trainer.train` to the chunk's last step), the milestones
(OUT/milestones/<N>: the drafter once N answer tokens have been trained on, measured in the real draft-and-verify loop
on the held-out prompts: the data → τ curve of one run) and OUT/stream.json (chunks done, steps, tokens, timings).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.train.trainer import TrainConfig, train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamConfig:
    chunk_tokens: int = 400_000  # tokens (prompt + answer) per teacher pass: ~1.4 GB of taps on disk at a time
    anchors_per_token: float = 0.5  # trained anchors per answer token, in every chunk
    milestones: tuple[int, ...] = ()  # answer tokens trained on at which the drafter is kept and loop-measured
    max_minutes: float = 60.0  # wall budget of this call (teacher passes + training + milestones)
    start_step: int = 0  # --init-from: where the stream continues (stream.json of the earlier run says)
    eval_prompts: int = 9  # held-out prompts of a milestone's loop measurement (0 = all 18)
    eval_max_new: int = 64

    def __post_init__(self) -> None:
        if self.chunk_tokens < 64 or self.anchors_per_token <= 0:
            raise InvalidArgumentError(f"stream chunk of {self.chunk_tokens} tokens at {self.anchors_per_token} anchors "
                                       "per token cannot train. Fix: --stream-chunk-tokens ≥ 64 and "
                                       "--anchors-per-token > 0.")


@dataclass(frozen=True)
class Chunk:
    index: int
    seqs: tuple[int, ...]  # corpus sequence indices
    tokens: int
    answer_tokens: int
    step_start: int
    step_end: int


def plan_chunks(seqs: Sequence[Sequence[int]], starts: Sequence[int], chunk_tokens: int, anchors_per_token: float,
                anchors_per_step: int, seed: int) -> list[Chunk]:
    """Seeded permutation of the sequences → consecutive chunks of ≥ chunk_tokens tokens (the last may be short),
    each with its step range [step_start, step_end)."""
    order = np.random.default_rng(seed + 1_000_003).permutation(len(seqs))
    chunks: list[Chunk] = []
    cur: list[int] = []
    tok = ans = 0
    step = 0

    def close() -> None:
        nonlocal cur, tok, ans, step
        n = max(1, round(anchors_per_token * ans / anchors_per_step))
        chunks.append(Chunk(len(chunks), tuple(cur), tok, ans, step, step + n))
        step += n
        cur, tok, ans = [], 0, 0

    for i in order:
        cur.append(int(i))
        tok += len(seqs[i])
        ans += max(0, len(seqs[i]) - int(starts[i]))
        if tok >= chunk_tokens:
            close()
    if cur:
        close()
    return chunks


def _milestone(target: torch.nn.Module, drafter_dir: Path, out: Path, scfg: StreamConfig, gamma: int,
               target_dir: Path) -> dict[str, Any]:
    """Copy the exported drafter to out and measure it in the real loop at fixed K = γ (lossless checked)."""
    from dspark_trt.runtime.drafters import load_drafter
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.train.evaluate import held_out_prompts, measure

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(drafter_dir, out / "drafter")
    tok = load_tokenizer(target_dir)
    prompts = held_out_prompts(tok, scfg.eval_prompts)
    drafter = load_drafter(out / "drafter", target, dtype=next(target.parameters()).dtype, target_dir=target_dir)
    res = measure(target, drafter, prompts, [gamma], scfg.eval_max_new, [int(tok.eos_token_id)])
    (out / "loop.json").write_text(json.dumps(res, indent=2))
    return res["by_gamma"][gamma]


def stream_train(cfg: TrainConfig, scfg: StreamConfig, target_dir: Path, seqs: Sequence[Sequence[int]],
                 starts: Sequence[int], out: Path, resume: bool = False, init_from: Path | None = None,
                 teacher: str = "runtime") -> dict[str, Any]:
    """Run the stream from where OUT (resume) or --start-step says until it ends or scfg.max_minutes is spent."""
    from transformers import AutoModelForCausalLM

    from dspark_trt.train.features import HFTarget, RuntimeTarget, cache_features
    from dspark_trt.train.model_init import default_layer_ids

    t_start = time.time()
    deadline = t_start + scfg.max_minutes * 60
    out.mkdir(parents=True, exist_ok=True)
    chunks = plan_chunks(seqs, starts, scfg.chunk_tokens, scfg.anchors_per_token, cfg.batch_seqs * cfg.anchors, cfg.seed)
    cfg = dataclasses.replace(cfg, max_steps=chunks[-1].step_end, max_minutes=1e9, start_step=scfg.start_step)
    state_path = out / "train_state.pt"
    if resume and state_path.exists():
        step = int(torch.load(state_path, map_location="cpu", weights_only=False)["step"])
    else:
        if state_path.exists():
            raise InvalidArgumentError(f"{out} holds a stream's train_state.pt. Fix: pass --resume to continue it, or "
                                       "another --out.")
        step = scfg.start_step
    rec_path = out / "stream.json"
    rec: dict[str, Any] = json.loads(rec_path.read_text()) if rec_path.exists() else {"chunks": [], "milestones": []}
    rec.update({"plan": {"chunks": len(chunks), "total_steps": chunks[-1].step_end,
                         "tokens": sum(c.tokens for c in chunks), "answer_tokens": sum(c.answer_tokens for c in chunks),
                         "stream": json.loads(json.dumps(dataclasses.asdict(scfg)))}})
    hf_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    taps = cfg.layers or default_layer_ids(int(hf_cfg["num_hidden_layers"]))
    if init_from is not None and not (resume and state_path.exists()) and not cfg.layers:
        # the checkpoint's taps (--layers instead: the checkpoint's and more, which the trainer grows it to)
        taps = tuple(json.loads((Path(init_from) / "config.json").read_text())["target_layer_ids"])
    tgt = RuntimeTarget.load(target_dir, taps, max_len=cfg.max_len) if teacher == "runtime" else \
        HFTarget.load(target_dir, taps)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    trained_ans = sum(c.answer_tokens for c in chunks if c.step_end <= step)
    for ch in chunks:
        if ch.step_end <= step:
            continue
        if time.time() >= deadline:
            break
        t0 = time.time()
        fdir = out / "chunk"
        mark = {"chunk": ch.index, "seqs": hashlib.sha256(json.dumps(ch.seqs).encode()).hexdigest(), "taps": list(taps)}
        kept = fdir / "stream_chunk.json"
        if not (kept.exists() and json.loads(kept.read_text()) == mark):  # a chunk cut by the budget keeps its pass
            if fdir.exists():
                shutil.rmtree(fdir)
            cache_features(tgt, [seqs[i] for i in ch.seqs], [starts[i] for i in ch.seqs], fdir, topk=cfg.topk,
                           max_len=cfg.max_len)
            kept.write_text(json.dumps(mark))
        t1 = time.time()
        have_state = state_path.exists()
        met = train(dataclasses.replace(cfg, stop_step=ch.step_end), hf, target_dir, [fdir], out, resume=have_state,
                    init_from=None if have_state else init_from, deadline=deadline)
        step = int(met["steps"])
        complete = step >= ch.step_end
        if complete:
            trained_ans += ch.answer_tokens
        rec["chunks"].append({"index": ch.index, "complete": complete, "step": step, "tokens": ch.tokens,
                              "answer_tokens": ch.answer_tokens, "teacher_s": round(t1 - t0, 1),
                              "train_s": round(time.time() - t1, 1), "trained_answer_tokens": trained_ans,
                              "heldout_tau_tf": met.get("heldout_tau_tf"), "heldout_alpha_tf": met.get("heldout_alpha_tf"),
                              "heldout_path_tau": met.get("heldout_path_tau")})
        log.info("stream chunk %d/%d %s at step %d: teacher %.0f s, train %.0f s, held-out τ_tf %.3f, loop-path τ %s",
                 ch.index + 1, len(chunks), "done" if complete else "cut", step, t1 - t0, time.time() - t1,
                 met.get("heldout_tau_tf") or 0.0, met.get("heldout_path_tau"))
        reached = [m for m in scfg.milestones if complete and trained_ans - ch.answer_tokens < m <= trained_ans]
        for m in reached:
            res = _milestone(tgt.model if teacher == "runtime" else _runtime_target(target_dir),
                             out / "drafter", out / "milestones" / str(m), scfg, cfg.gamma, target_dir)
            rec["milestones"].append({"answer_tokens": m, "trained_answer_tokens": trained_ans, "step": step,
                                      "loop": res})
            log.info("milestone %d answer tokens: loop τ %.3f", m, res["tau"])
        rec["step"], rec["trained_answer_tokens"] = step, trained_ans
        rec_path.write_text(json.dumps(rec, indent=2))
        if not complete:
            break
    rec["finished"] = step >= chunks[-1].step_end
    rec_path.write_text(json.dumps(rec, indent=2))
    return rec


def _runtime_target(target_dir: Path) -> torch.nn.Module:
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint

    return load_hf_checkpoint(target_dir, dtype=torch.bfloat16)
