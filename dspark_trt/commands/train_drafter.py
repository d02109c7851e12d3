"""`dspark-trt train-drafter`: distill a DSpark block drafter from a target on offline text.

Pipeline: tokenize the corpus (text files / chat JSONL) → cache target features + top-k log-probs once
(reused when --out already holds them for the same taps) → train (resumable, --max-minutes budget) →
STS-calibrate the confidence head on held-out data → write OUT/drafter (config.json + model.safetensors)
and OUT/metrics.json. With --stream-chunk-tokens the teacher pass and training alternate chunk by chunk
(dspark_trt.train.stream: no whole-corpus store, resumable across machines). Defaults come from
dspark_trt.train.trainer.TrainConfig.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.train.onpolicy import OnPolicyConfig
from dspark_trt.train.trainer import TrainConfig

log = logging.getLogger(__name__)
D = TrainConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None, help="target HF dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--corpus", type=Path, nargs="+", required=True, help="text files/dirs and chat .jsonl files")
    p.add_argument("--out", type=Path, required=True, help="output dir (features/, drafter/, train_state.pt)")
    p.add_argument("--gamma", type=int, default=D.gamma, help=f"block size γ (default {D.gamma})")
    p.add_argument("--layers", type=str, default=None,
                   help="target taps, comma-separated (default: 5 spread layers; with --init-from: the checkpoint's "
                        "taps and more, the new ones start silent)")
    p.add_argument("--num-layers", type=int, default=D.num_layers,
                   help="drafter decoder layers (with --init-from: more than the checkpoint's adds layers that start "
                        "as the identity; fewer keeps the checkpoint's)")
    p.add_argument("--markov-rank", type=int, default=D.markov_rank,
                   help="Markov head rank (0 = none; with --init-from: above the checkpoint's adds components that "
                        "start silent, at or below keeps the checkpoint's)")
    p.add_argument("--draft-vocab", type=int, default=D.draft_vocab_size, help="reduced draft vocabulary (0 = full)")
    p.add_argument("--max-minutes", type=float, default=D.max_minutes, help="training time budget")
    p.add_argument("--max-steps", type=int, default=D.max_steps, help="step budget (0 = from --max-minutes)")
    p.add_argument("--train-tokens", type=int, default=0,
                   help="train on a seeded subset of about this many answer tokens (0 = all; nested across budgets)")
    p.add_argument("--onpolicy-every", type=int, default=0,
                   help="on-policy phase: roll the greedy loop over training sequences every N steps and train on its "
                        "anchors, weighted by what the loop reaches (0 = supervised only)")
    p.add_argument("--onpolicy-start", type=int, default=0, help="first step of the on-policy phase")
    p.add_argument("--onpolicy-start-frac", type=float, default=0.0,
                   help="…and not before this share of the run is done (steps, or minutes under a time budget)")
    p.add_argument("--onpolicy-frac", type=float, default=0.5, help="share of on-policy batches (rest: replay)")
    p.add_argument("--reject-weight", type=float, default=2.0, help="loss weight of a block's first rejected slot")
    p.add_argument("--max-tokens", type=int, default=D.max_tokens, help="corpus token budget for feature caching")
    p.add_argument("--lr", type=float, default=D.lr)
    p.add_argument("--batch-seqs", type=int, default=D.batch_seqs)
    p.add_argument("--anchors", type=int, default=D.anchors, help="anchors per sequence per step")
    p.add_argument("--seed", type=int, default=D.seed)
    p.add_argument("--threads", type=int, default=D.threads)
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto",
                   help="bf16 autocast of the drafter's products: auto = where bf16 matrix products are fast on this "
                        "CPU (AVX512_BF16 / AMX; a CPU without them runs torch's bf16 GEMM ~100x slower than fp32), "
                        "always on CUDA")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from a drafter checkpoint dir's weights (fresh optimizer), e.g. the shipped drafter")
    p.add_argument("--feature-minutes", type=float, default=0.0,
                   help="time budget for caching features (0 = all); keeps the sequences done")
    p.add_argument("--teacher", choices=("runtime", "hf"), default="runtime",
                   help="teacher pass on the reference runtime's batched prefill (default; the drafter's own taps at "
                        "inference) or on Hugging Face transformers")
    p.add_argument("--features-only", action="store_true", help="cache target features into OUT/features and stop")
    p.add_argument("--extra-features", type=Path, nargs="*", default=[],
                   help="more feature stores (OUT/features of other --features-only runs) to train on")
    p.add_argument("--stream-chunk-tokens", type=int, default=0,
                   help="stream: teacher pass and training chunk by chunk, this many tokens a chunk (no whole-corpus "
                        "store; --max-minutes bounds this call; --resume continues; train.stream)")
    p.add_argument("--anchors-per-token", type=float, default=0.5, help="stream: trained anchors per answer token")
    p.add_argument("--milestones", type=str, default="",
                   help="stream: answer-token counts (comma-separated) at which the drafter is kept and loop-measured")
    p.add_argument("--loss-ce", type=float, default=D.loss.ce,
                   help=f"weight of CE on the target's top-1 (default {D.loss.ce}; the greedy loop accepts its argmax)")
    p.add_argument("--loss-l1", type=float, default=D.loss.l1,
                   help=f"weight of the L1 distance to the target's distribution (default {D.loss.l1})")
    p.add_argument("--start-step", type=int, default=0,
                   help="stream with --init-from: the step the earlier run reached (its stream.json), to continue there")


def _corpus(args: argparse.Namespace, target_dir: Path, cfg: TrainConfig) -> tuple[list[list[int]], list[int]]:
    from transformers import AutoTokenizer

    from dspark_trt.train.corpus import load_corpus

    seqs, starts = load_corpus(args.corpus, AutoTokenizer.from_pretrained(target_dir), cfg.max_tokens,
                               window=cfg.max_len, seed=cfg.seed)
    if not seqs:
        raise InvalidArgumentError(f"No usable text in --corpus {args.corpus}. Fix: pass text files, directories or "
                                   "chat .jsonl files written by dspark_trt.train.chatgen.")
    return seqs, starts


def _features(args: argparse.Namespace, target_dir: Path, layers: tuple[int, ...] | None, cfg: TrainConfig) -> Path:
    from transformers import AutoTokenizer

    from dspark_trt.train.corpus import load_corpus
    from dspark_trt.train.features import HFTarget, RuntimeTarget, cache_features
    from dspark_trt.train.model_init import default_layer_ids

    hf_cfg = json.loads((target_dir / "config.json").read_text())
    taps = layers or default_layer_ids(int(hf_cfg["num_hidden_layers"]))
    fdir = args.out / "features"
    meta = fdir / "meta.json"
    if meta.exists() and tuple(json.loads(meta.read_text())["layer_ids"]) == tuple(taps):
        log.info("reusing cached features in %s", fdir)
        return fdir
    seqs, starts = _corpus(args, target_dir, cfg)
    if args.teacher == "runtime":
        target = RuntimeTarget.load(target_dir, taps, max_len=cfg.max_len)
    else:
        target = HFTarget.load(target_dir, taps)
    cache_features(target, seqs, starts, fdir, topk=cfg.topk, max_len=cfg.max_len, max_minutes=args.feature_minutes)
    return fdir


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from dspark_trt.train.trainer import train

    if args.target is None:
        from dspark_trt.runtime.default_model import default_target_dir
        args.target = default_target_dir()
    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    if args.gamma < 2:
        raise InvalidArgumentError(f"--gamma {args.gamma} must be ≥ 2. Fix: pass e.g. --gamma 7.")
    cfg = dataclasses.replace(D, gamma=args.gamma, layers=layers, num_layers=args.num_layers,
                              markov_rank=args.markov_rank, draft_vocab_size=args.draft_vocab,
                              max_minutes=args.max_minutes, max_steps=args.max_steps, max_tokens=args.max_tokens,
                              train_tokens=args.train_tokens,
                              autocast_bf16={"auto": None, "bf16": True, "off": False}[args.autocast],
                              onpolicy=OnPolicyConfig(every=args.onpolicy_every, start=args.onpolicy_start,
                                                      start_frac=args.onpolicy_start_frac,
                                                      frac=args.onpolicy_frac, reject_weight=args.reject_weight),
                              loss=dataclasses.replace(D.loss, ce=args.loss_ce, l1=args.loss_l1),
                              lr=args.lr, batch_seqs=args.batch_seqs, anchors=args.anchors, seed=args.seed,
                              threads=args.threads)
    torch.set_num_threads(cfg.threads)
    if args.stream_chunk_tokens:
        return _stream(args, cfg)
    fdir = _features(args, Path(args.target), layers, cfg)
    if args.features_only:
        return 0
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    metrics = train(cfg, hf, Path(args.target), [fdir, *args.extra_features], args.out, resume=args.resume,
                    init_from=args.init_from)
    log.info("drafter written to %s (held-out τ_tf %.3f)", args.out / "drafter", metrics.get("heldout_tau_tf") or 0)
    return 0


def _stream(args: argparse.Namespace, cfg: TrainConfig) -> int:
    from dspark_trt.train.stream import StreamConfig, stream_train

    if args.features_only or args.extra_features or args.train_tokens:
        raise InvalidArgumentError("--stream-chunk-tokens trains on the corpus chunk by chunk, without a stored "
                                   "teacher pass. Fix: drop --features-only / --extra-features / --train-tokens.")
    scfg = StreamConfig(chunk_tokens=args.stream_chunk_tokens, anchors_per_token=args.anchors_per_token,
                        milestones=tuple(int(float(x)) for x in args.milestones.split(",") if x.strip()),
                        max_minutes=args.max_minutes, start_step=args.start_step)
    seqs, starts = _corpus(args, Path(args.target), cfg)
    rec = stream_train(cfg, scfg, Path(args.target), seqs, starts, args.out, resume=args.resume,
                       init_from=args.init_from, teacher=args.teacher)
    log.info("stream at step %d of %d, %d answer tokens trained on%s", rec.get("step", 0), rec["plan"]["total_steps"],
             rec.get("trained_answer_tokens", 0), " (finished)" if rec["finished"] else "")
    return 0
