"""`dspark-trt bench`: ours DSpark (every fixed K in 1..γ, the confidence and survival policies, survival with a
useless drafter), the suffix proposer alone and the hybrid (DSpark + suffix, chosen per round; with the useless
drafter too) vs ours plain vs Hugging Face generate, side by side, in one run.

Owns the benchmark protocol: the same prompts and token ids for every engine (default: the held-out prompts
of dspark_trt.train.prompts, never used in training; `--prompt-set` names the packaged sets of
dspark_trt/assets/prompts (code-edit, text, all); or `--prompts FILE`, JSONL of {"prompt", "chat", "kind"}),
greedy (or sampled with `--temperature`, prompt i seeded `--seed` + i for every engine), EOS ignored so every run
decodes the same number of tokens (`--stop-at-eos`: answers end where a request's would); decode tok/s excludes
prompt processing (time of a 1-token run of the same prompt is subtracted); engines are interleaved per prompt and
the median over prompts × repeats is reported; speculative output is checked token for token against ours plain; one
measured cost table (verify by tokens + drafter pass) is shared by every policy. The suffix proposer's
cross-request index of recent outputs is emptied before every run (a repeat would otherwise copy its own earlier
output); its learned confidences carry over, as they do in a server. The report and its plot are written by
commands.bench_report.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.policies import resolve_policy_alias

log = logging.getLogger("dspark_trt.bench")

SPEC_POLICIES = ("fixed", "confidence", "survival")
USELESS = "ours DSpark (survival, useless drafter)"
HF_ROW = "HF generate"  # + its dtype: bf16, or fp32 where bf16 matrix products are slow
SUFFIX = "ours suffix (survival)"
HYBRID = "ours hybrid DSpark+suffix (survival)"
HYBRID_USELESS = "ours hybrid DSpark+suffix (survival, useless drafter)"
PROMPT_SETS = ("held-out", "code-edit", "text", "all")


@dataclass(frozen=True)
class BenchConfig:
    max_new_tokens: int = 96
    repeats: int = 2
    policies: str = ",".join(SPEC_POLICIES)
    fixed_k: str = "all"  # "all" = 1..γ, or a comma list
    dtype: str = "bfloat16"
    threads: int = 0


D = BenchConfig()


@dataclass(frozen=True)
class BenchPrompt:
    kind: str
    text: str
    chat: bool = True


@dataclass
class EngineResult:
    rates: list[float] = field(default_factory=list)
    stats: list[Any] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    mismatches: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=Path, default=None,
                   help='JSONL of {"prompt": str, "chat": bool, "kind": str} (default: the held-out prompts)')
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default="held-out",
                   help="packaged prompts: held-out (code / chat / math), code-edit (answers repeat the prompt), text "
                        "(raw continuations), all (ignored with --prompts)")
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=D.max_new_tokens,
                   help=f"tokens decoded per run (EOS ignored; default {D.max_new_tokens})")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="answers end at EOS as a user's requests do (every engine's greedy answer has plain's length; "
                        "tok/s over each answer's own tokens); default: EOS ignored, every run decodes "
                        "--max-new-tokens, past the answer's end")
    p.add_argument("--repeats", type=int, default=D.repeats, help="interleaved rounds over all prompts (median)")
    p.add_argument("--policies", default=D.policies, help="DSpark K policies to run (comma list)")
    p.add_argument("--fixed-k", default=D.fixed_k, help='K values for the fixed policy: "all" (1..γ) or "2,4"')
    p.add_argument("--no-useless-drafter", action="store_true",
                   help="skip the survival-with-a-useless-drafter rows (the never-slower-than-plain check)")
    p.add_argument("--no-suffix", action="store_true", help="skip the suffix-alone and hybrid DSpark+suffix rows")
    p.add_argument("--corpus", default="auto", metavar="auto|none|FILE",
                   help="the suffix proposer's corpus of the target's own outputs (auto: the shipped one for the "
                        "embedded default target; none: the request's own tokens only)")
    p.add_argument("--target", type=Path, default=None, help="target HF dir (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", type=Path, default=None, help="draft dir (default: the shipped DSpark drafter)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=D.dtype)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (default 0: greedy); prompt i is seeded --seed + i, the same "
                        "for every engine, and the HF row is skipped")
    p.add_argument("--seed", type=int, default=1, help="first prompt's sampling seed (with --temperature)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baseline")
    p.add_argument("--threads", type=int, default=D.threads, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--note", action="append", default=[], help="a line added to the report's notes (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown report (+ .png plot); default docs/benchmarks-<CPU family>[-engine-<e>].md")


def prompt_set(name: str) -> list[BenchPrompt]:
    """A packaged prompt set (PROMPT_SETS; dspark_trt/assets/prompts/README.md)."""
    from importlib import resources

    from dspark_trt.train.prompts import HELD_OUT_PROMPTS

    if name not in PROMPT_SETS:
        raise InvalidArgumentError(f"--prompt-set must be one of {', '.join(PROMPT_SETS)}, got {name!r}")
    held = [BenchPrompt(kind, text, True) for kind, text in HELD_OUT_PROMPTS]
    files = {"code-edit": ["code_edit.jsonl"], "text": ["text.jsonl"], "all": ["code_edit.jsonl", "text.jsonl"]}
    out = held if name in ("held-out", "all") else []
    for f in files.get(name, []):
        with resources.as_file(resources.files("dspark_trt") / "assets" / "prompts" / f) as path:
            out += load_prompts(path)
    return out


def load_prompts(path: Path | None, set_name: str = "held-out") -> list[BenchPrompt]:
    """--prompts JSONL → prompts; None → the packaged set `set_name` (default the held-out prompts: code / chat /
    math, all with the chat template)."""
    if path is None:
        return prompt_set(set_name)
    out: list[BenchPrompt] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read --prompts {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            text = rec["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f'--prompts {path}:{n}: each line must be a JSON object with "prompt" (and '
                                       f'optional "chat": bool, "kind": str); got {line[:80]!r}') from exc
        if not isinstance(text, str) or not text:
            raise InvalidArgumentError(f'--prompts {path}:{n}: "prompt" must be a non-empty string')
        out.append(BenchPrompt(str(rec.get("kind", "text")), text, bool(rec.get("chat", True))))
    if not out:
        raise InvalidArgumentError(f"--prompts {path} holds no prompts")
    return out


def _fixed_ks(spec: str, gamma: int) -> list[int]:
    if spec == "all":
        return list(range(1, gamma + 1))
    try:
        ks = sorted({int(x) for x in spec.split(",") if x})
    except ValueError as exc:
        raise InvalidArgumentError(f'--fixed-k must be "all" or a comma list of integers, got {spec!r}') from exc
    if not ks or ks[0] < 1 or ks[-1] > gamma:
        raise InvalidArgumentError(f"--fixed-k values must lie in 1..γ = 1..{gamma}, got {spec!r}")
    return ks


def useless_drafter(draft_dir: Path, target: Any, dtype: Any, target_dir: Path) -> Any:
    """The drafter at draft_dir with its trained weights replaced by seeded noise: it proposes nonsense with
    confidence; the never-lose check (survival must stay ≥ 0.97× plain with it)."""
    import torch

    from dspark_trt.runtime.drafters import load_drafter

    drafter = load_drafter(draft_dir, target, dtype=dtype, target_dir=target_dir)
    g = torch.Generator().manual_seed(1234)
    module = getattr(drafter, "model", drafter)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return drafter


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_trt.commands.bench_report import write_report
    from dspark_trt.engine import SpeculativeDecodingEngine, build_backend, to_runtime_model
    from dspark_trt.runtime.drafters import default_drafter_dir, load_drafter
    from dspark_trt.runtime.hf_loader import load_tokenizer
    from dspark_trt.runtime.profile import profile_costs
    from dspark_trt.spec_decode.protocols import SamplingParams
    from dspark_trt.spec_decode.sampling import check_sampling
    from dspark_trt.spec_decode.scheduler import POLICIES

    policies = [resolve_policy_alias(p) for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES or p == "plain"]
    if bad or args.max_new_tokens < 2 or args.repeats < 1:
        raise InvalidArgumentError(f"--policies must be from {SPEC_POLICIES} (got {bad}); --max-new-tokens ≥ 2; "
                                   f"--repeats ≥ 1")
    prompts = load_prompts(args.prompts, getattr(args, "prompt_set", "held-out"))
    if getattr(args, "max_prompts", 0) > 0:
        prompts = prompts[:args.max_prompts]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.target is None:
        from dspark_trt.runtime.default_model import default_target_dir

        target_dir = default_target_dir()
    else:
        target_dir = args.target
    draft_dir = Path(args.draft) if args.draft is not None else default_drafter_dir()
    tok = load_tokenizer(target_dir)
    target = to_runtime_model(target_dir, dtype)
    drafter = load_drafter(draft_dir, target, dtype=dtype, target_dir=Path(target_dir))
    gamma = int(drafter.gamma)
    ks = _fixed_ks(args.fixed_k, gamma) if "fixed" in policies else []
    chat = getattr(tok, "chat_template", None)
    ids = [[int(t) for t in tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}],
                                                               add_generation_prompt=True, tokenize=False)
                                       if p.chat and chat else p.text)] for p in prompts]
    max_len = max(len(i) for i in ids) + args.max_new_tokens + 2
    check_sampling(args.temperature, 1.0, args.seed, names={"temperature": "--temperature", "seed": "--seed"})
    sampled = args.temperature > 0
    table = profile_costs(build_backend(target, drafter, 2, max_len + gamma + 2), gamma + 1, reps=5)
    engines: dict[str, Any] = {"ours plain": SpeculativeDecodingEngine(target, None, tok, max_len, gamma,
                                                                       policy="plain")}
    for pol in policies:
        for k in (ks if pol == "fixed" else [0]):
            eng = SpeculativeDecodingEngine(target, drafter, tok, max_len, gamma, policy=pol, cost_table=table,
                                            proposers="dspark")
            if pol == "fixed":
                eng.with_policy(k=k)
            engines[f"ours DSpark (fixed K={k})" if pol == "fixed" else f"ours DSpark ({pol})"] = eng
    suffix = not getattr(args, "no_suffix", False)
    if suffix:
        corpus = getattr(args, "corpus", "auto")
        engines[SUFFIX] = SpeculativeDecodingEngine(target, None, tok, max_len, gamma, policy="survival",
                                                    cost_table=table, proposers="suffix", corpus=corpus)
        engines[HYBRID] = SpeculativeDecodingEngine(target, drafter, tok, max_len, gamma, policy="survival",
                                                    cost_table=table, proposers="dspark,suffix", corpus=corpus)
    if not args.no_useless_drafter:
        junk = useless_drafter(draft_dir, target, dtype, Path(target_dir))
        engines[USELESS] = SpeculativeDecodingEngine(target, junk, tok, max_len, gamma, policy="survival",
                                                     cost_table=table, proposers="dspark")
        if suffix:
            engines[HYBRID_USELESS] = SpeculativeDecodingEngine(target, junk, tok, max_len, gamma,
                                                                policy="survival", cost_table=table,
                                                                proposers="dspark,suffix", corpus=corpus)
    hf, hf_row = None, ""
    if not args.no_hf and not sampled:
        from transformers import AutoModelForCausalLM

        from dspark_trt.runtime.ops import bf16_matmul_fast

        hf_dtype = torch.bfloat16 if bf16_matmul_fast() else torch.float32  # no fast bf16 GEMM here: HF in fp32
        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=hf_dtype).eval()
        hf_row = f"{HF_ROW} ({'bf16' if hf_dtype == torch.bfloat16 else 'fp32: bf16 products are slow on this CPU'})"
    n = args.max_new_tokens
    own_eos = {name: eng.eos_ids for name, eng in engines.items()}  # the target's EOS ids (--stop-at-eos)
    results: dict[str, EngineResult] = {name: EngineResult() for name in engines}
    if hf is not None:
        results[hf_row] = EngineResult()
    for rep in range(args.repeats):
        for pi, prompt in enumerate(ids):
            log.info("round %d/%d, prompt %d/%d (%s, %d tokens)", rep + 1, args.repeats, pi + 1, len(ids),
                     prompts[pi].kind, len(prompt))
            # The engines run in an order rotated by one per prompt: on this kind of VM a run's speed depends on
            # what ran just before it (±10% measured), so no engine always follows the drafting ones.
            names = list(engines)
            shift = (pi + rep * len(ids)) % len(names)
            tokens: dict[str, list[int]] = {}
            sp = SamplingParams(temperature=args.temperature, seed=args.seed + pi) if sampled else SamplingParams()
            for name in names[shift:] + names[:shift]:
                eng = engines[name]
                eng.eos_ids = own_eos[name] if args.stop_at_eos else ()  # () = EOS ignored: exactly n tokens a run
                eng.suffix.forget_outputs()  # no run copies an earlier run's output of the same prompt
                ttft, _ = _timed(lambda: eng.run(prompt, 1, sp))
                wall, res = _timed(lambda: eng.run(prompt, n, sp))
                r = results[name]
                if len(res.tokens) > 1:  # a 1-token answer has no decode time to measure
                    r.rates.append((len(res.tokens) - 1) / max(wall - ttft, 1e-9))
                r.stats.append(res.stats)
                r.kinds.append(prompts[pi].kind)
                tokens[name] = res.tokens
            for name in names:
                if name != "ours plain" and tokens[name] != tokens["ours plain"]:
                    results[name].mismatches += 1
            if hf is not None:
                x = torch.tensor([prompt])
                eos = (list(own_eos["ours plain"]) or None) if args.stop_at_eos else None
                kw = dict(do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id or 0)
                with torch.no_grad():
                    ttft, _ = _timed(lambda: hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw))
                    wall, out = _timed(lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=1 if eos else n, **kw))
                m = out.shape[1] - x.shape[1]  # new tokens (EOS included)
                if m > 1:
                    results[hf_row].rates.append((m - 1) / max(wall - ttft, 1e-9))
    if args.out is None:
        from dspark_trt.runtime import native

        args.out = Path("docs") / f"benchmarks-{native.report_suffix()}.md"
    report = write_report(args, results, gamma, len(ids), draft_dir, table)
    log.info("report written to %s\n%s", args.out, report)
    return 0
