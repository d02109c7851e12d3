"""`dspark-trt generate`: one prompt through DSpark speculative decoding, in process, from a build, or via Triton.

Owns the command's arguments (defaults from the frozen spec dataclasses), picking the models (the embedded
default pair when none is named; --target/--draft HF directories; --build-dir a finished build through
builder.artifacts.load_built_pair; --url a running server through serve.clients.client.generate_remote) and the output:
the text (or, with --json, ONE JSON object {"text", "token_ids", "stats"}) on stdout, everything else on stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.loop import LoopConfig
from dspark_trt.spec_decode.policies import default_proposers, parse_proposers, resolve_policy_alias
from dspark_trt.spec_decode.sampling import SamplingParams, check_sampling
from dspark_trt.spec_decode.scheduler import POLICIES, PolicyConfig

log = logging.getLogger("dspark_trt.generate")

_POL = PolicyConfig()
_SAMPLING = SamplingParams()
_LOOP = LoopConfig()
DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--policy", type=resolve_policy_alias, choices=POLICIES, default=_POL.policy,
                   help=f"K policy (default {_POL.policy}; \"seed\" = confidence)")
    p.add_argument("--corpus", default=None, metavar="auto|none|FILE",
                   help="the suffix proposer's corpus of the target's own outputs (in process; default: the build's "
                        "corpus.npz with --build-dir, else auto = the shipped one for the embedded default target)")
    p.add_argument("--proposers", type=parse_proposers, default=None,
                   help="who proposes drafts: dspark (the drafter's block), suffix (a match of the last "
                        "tokens in the prompt + output: needs no drafter) or dspark,suffix (chosen per round by "
                        "expected tokens against the cost; the default, but suffix alone when sampling with --seed: it "
                        "then commits what plain sampling with that seed commits); with --url it is the "
                        "request's `proposers` field (default: the server's)")
    p.add_argument("--k", type=int, default=_POL.k, help=f"verify length for --policy fixed (default {_POL.k})")
    p.add_argument("--gamma", type=int, default=None,
                   help=f"draft block size γ (default: the drafter's own, else {_LOOP.gamma})")
    p.add_argument("--min-k", type=int, default=_POL.min_k, help=f"confidence policy lower K (default {_POL.min_k})")
    p.add_argument("--max-k", type=int, default=None, help="confidence/survival upper K (default γ)")
    p.add_argument("--draft-stop", type=float, default=_POL.draft_stop,
                   help="draft-side early stop: cut where cumulative draft confidence < this (0 = off)")
    p.add_argument("--temperature", type=float, default=_SAMPLING.temperature, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=_SAMPLING.top_p, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, stats}")
    p.add_argument("--target", type=Path, default=None, help="target HF checkpoint dir (default: embedded SmolLM2)")
    p.add_argument("--draft", type=Path, default=None,
                   help="draft checkpoint dir (DSpark, PARD or LM; default: the shipped DSpark drafter)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="runtime dtype (default bfloat16)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch's default; 1 is fastest on a busy 2-core host)")
    p.add_argument("--build-dir", type=Path, default=None, help="a finished `dspark-trt build` directory")
    p.add_argument("--engine-dir", type=Path, default=None, help="deprecated spelling of --build-dir")
    p.add_argument("--url", default=None, help="HOST:PORT of a running `dspark-trt serve` (Triton)")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http", help="with --url (default http)")
    p.add_argument("--stream", action="store_true", help="with --url: stream text to stderr as it arrives")


def _check(args: argparse.Namespace) -> None:
    if args.engine_dir is not None:
        log.warning("--engine-dir is deprecated; use --build-dir (it names the whole build directory)")
        if args.build_dir is not None and args.build_dir != args.engine_dir:
            raise InvalidArgumentError("--engine-dir and --build-dir name different builds: pass only --build-dir")
        args.build_dir = args.engine_dir
    if args.max_new_tokens < 1:
        raise InvalidArgumentError(f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}")
    if args.gamma is not None and not 1 <= args.gamma <= 64:
        raise InvalidArgumentError(f"--gamma must be in [1, 64], got {args.gamma}")
    check_sampling(args.temperature, args.top_p, args.seed,
                   names={"temperature": "--temperature", "top_p": "--top-p", "seed": "--seed"})
    if args.url and (args.build_dir or args.target or args.draft):
        raise InvalidArgumentError("--url talks to a running server: drop --build-dir/--target/--draft")
    if args.build_dir and (args.target or args.draft):
        raise InvalidArgumentError("--build-dir brings its own models: drop --target/--draft")
    if args.stream and not args.url:
        raise InvalidArgumentError("--stream needs --url (in-process generation prints the whole result)")
    if args.proposers is None and not args.url:
        args.proposers = default_proposers(args.temperature, args.seed)


def _remote(args: argparse.Namespace) -> dict[str, Any]:
    from dspark_trt.serve.clients.client import generate_remote

    def on_text(piece: str) -> None:
        sys.stderr.write(piece)
        sys.stderr.flush()

    # The server's fixed policy verifies K = max_k tokens per round.
    min_k, max_k = args.min_k, args.max_k
    if args.policy == "fixed":
        min_k, max_k = min(args.min_k, args.k), args.k
    return generate_remote(args.url, args.prompt, max_tokens=args.max_new_tokens, protocol=args.protocol,
                           stream=args.stream, policy=args.policy, min_k=min_k, max_k=max_k,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                           apply_chat_template=args.chat or None, on_text=on_text if args.stream else None,
                           proposers=None if args.proposers is None else ",".join(args.proposers))


def _models(args: argparse.Namespace) -> tuple[Any, Any, Any, int | None]:
    """(target, draft or None, tokenizer, drafter γ or None) for in-process generation."""
    if args.build_dir:
        from dspark_trt.builder.artifacts import load_built_pair

        pair = load_built_pair(args.build_dir)
        return pair.target, pair.drafter, pair.tokenizer, int(pair.options.max_draft_len)
    from dspark_trt.runtime.hf_loader import load_tokenizer

    target_dir = args.target
    if target_dir is None:
        from dspark_trt.runtime.default_model import default_target_dir

        target_dir = default_target_dir()
    draft_dir = args.draft
    if "dspark" not in args.proposers:
        return target_dir, None, load_tokenizer(target_dir), None  # the suffix proposer needs no drafter
    if draft_dir is None and args.target is None and args.policy != "plain":
        from dspark_trt.errors import DrafterError
        from dspark_trt.runtime.drafters import default_drafter_dir

        try:
            draft_dir = default_drafter_dir()
        except DrafterError as exc:  # documented fallback: plain decoding on the default target
            log.warning("%s -- falling back to plain decoding (--policy plain)", exc)
            args.policy = "plain"
    if draft_dir is None and args.policy != "plain":
        raise InvalidArgumentError(f"--policy {args.policy} needs a drafter: pass --draft DIR (or --policy plain)")
    return target_dir, draft_dir, load_tokenizer(target_dir), None


def _build_corpus(args: argparse.Namespace) -> str | None:
    """The suffix corpus a build carries (BUILD_DIR/corpus.npz, `dspark-trt build --corpus`), or None."""
    if args.build_dir:
        from pathlib import Path

        path = Path(args.build_dir) / "corpus.npz"
        return str(path) if path.is_file() else None
    return None


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.url:
        out = _remote(args)
        if args.stream:
            sys.stderr.write("\n")
        print(json.dumps(out) if args.json else out.get("text", ""))
        return 0
    import torch

    from dspark_trt.engine import SpeculativeDecodingEngine

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    target, draft, tok, built_gamma = _models(args)
    ids = _encode(tok, args.prompt, args.chat)
    gamma = args.gamma or built_gamma or _drafter_gamma(draft) or _LOOP.gamma
    engine = SpeculativeDecodingEngine(
        target_model=target, draft_model=draft if args.policy != "plain" else None, tokenizer=tok,
        max_length=len(ids) + args.max_new_tokens + 1, draft_length=gamma, temperature=args.temperature,
        top_p=args.top_p, policy=args.policy, dtype=getattr(torch, args.dtype), seed=args.seed,
        confidence_threshold=args.draft_stop or None, min_k=min(args.min_k, gamma),
        max_k=args.max_k if args.max_k is not None else gamma, proposers=args.proposers,
        corpus=getattr(args, "corpus", None) or _build_corpus(args) or "auto")
    if args.policy == "fixed":
        engine.with_policy(k=min(args.k, gamma))
    sp = SamplingParams(args.temperature, args.top_p if args.temperature > 0 else 1.0, args.seed)
    res = engine.run(ids, args.max_new_tokens, sp)
    text = tok.decode(res.tokens, skip_special_tokens=True)
    if args.json:
        stats = res.stats.summary()
        stats["speedup_estimate"] = engine.stats["speedup"]
        stats["tokens_per_s"] = engine.stats["tokens_per_s"]
        stats["calibration"] = engine.stats["calibration"]  # what the rounds taught the cost table (one request)
        from dspark_trt.runtime import native

        stats["kernel_engine"] = native.engine()
        stats["suffix_corpus_positions"] = engine.corpus.size if engine.corpus is not None else 0
        print(json.dumps({"text": text, "token_ids": res.tokens, "finish_reason": res.finish_reason, "stats": stats}))
    else:
        print(text)
        s = engine.stats
        log.info("%d tokens, %d target calls, τ=%.2f, accepted %d/%d drafted, %.1f tok/s (%s policy, γ=%d)",
                 s["total_tokens"], s["target_calls"], s["tau"], s["accepted_tokens"], s["drafted_tokens"],
                 s["tokens_per_s"], args.policy, gamma)
    return 0


def _drafter_gamma(draft: Any) -> int | None:
    """γ recorded in a draft checkpoint dir (block_size / pard_gamma), if any."""
    if draft is None:
        return None
    if hasattr(draft, "gamma"):
        return int(draft.gamma)
    cfg = Path(draft) / "config.json"
    if cfg.is_file():
        raw = json.loads(cfg.read_text())
        g = raw.get("block_size") or raw.get("pard_gamma")
        return int(g) if g else None
    return None


def _encode(tok: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tok, "chat_template", None):
            raise InvalidArgumentError("--chat needs a tokenizer with a chat template; drop --chat for raw prompts")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    ids = tok.encode(prompt, add_special_tokens=True)
    if not ids:
        raise InvalidArgumentError("--prompt encodes to zero tokens; pass a non-empty prompt")
    return [int(t) for t in ids]

