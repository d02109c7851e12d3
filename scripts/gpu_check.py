"""One-shot GPU check of the dspark kernels and the reference runtime (run by scripts/gpu_check.sh).

Owns the measurement plan: (1) parity of fused_accept (greedy + sampling) and block_draft on CUDA against the
torch references (run on CPU copies), (2) achieved GB/s of fused_accept vs measured HBM peak (big device copy),
(3) reference-runtime plain vs DSpark tokens/s on a random-init SmolLM2-135M-shaped target. Each section is
isolated: a missing module or an exception is recorded and the next section runs. Writes report.md and
report.json into the output directory; exit status 1 on parity failure (or no CUDA), 0 otherwise.
Prints only its final report (a script, not library code).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("gpu_check")
# DSPARK_GPU_CHECK_SMOKE=1: run the same code on CPU (Triton interpreter, tiny shapes) to test this script itself
SMOKE = os.environ.get("DSPARK_GPU_CHECK_SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if SMOKE else "cuda"
TARGET_FRACTION = 0.70  # fused_accept goal: ≥ 70 % of measured HBM bandwidth at large shapes
DEADLINE_S = float(os.environ.get("DSPARK_GPU_CHECK_DEADLINE", "450"))  # headroom inside the 8-minute budget
T0 = time.monotonic()


def left() -> float:
    return DEADLINE_S - (time.monotonic() - T0)


def section(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one section; record its result, or its error, never raise."""
    t = time.monotonic()
    if left() < 20:
        report[name] = {"status": "skipped", "reason": "time budget exhausted"}
        return
    try:
        out = fn()
        out.setdefault("status", "ok")
    except ModuleNotFoundError as exc:
        out = {"status": "missing", "reason": f"module not available: {exc.name}"}
    except Exception as exc:  # noqa: BLE001 - the report must survive any failure
        out = {"status": "error", "reason": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.monotonic() - t, 1)
    report[name] = out
    log.info("%s: %s (%.1fs)", name, out["status"], out["seconds"])


# ----------------------------------------------------------------------------------------------- parity
def _accept_inputs(b: int, kmax: int, v: int, dtype: torch.dtype, seed: int, sampled: bool) -> dict[str, Any]:
    from dspark_trt.spec_decode.accept import target_probs

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, kmax + 1, v, generator=g) * 3).to(dtype)  # [B, K+1, V]
    target = logits.float().argmax(-1)
    if sampled:
        temperature = torch.rand(b, generator=g) + 0.5
        temperature[0] = 0.0
        p = target_probs(logits[:, :kmax], temperature, 1.0)  # [B, K, V]
        mix = torch.rand(b, 1, 1, generator=g)
        q = mix * p + (1 - mix) * torch.softmax(torch.randn(b, kmax, v, generator=g) * 2, -1)
        draft = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, kmax) if kmax else \
            torch.zeros(b, 0, dtype=torch.long)
    else:
        temperature, q = torch.zeros(b), None
        draft = torch.randint(0, v, (b, kmax), generator=g)
        draft[::3] = target[::3, :kmax]  # all-accepted rows
    return dict(logits=logits, draft=draft, q=q, k=torch.randint(0, kmax + 1, (b,), generator=g),
                temperature=temperature, top_p=torch.ones(b), seeds=torch.randint(0, 2**40, (b,), generator=g),
                positions=torch.randint(0, 4000, (b,), generator=g))


def _cuda(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def shapes(full: list[tuple], small: list[tuple]) -> list[tuple]:
    return small if SMOKE else full


def parity_accept() -> dict[str, Any]:
    from dspark_trt.spec_decode import accept as ref
    from dspark_trt.kernels import api

    base = shapes([(1, 0, 49152, torch.bfloat16), (8, 4, 49152, torch.bfloat16), (64, 8, 49152, torch.bfloat16),
                   (16, 7, 128256, torch.bfloat16), (4, 5, 5000, torch.float32), (33, 3, 128256, torch.float32)],
                  [(1, 0, 3000, torch.bfloat16), (3, 4, 5000, torch.float32)])
    cases = [(b, k, v, dt, s) for s in (False, True) for (b, k, v, dt) in base]
    rows, fails = [], 0
    for i, (b, kmax, v, dt, sampled) in enumerate(cases):
        a = _accept_inputs(b, kmax, v, dt, seed=i, sampled=sampled)
        if sampled:
            want = ref.sample_accept(**a)
            got = api.sample_accept(**_cuda(a))
        else:
            want = ref.greedy_accept(a["logits"], a["draft"], a["k"])
            got = api.greedy_accept(a["logits"].to(DEV), a["draft"].to(DEV), a["k"].to(DEV))
        sync()
        tok_mism = int((got.next_token.cpu() != want.next_token).sum())
        acc_mism = int((got.accepted.cpu() != want.accepted).sum())
        err = max(float((got.top1.cpu() - want.top1).abs().max()), float((got.margin.cpu() - want.margin).abs().max()))
        ok = tok_mism == 0 and acc_mism == 0 and err < 1e-4
        fails += not ok
        rows.append(dict(B=b, K=kmax, V=v, dtype=str(dt).replace("torch.", ""), mode="sample" if sampled else "greedy",
                         token_mismatch=tok_mism, accepted_mismatch=acc_mism, max_prob_err=err, ok=ok))
    return {"status": "ok" if fails == 0 else "fail", "cases": rows, "parity_failures": fails}


def parity_block_draft() -> dict[str, Any]:
    from dspark_trt.kernels import api
    from dspark_trt.kernels.block_draft import reference as R

    rows, fails = [], 0
    cases = shapes([(4, 7, 49152, 64, torch.bfloat16), (20, 5, 8192, 256, torch.float32),
                    (2, 7, 49152, 256, torch.bfloat16), (33, 7, 49152, 256, torch.bfloat16)],
                   [(2, 3, 700, 16, torch.bfloat16)])
    for i, (b, gamma, v, r, wdt) in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)
        t = torch.rand(b, generator=g) + 0.5
        t[0] = 0.0
        a = dict(backbone_logits=torch.randn(b, gamma, v, generator=g) * 2,
                 anchor=torch.randint(0, v, (b,), generator=g),
                 w1=(torch.randn(v, r, generator=g) * 0.1).to(wdt), w2=(torch.randn(v, r, generator=g) * 0.1).to(wdt),
                 temperature=t, seeds=torch.randint(0, 2**40, (b,), generator=g),
                 positions=torch.randint(0, 4000, (b,), generator=g), conf_bias=torch.randn(b, gamma, generator=g),
                 w_conf=torch.randn(r, generator=g) * 0.1, conf_temp=torch.rand(gamma, generator=g) + 0.5)
        want = R.markov_block(**a)
        for impl in ("one", "split"):
            got = api.markov_block(**_cuda(a), impl=impl)
            sync()
            mism = int((got.tokens.cpu() != want.tokens).sum())
            qerr = float((got.q.cpu() - want.q).abs().max())
            cerr = float((got.conf.cpu() - want.conf).abs().max())
            ok = mism == 0 and qerr < (1e-4 if wdt == torch.float32 else 1e-2) and cerr < 1e-4
            fails += not ok
            rows.append(dict(impl=impl, B=b, gamma=gamma, V=v, r=r, weights=str(wdt).replace("torch.", ""),
                             token_mismatch=mism, max_q_err=qerr, max_conf_err=cerr, ok=ok))
    return {"status": "ok" if fails == 0 else "fail", "cases": rows, "parity_failures": fails}


def parity_dispatch() -> dict[str, Any]:
    """The runtime's dispatch point really takes the kernel path on CUDA."""
    from dspark_trt.runtime import dispatch
    from dspark_trt.spec_decode import accept as ref
    from dspark_trt.spec_decode.protocols import SamplingParams

    v = 49152 if not SMOKE else 500
    if not SMOKE:
        assert dispatch.use_kernels(torch.zeros(1, device="cuda")), "dispatch.use_kernels is False on CUDA"
    checks = {}
    # greedy; draft and k stay on CPU (as the spec loop's DraftBlock delivers them), logits on the device
    a = _accept_inputs(8, 4, v, torch.bfloat16, seed=42, sampled=False)
    got = dispatch.accept(a["logits"].to(DEV), a["draft"], a["k"], None, [SamplingParams()] * 8)
    want = ref.greedy_accept(a["logits"], a["draft"], a["k"])
    checks["greedy_mixed_devices"] = torch.equal(got.next_token.cpu(), want.next_token) and \
        torch.equal(got.accepted.cpu(), want.accepted)
    # sampled, q on CPU; then top_p < 1 (reference fallback on CPU, results returned on the device)
    a = _accept_inputs(8, 4, v, torch.bfloat16, seed=43, sampled=True)
    for name, top_p in (("sampled_mixed_devices", 1.0), ("top_p_fallback", 0.9)):
        sp = [SamplingParams(temperature=float(t), top_p=top_p, seed=int(s))
              for t, s in zip(a["temperature"], a["seeds"])]
        got = dispatch.accept(a["logits"].to(DEV), a["draft"], a["k"], a["q"], sp, positions=a["positions"])
        want = ref.sample_accept(a["logits"], a["draft"], a["q"], a["k"], a["temperature"], torch.full((8,), top_p),
                                 a["seeds"] & 0xFFFFFFFF, a["positions"])
        checks[name] = got.next_token.device.type == DEV and torch.equal(got.next_token.cpu(), want.next_token) \
            and torch.equal(got.accepted.cpu(), want.accepted)
    fails = sum(not ok for ok in checks.values())
    return {"status": "ok" if fails == 0 else "fail", "checks": checks, "parity_failures": fails}


# -------------------------------------------------------------------------------------------- bandwidth
def _time_cuda(fn: Callable[[], Any], iters: int) -> float:
    """Mean seconds per call over `iters` back-to-back calls after 3 warmups (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def bandwidth() -> dict[str, Any]:
    from dspark_trt.kernels import api

    if SMOKE:
        return {"status": "skipped", "reason": "smoke mode (CPU): no bandwidth measurement"}
    n = 1 << 30  # 2 GiB of bf16 read + 2 GiB written per copy
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = _time_cuda(lambda: dst.copy_(src), 20)
    peak = 2 * src.numel() * src.element_size() / t / 1e9
    del src, dst
    torch.cuda.empty_cache()
    rows = []
    for v in (49152, 128256):
        for kmax in (4, 8):
            for b in (1, 8, 32, 64):
                if left() < 40:
                    break
                logits = torch.randn(b, kmax + 1, v, device="cuda", dtype=torch.bfloat16)
                draft = torch.randint(0, v, (b, kmax), device="cuda")
                k = torch.full((b,), kmax, device="cuda")
                sec = _time_cuda(lambda: api.greedy_accept(logits, draft, k), 50)
                gbs = logits.numel() * logits.element_size() / sec / 1e9
                rows.append(dict(B=b, K=kmax, V=v, us=round(sec * 1e6, 2), GBps=round(gbs, 1),
                                 frac_of_peak=round(gbs / peak, 3)))
    big = [r for r in rows if r["B"] >= 32]
    best = max((r["frac_of_peak"] for r in big), default=0.0)
    return {"peak_GBps": round(peak, 1), "cases": rows, "target_fraction": TARGET_FRACTION,
            "best_large_fraction": best, "meets_target": best >= TARGET_FRACTION,
            "tile_sweep_B64_K8_V128256": _tile_sweep(peak)}


def _tile_sweep(peak: float) -> list[dict[str, Any]]:
    """GB/s of the stats tile/warp/program-count choices at one large shape (tunes dspark_trt/kernels/fused_accept/launch.py)."""
    from dspark_trt.kernels import api
    from dspark_trt.kernels.fused_accept import launch

    saved = (launch.BLOCK_V, launch.NUM_WARPS, launch.TARGET_PROGRAMS)
    logits = torch.randn(64, 9, 128256, device="cuda", dtype=torch.bfloat16)
    draft = torch.randint(0, 128256, (64, 8), device="cuda")
    k = torch.full((64,), 8, device="cuda")
    out = []
    try:
        for bv, nw, tp in ((2048, 8, 2048), (2048, 4, 2048), (4096, 8, 2048), (4096, 16, 2048), (1024, 4, 4096),
                           (2048, 8, 528), (8192, 16, 2048)):
            if left() < 30:
                break
            launch.BLOCK_V, launch.NUM_WARPS, launch.TARGET_PROGRAMS = bv, nw, tp
            sec = _time_cuda(lambda: api.greedy_accept(logits, draft, k), 30)
            gbs = logits.numel() * 2 / sec / 1e9
            out.append(dict(BLOCK_V=bv, num_warps=nw, target_programs=tp, GBps=round(gbs, 1),
                            frac_of_peak=round(gbs / peak, 3)))
    finally:
        launch.BLOCK_V, launch.NUM_WARPS, launch.TARGET_PROGRAMS = saved
    return out


def markov_timing() -> dict[str, Any]:
    """ms per γ = 7 block of the one-launch vs the split Markov kernels (Vd 49152, r 256, bf16 weights)."""
    from dspark_trt.kernels import api
    from dspark_trt.kernels.block_draft import launch

    if SMOKE:
        return {"status": "skipped", "reason": "smoke mode (CPU): no timing"}
    v, r, gamma = 49152, 256, 7
    w1 = torch.randn(v, r, device="cuda").mul_(0.05).bfloat16()
    w2 = torch.randn(v, r, device="cuda").mul_(0.05).bfloat16()
    rows = []
    for b in (1, 8, 32, 64):
        if left() < 30:
            break
        a = dict(backbone_logits=torch.randn(b, gamma, v, device="cuda"),
                 anchor=torch.randint(0, v, (b,), device="cuda"),
                 w1=w1, w2=w2, temperature=torch.full((b,), 0.8, device="cuda"),
                 seeds=torch.arange(b, device="cuda"), positions=torch.full((b,), 100, device="cuda"))
        row: dict[str, Any] = dict(B=b)
        for impl in ("one", "split"):
            row[f"{impl}_ms"] = round(_time_cuda(lambda: api.markov_block(**a, impl=impl), 5) * 1e3, 3)
        row["auto"] = launch.choose_impl(b, True)
        rows.append(row)
    return {"cases": rows, "W2_MB_per_step": round(v * r * 2 / 1e6, 1)}


# ---------------------------------------------------------------------------------------------- runtime
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    max_position_embeddings=8192)
SMOKE_SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


def _random_target() -> Any:
    from dspark_trt.runtime.config import ModelConfig
    from dspark_trt.runtime.model import CausalLM

    torch.manual_seed(0)
    cfg = dict(SMOLLM2_135M, **SMOKE_SHAPE) if SMOKE else SMOLLM2_135M
    model = CausalLM(ModelConfig(**cfg), dtype=torch.bfloat16).to(DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def runtime_tokens_per_s() -> dict[str, Any]:
    out: dict[str, Any] = {"model": "random-init SmolLM2-135M-shaped CausalLM (bf16; weights cannot travel)"}
    target = _random_target()
    prompt, new = (64, 128) if not SMOKE else (8, 8)
    # plain decoding straight on CausalLM (needs only runtime/model.py)
    cache = target.new_cache(1, prompt + new + 16)
    ids = torch.randint(0, target.config.vocab_size, (1, prompt), device=DEV)
    slots = torch.zeros(1, dtype=torch.long, device=DEV)
    sync()
    t = time.monotonic()
    with torch.inference_mode():
        nxt = target(ids, cache, slots, logits="last").logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new - 1):
            nxt = target(nxt, cache, slots, logits="last").logits[:, -1].argmax(-1, keepdim=True)
    sync()
    out["plain_causallm_tok_s"] = round(new / (time.monotonic() - t), 1)
    # the speculative loop through SpecBackend (runtime/backend.py) with plain and DSpark drafting
    try:
        out.update(_spec_loop(target, prompt, new))
    except ModuleNotFoundError as exc:
        out["spec_loop"] = f"skipped: module not available: {exc.name}"
    except Exception as exc:  # noqa: BLE001
        out["spec_loop"] = f"error: {type(exc).__name__}: {exc}"
    if left() > 90:
        try:
            out["tiny_pair"] = _tiny_pair_loop()
        except ModuleNotFoundError as exc:
            out["tiny_pair"] = f"skipped: module not available: {exc.name}"
        except Exception as exc:  # noqa: BLE001
            out["tiny_pair"] = f"error: {type(exc).__name__}: {exc}"
    return out


def _tiny_pair_loop() -> dict[str, Any]:
    """Plain vs LM-drafter speculation on the tiny test pair (draft ≈ 60 % greedy agreement): real τ > 1 on CUDA,
    tokens/s dominated by launch latency (2-layer, 64-hidden models)."""
    import tempfile

    from dspark_trt.runtime.backend import SpecBackend
    from dspark_trt.runtime.drafters.loader import load_drafter
    from dspark_trt.runtime.hf_loader import load_hf_checkpoint
    from dspark_trt.spec_decode.loop import generate
    from dspark_trt.spec_decode.scheduler import PolicyConfig
    from dspark_trt.testing.tiny import default_tiny_root, make_tiny_pair

    # smoke mode reuses the tests' cached pair; on the GPU host a fresh one is built (~10 s)
    pair = make_tiny_pair(default_tiny_root() if SMOKE else Path(tempfile.mkdtemp(prefix="dspark_tiny_")))
    target = load_hf_checkpoint(pair.target, dtype=torch.float32).to(DEV)
    res: dict[str, Any] = {"model": "tiny test pair (dspark_trt.testing.tiny), fp32"}
    prompt_ids = list(range(5, 37))
    new = 16 if SMOKE else 96
    outputs: dict[str, list[int]] = {}
    for name, drafter, policy in (("plain", None, PolicyConfig(policy="plain")),
                                  ("lm_fixed4", load_drafter(pair.draft, target, dtype=torch.float32),
                                   PolicyConfig(policy="fixed", k=4))):
        backend = SpecBackend(target, drafter, max_batch=1, max_seq=len(prompt_ids) + new + 32)
        generate(backend, prompt_ids, max_new_tokens=4, policy=policy)  # warmup
        sync()
        t = time.monotonic()
        r = generate(backend, prompt_ids, max_new_tokens=new, policy=policy)
        sync()
        res[f"{name}_tok_s"] = round(len(r.tokens) / (time.monotonic() - t), 1)
        res[f"{name}_rounds"] = _summary(r.stats)
        outputs[name] = list(r.tokens)
    res["greedy_lossless"] = outputs["plain"] == outputs["lm_fixed4"]  # speculation must not change greedy output
    return res


def _spec_loop(target: Any, prompt: int, new: int) -> dict[str, Any]:
    from dspark_trt.runtime.backend import SpecBackend
    from dspark_trt.runtime.drafters.config import DSparkConfig
    from dspark_trt.runtime.drafters.dspark import DSparkDrafter, DSparkModel
    from dspark_trt.spec_decode.loop import generate
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    c = target.config
    taps = (0, 1) if SMOKE else (1, 10, 19, 28)
    cfg = DSparkConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                       vocab_size=c.vocab_size, target_layer_ids=taps,
                       num_target_layers=c.num_layers, mask_token_id=0, block_size=7, markov_rank=64)
    torch.manual_seed(1)
    dmodel = DSparkModel(cfg).to(device=DEV, dtype=torch.bfloat16)
    dmodel.attach_target(target.embed_tokens.weight, target.lm_head_weight)
    res: dict[str, Any] = {"drafter": "random-init DSpark (2 layers, γ=7, r=64): acceptance ≈ 0, so this measures "
                                      "the loop's overhead, not a speedup"}
    prompt_ids = torch.randint(0, c.vocab_size, (prompt,)).tolist()
    for name, drafter, policy in (("plain", None, PolicyConfig(policy="plain")),
                                  ("dspark_fixed4", DSparkDrafter(dmodel), PolicyConfig(policy="fixed", k=4))):
        backend = SpecBackend(target, drafter, max_batch=1, max_seq=prompt + new + 32)
        generate(backend, prompt_ids, max_new_tokens=8, policy=policy)  # warmup
        sync()
        t = time.monotonic()
        r = generate(backend, prompt_ids, max_new_tokens=new, policy=policy)
        sync()
        res[f"{name}_tok_s"] = round(len(r.tokens) / (time.monotonic() - t), 1)
        res[f"{name}_rounds"] = _summary(r.stats)
    return res


def _summary(stats: Any) -> str:
    """τ (committed per target forward) and acceptance from spec_decode.stats.SpecStats, tolerant of its shape."""
    rounds = list(getattr(stats, "rounds", []) or [])
    if not rounds:
        return str(stats)[:200]
    k = sum(int(getattr(r, "k", 0)) for r in rounds)
    acc = sum(int(getattr(r, "accepted", 0)) for r in rounds)
    com = sum(int(getattr(r, "committed", 0)) for r in rounds)
    return f"{len(rounds)} rounds, tau={com / len(rounds):.2f}, acceptance={acc / k if k else 0.0:.2f}"


# ------------------------------------------------------------------------------------------------ report
def markdown(rep: dict[str, Any]) -> str:
    lines = ["# dspark GPU check", "", f"- device: {rep['env'].get('device')}", f"- verdict: **{rep['verdict']}**", ""]
    for name in ("parity_accept", "parity_block_draft", "parity_dispatch", "bandwidth", "markov_timing", "runtime"):
        sec = rep.get(name, {})
        lines += [f"## {name}: {sec.get('status')} ({sec.get('seconds', 0)} s)", ""]
        if "reason" in sec:
            lines += [f"- {sec['reason']}", ""]
        cases = sec.get("cases")
        if cases:
            keys = list(cases[0])
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(c[k]) for k in keys) + " |" for c in cases]
            lines.append("")
        for k, v in sec.items():
            if k not in ("cases", "status", "seconds", "reason", "trace"):
                lines.append(f"- {k}: {v}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_report")
    outdir.mkdir(parents=True, exist_ok=True)
    rep: dict[str, Any] = {"env": {"python": platform.python_version(), "torch": torch.__version__,
                                   "cuda": torch.cuda.is_available()}}
    try:
        import triton

        rep["env"]["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        rep["env"]["triton"] = f"unavailable: {exc}"
    if not torch.cuda.is_available() and not SMOKE:
        rep["verdict"] = "FAIL: no CUDA device"
    else:
        rep["env"]["device"] = "cpu (smoke mode, Triton interpreter)" if SMOKE else torch.cuda.get_device_name(0)
        if not SMOKE:
            rep["env"]["capability"] = list(torch.cuda.get_device_capability(0))
        section(rep, "parity_accept", parity_accept)
        section(rep, "parity_block_draft", parity_block_draft)
        section(rep, "parity_dispatch", parity_dispatch)
        section(rep, "bandwidth", bandwidth)
        section(rep, "markov_timing", markov_timing)
        section(rep, "runtime", runtime_tokens_per_s)
        bad = [n for n in ("parity_accept", "parity_block_draft", "parity_dispatch")
               if rep.get(n, {}).get("status") != "ok"]
        rep["verdict"] = "PASS" if not bad else f"FAIL: parity not ok in {', '.join(bad)}"
    rep["total_seconds"] = round(time.monotonic() - T0, 1)
    (outdir / "report.json").write_text(json.dumps(rep, indent=2, default=str))
    md = markdown(rep)
    (outdir / "report.md").write_text(md)
    print(md)
    return 0 if rep["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
