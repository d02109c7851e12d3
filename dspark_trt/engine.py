"""`SpeculativeDecodingEngine`: the Python API over the reference runtime and spec_decode.loop.

Owns argument validation (InvalidArgumentError naming the argument and its valid range; sampling settings are
checked by spec_decode.sampling, the vocabulary by runtime.drafters.vocab — the project's one rule for each),
turning what the user passes (Hugging Face model objects, checkpoint directories, runtime CausalLM / Drafter
objects) into a runtime backend, mapping the constructor's knobs (draft_length, use_confidence_scheduling,
confidence_threshold) onto spec policies, and the `.stats` dict (timing by spec_decode.stats.TimedBackend).
The algorithm lives in dspark_trt.spec_decode; model execution in dspark_trt.runtime (imported lazily).

    engine = SpeculativeDecodingEngine(target_model=target, draft_model=draft, tokenizer=tok, max_length=512,
                                       draft_length=5, temperature=0.8, top_p=0.95)
    out = engine.generate(input_ids=ids, max_new_tokens=256, do_sample=True)  # [1, prompt + new]
    engine.stats  # total_tokens, target_calls, draft_calls, accepted_tokens, drafted_tokens, speedup, ...
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from dspark_trt.errors import InvalidArgumentError
from dspark_trt.spec_decode.calibrate import Calibration
from dspark_trt.spec_decode.loop import GenerateResult, LoopConfig
from dspark_trt.spec_decode.loop import generate as loop_generate
from dspark_trt.spec_decode.sampling import SamplingParams
from dspark_trt.spec_decode.policies import POLICIES, default_proposers, parse_proposers, resolve_policy_alias
from dspark_trt.spec_decode.suffix import SuffixProposer
from dspark_trt.spec_decode.scheduler import CostTable, GateMemory, PolicyConfig
from dspark_trt.spec_decode.stats import TimedBackend

log = logging.getLogger(__name__)

__all__ = ["SpeculativeDecodingEngine", "build_backend", "to_runtime_model"]

def _bad(name: str, value: object, valid: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name}={value!r} is invalid: {name} must be {valid}")


def _prompt_ids(value: Any, name: str) -> tuple[list[int], torch.device]:
    """One prompt as the caller passes it → (its ids, the device its tensor is on, else the CPU): a [n] or [1, n]
    integer tensor / array, a sequence of ints, or a tokenizer's output (a mapping holding "input_ids", e.g.
    transformers' BatchEncoding from `tokenizer(text)` or `apply_chat_template(..., return_dict=True)`). Anything
    else: InvalidArgumentError naming what to pass."""
    if hasattr(value, "keys") and "input_ids" in value.keys():
        value = value["input_ids"]
    device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    fix = ("pass token ids: a [1, n] integer tensor or a list of ints, e.g. tokenizer(text)['input_ids'] or "
           "tokenizer.apply_chat_template(messages, add_generation_prompt=True)")
    if isinstance(value, (str, bytes)):
        raise InvalidArgumentError(f"{name} is text ({value[:40]!r}); {fix}")
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidArgumentError(f"{name} of type {type(value).__name__} is not token ids ({e}); {fix}") from None
    if ids.numel() and (ids.dtype.is_floating_point or ids.is_complex() or ids.dtype == torch.bool):
        raise InvalidArgumentError(f"{name} holds {ids.dtype} values, not token ids; {fix}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise _bad(name, tuple(ids.shape), "a non-empty [1, n] tensor or list of ids (one sequence; batch with "
                                           "dspark_trt.spec_decode.loop.RoundScheduler)")
    return [int(t) for t in ids.tolist()], device


def _is_hf_model(m: object) -> bool:
    return hasattr(m, "state_dict") and hasattr(m, "config") and hasattr(m.config, "to_dict")


def to_runtime_model(model: Any, dtype: torch.dtype | None = None) -> Any:
    """A runtime CausalLM from a checkpoint path, an in-memory HF causal LM, or a CausalLM (returned as is)."""
    from dspark_trt.runtime.config import ModelConfig
    from dspark_trt.runtime.hf_loader import hf_to_trtllm_names, load_hf_checkpoint
    from dspark_trt.runtime.model import CausalLM

    if isinstance(model, CausalLM):
        return model
    if isinstance(model, (str, Path)):
        return load_hf_checkpoint(model, dtype=dtype or torch.bfloat16)
    if _is_hf_model(model):
        gen = getattr(model, "generation_config", None)
        gen_d = gen.to_dict() if gen is not None and hasattr(gen, "to_dict") else None
        cfg = ModelConfig.from_hf(model.config.to_dict(), gen_d)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        dt = dtype or next(iter(state.values())).dtype
        rt = CausalLM(cfg, dtype=dt)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        rt.load_trtllm_state_dict(hf_to_trtllm_names(state, cfg, type(model).__name__),
                                  source=f"in-memory {type(model).__name__}")
        return rt.eval()
    raise InvalidArgumentError(f"target_model/draft_model must be a Hugging Face causal LM, a checkpoint directory "
                               f"or a dspark_trt runtime model; got {type(model).__name__}")


def _eos_set(cfg: Any) -> set[int]:
    ids = getattr(cfg, "eos_token_ids", None) or getattr(cfg, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple, set)) else [ids])}


def _to_drafter(draft: Any, target: Any, gamma: int, dtype: torch.dtype | None, target_dir: Path | None) -> Any:
    """A spec_decode.protocols.Drafter from a path / HF model / runtime model / Drafter."""
    from dspark_trt.runtime.drafters import LMDrafter, load_drafter
    from dspark_trt.runtime.drafters.vocab import VocabInfo, check_same_vocabulary

    if hasattr(draft, "propose") and hasattr(draft, "extend_context"):
        return draft
    if isinstance(draft, (str, Path)):
        return load_drafter(Path(draft), target, dtype=dtype or target.dtype, target_dir=target_dir, gamma=gamma)
    target_vocab = VocabInfo.from_config(target.config)
    if _is_hf_model(draft):  # before converting: a mismatched HF model may not even convert
        check_same_vocabulary(VocabInfo.from_config(draft.config), target_vocab)
    rt = to_runtime_model(draft, dtype or target.dtype)
    check_same_vocabulary(VocabInfo.from_config(rt.config), target_vocab)
    return LMDrafter(rt, gamma=gamma)


def build_backend(target: Any, drafter: Any | None, max_batch: int, max_seq: int) -> Any:
    """The runtime's spec_decode.protocols.Backend (dspark_trt.runtime.backend.SpecBackend)."""
    from dspark_trt.runtime.backend import SpecBackend

    return SpecBackend(target, drafter, max_batch=max_batch, max_seq=max_seq)


class SpeculativeDecodingEngine:
    """DSpark speculative decoding for one request at a time (the deployment guide's API); lossless w.r.t. the target.

    Args (validated; InvalidArgumentError names the argument and its range):
      target_model: HF causal LM object, HF checkpoint directory, or runtime CausalLM (Llama family).
      draft_model: HF causal LM / directory (autoregressive LM drafter, or a DSpark / PARD drafter directory) or
        a runtime Drafter; None → plain decoding.
      tokenizer: HF tokenizer (optional; read from the target directory when that is a path). Gives eos ids.
      max_length: most tokens per sequence, prompt included (≥ 2).
      draft_length: γ, the draft block size and the largest K (1..64).
      temperature (≥ 0; 0 = greedy), top_p ((0, 1]): the sampling settings used by BOTH drafter and target.
      use_confidence_scheduling: True → the survival K policy (the drafter's calibrated confidence against the
        profiled verify and drafter costs; never slower than plain by more than a probe round now and then);
        False → fixed K = γ. policy="confidence" (alias "seed") selects the deployment guide's confidence formula.
      confidence_threshold: draft-side early stop in [0, 1): cut the block where the drafter's cumulative
        confidence Π c_i drops below it (needs a drafter with a confidence head; ignored otherwise). None = off.
      policy: override the K policy ("plain", "fixed", "confidence" (alias "seed"), "survival"); dtype: runtime
        dtype; seed: RNG seed for sampling (None = random per call); cost_table: survival policy's cost table.
      proposers: who proposes drafts, "dspark" (the drafter's block), "suffix" (a match of the last tokens in the
        request's own tokens or this engine's recent outputs: spec_decode.suffix; needs no drafter) or both
        ("dspark,suffix": chosen per round by expected committed tokens against the cost, spec_decode.proposers);
        None: spec_decode.policies.default_proposers (both; the suffix match alone when sampling with a
        seed, which then commits plain sampling's tokens for that seed, token for token).
      corpus: the suffix proposer's static corpus of the target's own outputs (spec_decode.corpus): "auto" (the
        shipped corpus when the target is the embedded default, else none), None, a corpus file, or a CorpusIndex.
      calibrate: refit the cost table from this engine's timed rounds and rescale the drafter's confidences by
        what was accepted (spec_decode.calibrate; the profiled or given table prices the first 16 rounds); False:
        the table and the confidences as they are (reproducible K choices).
    """

    def __init__(self, target_model: Any, draft_model: Any | None = None, tokenizer: Any | None = None,
                 max_length: int = 512, draft_length: int = 5, temperature: float = 0.0, top_p: float = 1.0,
                 use_confidence_scheduling: bool = True, confidence_threshold: float | None = None,
                 policy: str | None = None, dtype: torch.dtype | None = None, seed: int | None = None,
                 cost_table: CostTable | None = None, min_k: int | None = None, max_k: int | None = None,
                 proposers: str | Sequence[str] | None = None, corpus: Any = "auto", calibrate: bool = True) -> None:
        if not isinstance(max_length, int) or max_length < 2:
            raise _bad("max_length", max_length, "an integer ≥ 2 (prompt + generated tokens)")
        if not isinstance(draft_length, int) or not 1 <= draft_length <= 64:
            raise _bad("draft_length", draft_length, "an integer in [1, 64]")
        SamplingParams(temperature, top_p, seed)  # validates (InvalidArgumentError naming the bad value)
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise _bad("confidence_threshold", confidence_threshold, "None or a number in [0, 1)")
        if policy is not None:
            policy = resolve_policy_alias(policy)
            if policy not in POLICIES:
                raise _bad("policy", policy, f"one of {', '.join(POLICIES)} (\"seed\" = \"confidence\")")
        self.max_length, self.draft_length = max_length, draft_length
        self.temperature, self.top_p, self.seed = float(temperature), float(top_p), seed
        target_dir = Path(target_model) if isinstance(target_model, (str, Path)) else None
        self.target = to_runtime_model(target_model, dtype)
        if tokenizer is None and target_dir is not None:
            from dspark_trt.runtime.hf_loader import load_tokenizer

            tokenizer = load_tokenizer(target_dir)
        self.tokenizer = tokenizer
        self.drafter = None if draft_model is None else _to_drafter(draft_model, self.target, draft_length, dtype,
                                                                    target_dir)
        own_gamma = getattr(self.drafter, "gamma", None)
        if own_gamma is not None and int(own_gamma) < draft_length:
            log.warning("draft_length=%d exceeds the drafter's block size %d; using %d", draft_length, own_gamma,
                        own_gamma)
            draft_length = self.draft_length = int(own_gamma)
            if max_k is not None:
                max_k = min(max_k, draft_length)
            if min_k is not None:
                min_k = min(min_k, draft_length)
        if proposers is None:
            proposers = default_proposers(temperature, seed)
        self.proposers = parse_proposers(proposers if isinstance(proposers, str) else tuple(proposers))
        needs_drafter = "dspark" in self.proposers
        name = policy or ("plain" if self.drafter is None and needs_drafter
                          else "survival" if use_confidence_scheduling else "fixed")
        if name != "plain" and self.drafter is None and needs_drafter:
            raise InvalidArgumentError(f"policy {name!r} with the dspark proposer needs a draft_model; pass one, use "
                                       f"proposers='suffix' or policy='plain'")
        lo = min(2, draft_length) if min_k is None else min_k
        self.policy = PolicyConfig(policy=name, k=draft_length, min_k=lo, max_k=draft_length if max_k is None else max_k,
                                   draft_stop=confidence_threshold or 0.0, proposers=self.proposers)
        backend = build_backend(self.target, self.drafter, 1, max_length + draft_length + 2)
        if cost_table is None and name == "survival":  # the survival policy weighs measured, not guessed, costs
            from dspark_trt.runtime.profile import profile_costs

            cost_table = profile_costs(backend, draft_length + 1, reps=3)
        self.loop_config = LoopConfig(gamma=draft_length, cost_table=cost_table or CostTable.linear(),
                                      calibrate=calibrate)
        self.gate = GateMemory()  # the survival gate carries across this engine's requests
        self.calibration = Calibration(self.loop_config.cost_table) if calibrate else None  # what they measured
        from dspark_trt.runtime.default_model import corpus_for

        self.corpus = corpus_for(corpus, self.target.embed_tokens.weight, int(self.target.config.vocab_size)) \
            if "suffix" in self.proposers else None
        # the suffix proposer's recent outputs and learned confidences carry across requests too
        self.suffix = SuffixProposer(corpus=self.corpus)
        self._backend = TimedBackend(backend)
        self.eos_ids = tuple(sorted(_eos_set(self.target.config)
                                    | ({int(tokenizer.eos_token_id)} if getattr(tokenizer, "eos_token_id", None)
                                       is not None else set())))
        self.last_result: GenerateResult | None = None
        self._stats: dict[str, Any] = {}

    @property
    def device(self) -> torch.device:
        return self.target.embed_tokens.weight.device

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
            policy: PolicyConfig | None = None, stop_sequences: Sequence[Sequence[int]] = ()) -> GenerateResult:
        """One request through spec_decode.loop → GenerateResult (tokens, finish_reason, SpecStats); updates .stats.
        prompt_ids: what `generate` takes (ids, a [1, n] tensor or a tokenizer's output)."""
        prompt_ids, _ = _prompt_ids(prompt_ids, "prompt_ids")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise _bad("max_new_tokens", max_new_tokens, "an integer ≥ 1")
        room = self.max_length - len(prompt_ids)
        if room < 1:
            raise InvalidArgumentError(f"the prompt has {len(prompt_ids)} tokens but max_length={self.max_length}; "
                                       f"raise max_length above the prompt length or shorten the prompt")
        sp = sampling or SamplingParams(self.temperature, self.top_p, self.seed)
        b = self._backend
        b.reset()
        start = time.perf_counter()
        res = loop_generate(b, prompt_ids, min(max_new_tokens, room), sp, policy or self.policy, self.eos_ids,
                            stop_sequences, self.loop_config, self.gate, self.suffix,
                            self.calibration)
        wall = time.perf_counter() - start
        self.last_result = res
        self._stats = self._summarise(res, wall, b.seconds["verify"], b.calls["verify"], b.seconds["draft"],
                                      b.calls["draft"])
        return res

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int = 128,
                 do_sample: bool | None = None, **kw: Any) -> torch.Tensor:
        """input_ids [1, n] (or a list of ids, or a tokenizer's output) → token ids [1, n + new] (prompt included,
        like HF generate).
        do_sample=False forces greedy; True samples at the engine's temperature/top_p (temperature 0 → 1.0);
        None samples iff temperature > 0. Extra kwargs: temperature, top_p, seed override the engine's."""
        prompt, device = _prompt_ids(input_ids, "input_ids")
        unknown = set(kw) - {"temperature", "top_p", "seed"}
        if unknown:
            raise InvalidArgumentError(f"unknown generate() arguments {sorted(unknown)}; valid: input_ids, "
                                       f"max_new_tokens, do_sample, temperature, top_p, seed")
        temp, top_p = kw.get("temperature", self.temperature), kw.get("top_p", self.top_p)
        SamplingParams(temp, top_p, kw.get("seed", self.seed))  # validates the overrides as given
        temp, top_p = float(temp), float(top_p)
        sample = temp > 0 if do_sample is None else bool(do_sample)
        sp = SamplingParams(temperature=(temp or 1.0) if sample else 0.0, top_p=top_p if sample else 1.0,
                            seed=kw.get("seed", self.seed))
        res = self.run(prompt, max_new_tokens, sp)
        return torch.tensor([prompt + res.tokens], dtype=torch.long, device=device)

    def _summarise(self, res: GenerateResult, wall: float, target_s: float, verify_n: int, draft_s: float,
                   draft_n: int) -> dict[str, Any]:
        s = res.stats
        rounds = max(s.verify_calls, 1)
        t_target = target_s / verify_n if verify_n else 0.0  # mean verify forward
        t_draft = draft_s / rounds  # drafter time per round
        speedup = (s.committed_tokens - s.prefill_calls) / rounds * t_target / (t_target + t_draft) \
            if t_target > 0 else 1.0
        return {
            "total_tokens": s.committed_tokens, "target_calls": s.target_calls, "draft_calls": s.draft_calls,
            "accepted_tokens": s.accepted_tokens, "drafted_tokens": s.drafted_tokens,
            "acceptance_rate": round(s.acceptance_rate, 4), "tau": round(s.tau, 4),
            "speedup": round(speedup, 3), "draft_failures": s.draft_failures,
            "first_token_rejection_rate": round(s.first_token_rejection_rate, 4),
            "acceptance_per_position": [round(x, 4) for x in s.acceptance_per_position()],
            "wall_s": round(wall, 4), "tokens_per_s": round(s.committed_tokens / wall, 2) if wall > 0 else 0.0,
            "finish_reason": res.finish_reason,
            "proposers": {name: ps.summary() for name, ps in sorted(s.by_proposer.items())},
            # what this engine's rounds taught its cost table and the drafter's c_j (spec_decode.calibrate)
            "calibration": {k: round(v, 4) for k, v in self.calibration.summary().items()} if self.calibration
            else None,
        }

    @property
    def stats(self) -> dict[str, Any]:
        """Stats of the LAST generate()/run() call.

        total_tokens: generated tokens; target_calls: target forwards (prefill + one verify per round);
        draft_calls: drafter passes; drafted_tokens: draft tokens the target verified (Σ K); accepted_tokens: of
        those, accepted; tau: total_tokens / target_calls.
        speedup (an estimate, not a measurement against a baseline run): τ_r · T_v / (T_v + T_d), where
        τ_r = tokens committed per verify round, T_v = measured mean wall time of a verify forward and
        T_d = measured drafter wall time per round. It assumes a plain decoding step costs as much as a verify
        forward (true when decoding is memory-bound; optimistic on CPU, where verifying K+1 tokens costs more).
        For a measured speed-up run `dspark-trt bench`.
        calibration: spec_decode.calibrate.Calibration.summary() over this engine's rounds so far (rounds folded,
        scale, the target / drafter / verify-token prices relative to the profile, the c_j factors r1..r3)."""
        return dict(self._stats)

    def with_policy(self, **changes: Any) -> "SpeculativeDecodingEngine":
        """Change policy fields in place (e.g. with_policy(policy="survival")); returns self."""
        self.policy = replace(self.policy, **changes)
        return self
