"""`dspark-trt build`: validate, quantize (ModelOpt), export TRT-LLM checkpoints, build engines, write the model repo.

Owns the command line only (flags in trtllm-build's style, defaults from BuildOptions) and the final summary;
the work is dspark_trt.builder.pipeline. Logs and progress bars go to stderr; the summary to stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from dspark_trt.builder.options import DTYPES, KV_QUANT_MODES, POLICIES, QUANT_MODES, SERVING_MODES, BuildOptions
from dspark_trt.spec_decode.policies import resolve_policy_alias

log = logging.getLogger(__name__)
_D = BuildOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=_D.target, metavar="DIR",
                   help="target Hugging Face checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=_D.draft, metavar="DIR",
                   help="draft checkpoint dir: a causal LM or a DSpark drafter (default: the shipped DSpark drafter)")
    p.add_argument("--dtype", default=_D.dtype, choices=DTYPES, help="checkpoint / runtime dtype (default %(default)s)")
    p.add_argument("--quant", default=_D.quant, choices=QUANT_MODES,
                   help="ModelOpt weight/activation quantization (default %(default)s)")
    p.add_argument("--kv-quant", dest="kv_quant", default=_D.kv_quant, choices=KV_QUANT_MODES,
                   help="KV-cache quantization of the target (default %(default)s)")
    p.add_argument("--max-draft-len", dest="max_draft_len", type=int, default=_D.max_draft_len, metavar="N",
                   help="γ: draft tokens per round the target engine verifies at most (default %(default)s)")
    p.add_argument("--max-batch-size", dest="max_batch_size", type=int, default=_D.max_batch_size, metavar="N",
                   help="engine / server batch size (default %(default)s)")
    p.add_argument("--max-seq-len", dest="max_seq_len", type=int, default=_D.max_seq_len, metavar="N",
                   help="prompt + output tokens per request (default %(default)s)")
    p.add_argument("--tp-size", dest="tp_size", type=int, default=_D.tp_size, metavar="N",
                   help="tensor-parallel ranks of the target checkpoint/engine (default %(default)s)")
    p.add_argument("--output", default=_D.output, metavar="build/NAME", help="build directory (default %(default)s)")
    p.add_argument("--calib-samples", dest="calib_samples", type=int, default=_D.calib_samples, metavar="N",
                   help="calibration sequences (default %(default)s)")
    p.add_argument("--calib-seq-len", dest="calib_seq_len", type=int, default=_D.calib_seq_len, metavar="N",
                   help="tokens per calibration sequence (default %(default)s)")
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=_D.eval_tokens, metavar="N",
                   help="held-out tokens for the quality report (default %(default)s)")
    p.add_argument("--policy", default=_D.policy, type=resolve_policy_alias, choices=POLICIES,
                   help="served K policy (default %(default)s; \"seed\" = confidence)")
    p.add_argument("--min-k", dest="min_k", type=int, default=_D.min_k, metavar="N", help="default %(default)s")
    p.add_argument("--max-k", dest="max_k", type=int, default=_D.max_k, metavar="N", help="0 = γ (default %(default)s)")
    p.add_argument("--max-queue", dest="max_queue", type=int, default=_D.max_queue, metavar="N",
                   help="server queue bound (default %(default)s)")
    p.add_argument("--serving", default=_D.serving, choices=SERVING_MODES,
                   help="model repositories to write: reference = model_repo/ (reference runtime), trtllm = "
                        "model_repo_trtllm/ (GPU host: TensorRT-LLM engines behind Triton's in-flight batcher, "
                        "LM/PARD and DSpark drafters), both (default %(default)s; docs/gpu.md)")
    p.add_argument("--cost-table", dest="cost_table", default=_D.cost_table, metavar="JSON",
                   help="survival cost table (spec_decode.scheduler.CostTable JSON) exported into the TensorRT-LLM "
                        ">= 1.4 DSpark config (default: the relative linear model)")
    p.add_argument("--corpus", default=_D.corpus, metavar="auto|none|FILE",
                   help="suffix corpus of the target's own outputs put in the build (auto: the shipped one when the "
                        "target is the embedded default; FILE: scripts/build_corpus.py's .npz; default %(default)s)")
    p.add_argument("--no-engines", dest="build_engines", action="store_false",
                   help="never try TensorRT-LLM; only write engines/build_engines.sh")
    p.add_argument("--no-bench", dest="bench", action="store_false",
                   help="skip the decode-speed measurement of the exported target")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")


def options_from_args(args: argparse.Namespace) -> BuildOptions:
    names = {f.name for f in dataclasses.fields(BuildOptions)}
    return BuildOptions(**{k: v for k, v in vars(args).items() if k in names})


def _summary(m: dict) -> str:
    st = m.get("stages", {})
    lines = [f"build: {m.get('options', {}).get('output')}  ({m.get('total_seconds')} s)"]
    for name, rec in st.items():
        took = "skipped (unchanged)" if rec.get("skipped") else f"{rec.get('seconds')} s"
        lines.append(f"  {name:<10} {took}")
    v = (st.get("verify") or {}).get("outputs", {})
    t = v.get("target") or {}
    if t:
        lines.append(f"  target (exported, reference runtime): greedy agreement {t.get('greedy_agreement')}, ppl "
                     f"{t.get('ppl_quantized')} vs {t.get('ppl_reference')} unquantized, {t.get('decode_tok_per_s')} tok/s")
    r = (st.get("model_repo") or {}).get("outputs", {})
    if r.get("paths"):
        lines.append(f"  model repositories: {', '.join(r['paths'])}")
    if r.get("model_repo_trtllm"):
        lines.append(f"  model_repo_trtllm not written: {r['model_repo_trtllm']}")
    e = (st.get("engines") or {}).get("outputs", {})
    if e and not e.get("built"):
        lines.append(f"  engines NOT built: {e.get('reason')}; see engines/build_engines.sh")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dspark_trt.builder.pipeline import run_build

    opts = options_from_args(args)
    manifest = run_build(opts, quiet=False)
    print(json.dumps(manifest, indent=2, default=str) if args.json else _summary(manifest))
    return 0
