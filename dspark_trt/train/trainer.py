"""Distilling a DSpark drafter from cached target features: the training loop, held-out evaluation,
checkpoints/resume and the final export + STS calibration.

Owns: `TrainConfig` (frozen defaults of `dspark-trt train-drafter`), `train(...)`. Uses the loss from
train.loss, batches from train.batches, the module and checkpoint format from runtime.drafters.
Deterministic for a seed: batch b of step s is drawn from numpy Generator([seed, s]), so a resumed run
continues the same batch sequence. The learning-rate schedule is step-based (warmup + cosine); with only
a minute budget, the total step count is refitted every 25 steps to the measured step time (so the cosine
ends when the budget does; bit-exact determinism needs --max-steps).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm import tqdm

from dspark_trt.errors import DrafterError
from dspark_trt.runtime.drafters import DSparkModel, save_dspark, target_weights
from dspark_trt.runtime.ops import bf16_matmul_fast
from dspark_trt.train.batches import Batch, SeqRef, eligible, make_batch, split, take_tokens, token_counts
from dspark_trt.train.calibrate import CalibrationReport, sts
from dspark_trt.train.features import FeatureStore
from dspark_trt.train.head_loss import draft_logprobs
from dspark_trt.train.loss import LossWeights, dspark_loss, dspark_loss_topk, make_t2d
from dspark_trt.train.model_init import (frequent_tokens, grow_layers, grow_markov_rank, grow_taps, init_from_target,
                                         new_config)
from dspark_trt.train.onpolicy import OnPolicyConfig, onpolicy_batch, path_tau, rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    gamma: int = 7
    layers: tuple[int, ...] | None = None  # target taps; None = 5 spread layers
    num_layers: int = 2
    markov_rank: int = 64
    draft_vocab_size: int = 16384  # 0 = full vocabulary
    lr: float = 1e-3
    min_lr_frac: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    batch_seqs: int = 8
    anchors: int = 32
    max_len: int = 384
    max_minutes: float = 60.0
    max_steps: int = 0  # 0 = as many as max_minutes allows
    start_step: int = 0  # a new or --init-from run starts its schedule here (a streamed run continued elsewhere)
    stop_step: int = 0  # > 0: return at this step without ending the schedule (train.stream: one call per chunk)
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_minutes: float = 5.0
    threads: int = 2
    topk: int = 16
    heldout_frac: float = 0.04
    path_eval_seqs: int = 64  # held-out sequences whose greedy loop path is walked at the end (0 = none): τ along
    # the loop's own anchors, the in-distribution proxy of loop τ (uniform-anchor τ_tf overstates it)
    max_tokens: int = 2_000_000
    train_tokens: int = 0  # > 0: train on a seeded subset of about this many answer tokens (the data → τ curve)
    loss: LossWeights = field(default_factory=LossWeights)
    onpolicy: OnPolicyConfig = field(default_factory=OnPolicyConfig)  # loop-path batches mixed with replay
    autocast_bf16: bool | None = None  # None: bf16 where its products are fast here (runtime.ops.bf16_matmul_fast)
    fused_head: bool = True  # log-probs at the teacher's top-k chunk by chunk (train.head_loss), not from [N, γ, Vd]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _lr(cfg: TrainConfig, step: int, total: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _to(b: Batch, dev: torch.device) -> Batch:
    return Batch(*(getattr(b, f.name).to(dev) for f in dataclasses.fields(Batch)))


def _head_in(model: DSparkModel, dtype: torch.dtype) -> torch.Tensor:
    """The frozen draft-vocab head [Vd, d] in the products' dtype, cast once (not per step, as autocast would)."""
    _, head = model._need_target()
    hit = model.__dict__.get("_head_cast")
    if hit is None or hit[0] is not head or hit[1] != (head._version, dtype):  # the very tensor, unmodified
        hit = model.__dict__["_head_cast"] = (head, (head._version, dtype), head.detach().to(dtype).contiguous())
    return hit[2]


def forward_loss(model: DSparkModel, b: Batch, t2d: torch.Tensor, cfg: TrainConfig,  # noqa: ANN201
                 with_acc: bool = True):
    """One teacher-forced forward + loss on a batch → (LossOut, greedy draft ids [B, A, γ], conf_logit [B, A, γ]).
    cfg.fused_head: the log-probs at the teacher's top-k from train.head_loss (no [B, A, γ, Vd] tensor); else from
    forward_train's full logits (the reference the fused path is tested against)."""
    dev = b.features.device
    G = cfg.gamma
    ids, logp = b.topk_ids.reshape(-1, G, b.topk_ids.shape[-1]), b.topk_logp.reshape(-1, G, b.topk_logp.shape[-1])
    valid = b.valid.reshape(-1, G)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        if not cfg.fused_head:
            _, logits, conf = model.forward_train(b.features, b.tokens, b.anchors, G)  # [B, A, γ, Vd]
        else:
            hid, w1x, conf = model.forward_train_parts(b.features, b.tokens, b.anchors, G)  # [B, A, γ, d]
    conf2 = None if conf is None else conf.float().reshape(-1, G)
    if not cfg.fused_head:
        lo = dspark_loss(logits.float().reshape(-1, G, logits.shape[-1]), conf2, ids, logp, t2d, valid, cfg.loss,
                         with_acc=with_acc)
        return lo, logits.argmax(-1), conf
    head = _head_in(model, torch.bfloat16 if cfg.autocast_bf16 else hid.dtype)
    d = hid.shape[-1]
    w2 = model.markov_w2.weight if w1x is not None else None
    lp_on, am = draft_logprobs(hid.reshape(-1, d), head, None if w1x is None else w1x.reshape(-1, w1x.shape[-1]), w2,
                               t2d[ids].clamp(min=0).reshape(-1, ids.shape[-1]))  # [N·γ, k], [N·γ]
    lo = dspark_loss_topk(lp_on.view(ids.shape), am.view(valid.shape) if with_acc else None, conf2, ids, logp, t2d,
                          valid, cfg.loss)
    return lo, am.view(hid.shape[:-1]), conf


@torch.no_grad()
def evaluate(model: DSparkModel, stores: Sequence[FeatureStore], refs: Sequence[SeqRef], t2d: torch.Tensor,
             cfg: TrainConfig) -> dict[str, Any]:
    """Teacher-forced held-out metrics: α_k (conditional greedy match), τ estimate, raw confidence logits."""
    if not refs:
        return {}
    model.eval()
    dev = t2d.device
    matches, confs, losses = [], [], []
    for i in range(cfg.eval_batches):
        rng = np.random.default_rng([cfg.seed, 10**9 + i])
        pick = [refs[j] for j in rng.integers(0, len(refs), size=cfg.batch_seqs)]
        b = _to(make_batch(stores, pick, rng, cfg.anchors, cfg.gamma, cfg.max_len), dev)
        # the full-logits path: without autograd its U product runs in fp32 on the native kernels, as every earlier
        # held-out τ_tf was measured (the fused path would round U to bf16, as training does)
        lo, draft, conf = forward_loss(model, b, t2d, dataclasses.replace(cfg, fused_head=False), with_acc=False)
        top1 = t2d[b.topk_ids[..., 0]]  # [B, A, γ]
        matches.append((draft == top1).reshape(-1, cfg.gamma).float().cpu())
        if conf is not None:
            confs.append(conf.float().reshape(-1, cfg.gamma).cpu())
        losses.append(float(lo.total.detach()))
    model.train()
    m = torch.cat(matches)
    surv = m.cumprod(-1)
    reach = torch.cat([torch.ones_like(m[:, :1]), surv[:, :-1]], 1)
    alpha = (m * reach).sum(0) / reach.sum(0).clamp(min=1)
    return {"loss": float(np.mean(losses)), "alpha": [round(float(a), 4) for a in alpha],
            "tau_tf": float(1 + surv.sum(-1).mean()), "match": m, "conf": torch.cat(confs) if confs else None}


def _save_state(path: Path, model: DSparkModel, opt: torch.optim.Optimizer, step: int, total: int,
                elapsed: float, cfg: TrainConfig, opt_start: int = 0) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "total": total,
                "elapsed": elapsed, "opt_start": opt_start, "cfg": dataclasses.asdict(cfg),
                "dspark_cfg": model.cfg.to_dict()}, tmp)
    tmp.replace(path)


def export(model: DSparkModel, out: Path, report: CalibrationReport | None = None) -> Path:
    m = model
    if report is not None:
        m.set_temperatures(report.temperatures)
    return save_dspark(m, out, dtype=torch.bfloat16)


def train(cfg: TrainConfig, hf_target: torch.nn.Module, target_dir: Path, store_dirs: Sequence[Path], out: Path,
          resume: bool = False, init_from: Path | None = None, deadline: float | None = None) -> dict[str, Any]:
    """Train, calibrate and export a DSpark drafter to out/drafter; returns a metrics dict (also out/metrics.json).
    init_from: a drafter checkpoint dir whose weights (and draft vocabulary) start a new run with a fresh optimizer
    (continue training across machines when train_state.pt is gone); resume takes precedence.
    deadline: a time.time() at which to stop (checkpointed, resumable) whatever the budgets say."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    dev = _device()
    if cfg.autocast_bf16 is None:  # a CPU without AVX512_BF16 / AMX runs bf16 GEMMs ~100x slower than fp32 ones
        cfg = dataclasses.replace(cfg, autocast_bf16=bf16_matmul_fast(dev))
    stores = [FeatureStore.open(d) for d in store_dirs]
    refs = eligible(stores, cfg.gamma)
    if not refs:
        raise DrafterError("No training sequence is long enough for the block size. Fix: add corpus text or lower --gamma.")
    train_refs, held_refs = split(refs, cfg.heldout_frac, cfg.seed)
    if cfg.train_tokens > 0:  # the held-out split does not depend on the budget
        train_refs = take_tokens(stores, train_refs, cfg.train_tokens, cfg.seed)
    embed, head = target_weights(hf_target)
    state_path = out / "train_state.pt"
    state = torch.load(state_path, map_location="cpu", weights_only=False) if resume and state_path.exists() else None
    if state is not None:
        from dspark_trt.runtime.drafters import DSparkConfig
        dcfg = DSparkConfig.from_dict(state["dspark_cfg"])
        model = DSparkModel(dcfg)
        model.load_state_dict(state["model"])
        log.info("resuming at step %d (%.1f min done)", state["step"], state["elapsed"] / 60)
    elif init_from is not None:
        from dspark_trt.runtime.drafters.loader import load_dspark_model
        model = load_dspark_model(Path(init_from))
        if cfg.layers is not None:  # --layers with the checkpoint's taps and more: new taps that start silent
            model = grow_taps(model, cfg.layers)
        meta = json.loads((Path(store_dirs[0]) / "meta.json").read_text())
        if tuple(meta["layer_ids"]) != tuple(model.cfg.target_layer_ids):
            raise DrafterError(f"--init-from {init_from} taps layers {list(model.cfg.target_layer_ids)} but the cached "
                               f"features tap {meta['layer_ids']}. Fix: recache with --layers matching the drafter.")
        if model.cfg.block_size != cfg.gamma:
            raise DrafterError(f"--init-from {init_from} has block size {model.cfg.block_size}, --gamma is {cfg.gamma}. "
                               f"Fix: pass --gamma {model.cfg.block_size}.")
        log.info("starting from the weights of %s (fresh optimizer)", init_from)
        model = grow_layers(model, cfg.num_layers)  # --num-layers above the checkpoint's: new identity layers
        model = grow_markov_rank(model, cfg.markov_rank)  # --markov-rank above the checkpoint's: silent new rank
    else:
        meta = json.loads((Path(store_dirs[0]) / "meta.json").read_text())
        layers = tuple(meta["layer_ids"])
        if cfg.layers is not None and tuple(cfg.layers) != layers:
            raise DrafterError(f"Cached features tap layers {layers}, config asks for {cfg.layers}. Fix: recache.")
        V = embed.shape[0]
        dv = cfg.draft_vocab_size if 0 < cfg.draft_vocab_size < V else 0
        dcfg = new_config(target_dir, layers, cfg.num_layers, cfg.gamma, cfg.markov_rank, dv, embed)
        dcfg = dcfg.replace(num_anchors=cfg.anchors)
        model = DSparkModel(dcfg)
        init_from_target(model, hf_target)
        if dv:
            specials = [i for i in dcfg.target_vocab.get("special", {}).values() if isinstance(i, int)]
            model.d2t.copy_(frequent_tokens(token_counts(stores, train_refs, V), dv, specials))
    model.to(dev).train()
    model.attach_target(embed.float().to(dev), head.float().to(dev))
    t2d = make_t2d(model.d2t, model.cfg.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, total, elapsed = cfg.start_step, cfg.max_steps, 0.0
    opt_start = cfg.start_step  # a fresh optimizer past the schedule's warmup gets a warmup of its own
    if state is not None:
        opt.load_state_dict(state["opt"])
        step, total, elapsed = state["step"], state["total"], state["elapsed"]
        opt_start = state.get("opt_start", 0)
        if cfg.max_steps:
            total = cfg.max_steps
        elif state["cfg"].get("max_minutes") != cfg.max_minutes:
            total = 0  # new time budget: re-estimate the schedule length
    n_params = sum(p.numel() for p in params)
    log.info("drafter: %.2fM trainable params, %d layers, taps %s, Vd=%d, γ=%d; %d train / %d held-out seqs",
             n_params / 1e6, model.cfg.num_hidden_layers, list(model.cfg.target_layer_ids), model.cfg.head_vocab,
             cfg.gamma, len(train_refs), len(held_refs))
    budget = cfg.max_minutes * 60
    t0, last_ckpt = time.time() - elapsed, time.time()
    s0, ts0 = step, time.time()  # this session's start (for the step-time estimate)
    history: list[dict[str, Any]] = []
    rollouts: list[dict[str, Any]] = []  # on-policy refreshes: the rolled-out loop's τ on training sequences
    paths: list = []
    bar = tqdm(total=total or None, initial=step, desc="train", unit="step")
    ema = None
    op_start: int | None = None
    best_tau, best_step, best_state = -1.0, -1, None
    while True:
        now = time.time()
        if (total and step >= total) or (now - t0) >= budget or (cfg.stop_step and step >= cfg.stop_step) or \
                (deadline is not None and now >= deadline):
            break
        if not cfg.max_steps and step >= s0 + 10 and (not total or step % 25 == 0):
            # time budget: (re)fit the schedule length to the measured step time (shared CPUs drift)
            total = max(step + 1, step + int((budget - (now - t0)) / ((now - ts0) / (step - s0))))
            bar.total = total
            log.debug("schedule: %d steps in %.1f min", total, cfg.max_minutes)
        warm = min(1.0, (step - opt_start + 1) / cfg.warmup_steps) if opt_start > 0 else 1.0
        for g in opt.param_groups:
            g["lr"] = warm * _lr(cfg, step, total or 10**9)
        op = cfg.onpolicy
        if op.every and op_start is None and step >= op.start and \
                (step / total if total else (now - t0) / budget) >= op.start_frac:
            op_start = step  # the on-policy phase begins: the share of the run before it is done
        if op_start is not None and (step - op_start) % op.every == 0:  # roll the loop with these weights
            r = np.random.default_rng([cfg.seed, step, 1])
            paths = rollout(model, stores, [train_refs[j] for j in r.integers(0, len(train_refs), size=op.seqs)],
                            cfg.gamma, cfg.max_len, cfg.autocast_bf16)
            rollouts.append({"step": step, "paths": len(paths), "loop_tau": round(path_tau(paths), 3)})
            log.info("on-policy rollout: %s", rollouts[-1])
        rng = np.random.default_rng([cfg.seed, step])
        if paths and rng.random() < op.frac:
            b = _to(onpolicy_batch(stores, paths, rng, cfg.batch_seqs, cfg.anchors, cfg.gamma, op.reject_weight), dev)
        else:
            pick = [train_refs[j] for j in rng.integers(0, len(train_refs), size=cfg.batch_seqs)]
            b = _to(make_batch(stores, pick, rng, cfg.anchors, cfg.gamma, cfg.max_len), dev)
        lo, _, _ = forward_loss(model, b, t2d, cfg, with_acc=step % 10 == 0)
        opt.zero_grad(set_to_none=True)
        lo.total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        lt = float(lo.total.detach())
        ema = lt if ema is None else 0.95 * ema + 0.05 * lt
        bar.update(1)
        if step % 10 == 1:
            bar.set_postfix(loss=f"{ema:.3f}", ce=f"{float(lo.ce):.2f}", a1=f"{float(lo.acc[0]):.2f}")
        if cfg.eval_every and step % cfg.eval_every == 0:
            ev = evaluate(model, stores, held_refs, t2d, cfg)
            history.append({"step": step, "min": round((time.time() - t0) / 60, 2), "train_loss": round(ema, 4),
                            "heldout_loss": round(ev.get("loss", 0.0), 4), "alpha": ev.get("alpha"),
                            "tau_tf": round(ev.get("tau_tf", 0.0), 3)})
            log.info("step %d: %s", step, history[-1])
            if ev and ev["tau_tf"] > best_tau:  # keep the best held-out weights (small data overfits)
                best_tau, best_step = ev["tau_tf"], step
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if time.time() - last_ckpt > cfg.ckpt_minutes * 60:
            _save_state(state_path, model, opt, step, total, time.time() - t0, cfg, opt_start)
            export(model, out / "drafter")
            last_ckpt = time.time()
    bar.close()
    wall = time.time() - t0
    _save_state(state_path, model, opt, step, total, wall, cfg, opt_start)
    ev = evaluate(model, stores, held_refs, t2d, cfg)
    if best_state is not None and ev and best_tau > ev["tau_tf"]:
        log.info("final held-out τ_tf %.3f < best %.3f at step %d: exporting the best weights",
                 ev["tau_tf"], best_tau, best_step)
        model.load_state_dict(best_state)
        ev = evaluate(model, stores, held_refs, t2d, cfg)
    report = sts(ev["conf"], ev["match"]) if ev and ev.get("conf") is not None else None
    held_path = (rollout(model, stores, held_refs[:cfg.path_eval_seqs], cfg.gamma, cfg.max_len, cfg.autocast_bf16)
                 if cfg.path_eval_seqs > 0 else [])
    export(model, out / "drafter", report)
    metrics = {"steps": step, "best_step": best_step, "wall_minutes": round(wall / 60, 2), "trainable_params": n_params,
               "train_sequences": len(train_refs), "heldout_sequences": len(held_refs),
               "train_tokens": int(sum(stores[r.store].seq(r.index)[1] - stores[r.store].seq(r.index)[0] for r in train_refs)),
               "heldout_alpha_tf": ev.get("alpha"), "heldout_tau_tf": ev.get("tau_tf"),
               "heldout_path_tau": round(path_tau(held_path), 3) if held_path else None,
               "heldout_paths": len(held_path), "history": history,
               "onpolicy_rollouts": rollouts, "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str))}
    if report is not None:
        metrics["calibration"] = {"temperatures": report.temperatures, "ece_before": report.ece_before,
                                  "ece_after": report.ece_after, "auc": report.auc, "auc_survival": report.auc_survival,
                                  "mean_ece_before": report.mean_ece_before, "mean_ece_after": report.mean_ece_after}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("done: %d steps in %.1f min; held-out α %s τ_tf %.3f, loop-path τ %s over %d sequences", step, wall / 60,
             ev.get("alpha"), ev.get("tau_tf", 0), metrics["heldout_path_tau"], len(held_path))
    return metrics
