"""The one served configuration: what a build allows a request, as its model repository says it.

Owns `ServeConfig` (frozen): the template keys the builder fills into the `dspark` model's config.pbtxt
parameters (BUILD_DIR, MAX_BATCH_SIZE, GAMMA, POLICY, MIN_K, MAX_K, MAX_SEQ_LEN, MAX_QUEUE), typed, plus the
vocabulary size once the process that holds it knows it (`with_vocab`). The room one request may hold is
spec_decode.limits.request_room (the only formula; `room`, `max_prompt_tokens` derive from it). Read by the Triton
stubs (serve.triton, serve.gpu_host), request validation (serve.validate) and the OpenAI frontend (serve.openai).
Torch-free, no pb_utils.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from dspark_trt.errors import ServeError
from dspark_trt.spec_decode.limits import request_room  # torch-free

__all__ = ["DEFAULT_PREFILL_CHUNK", "PREFILL_CHUNK_ENV", "SUFFIX_RECENT_ENV", "SUFFIX_CORPUS_ENV", "ServeConfig",
           "suffix_recent_tokens", "suffix_corpus_on"]

PREFILL_CHUNK_ENV = "DSPARK_PREFILL_CHUNK"  # chunked prefill for the server's round loop (spec_decode.loop.LoopConfig)
# Served default: prompt tokens per round. Measured through Triton on the default build (2-core AMD EPYC, Zen 5 class,
# avx512 engine; docs/serving.md, "Chunked
# prefill"): against whole prompts, 256 gave 1.17× / 1.49× plain output tok/s at 8 / 32 clients, TTFT p50 2.95 → 0.44 s
# and 8.9 → 1.3 s, ITL p99 877 → 373 ms and 3.4 → 0.57 s (a whole-prompt pass pads every prompt to the longest).
DEFAULT_PREFILL_CHUNK = 256


SUFFIX_RECENT_ENV = "DSPARK_SUFFIX_RECENT_TOKENS"  # tokens of recent outputs the suffix proposer's cross-request index
# keeps (spec_decode.suffix.SuffixIndex); 0 = none: every proposal from the request's own prompt + output


def suffix_recent_tokens(default: int) -> int:
    """DSPARK_SUFFIX_RECENT_TOKENS, else `default`; ServeError if it is not an integer ≥ 0. 0 turns the cross-request
    index off — what a benchmark that repeats its prompts needs to measure new traffic (the index would copy the
    earlier answers)."""
    raw = os.environ.get(SUFFIX_RECENT_ENV, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ServeError(f"{SUFFIX_RECENT_ENV} must be an integer ≥ 0 (tokens of recent outputs the suffix index keeps, "
                         f"0 = off), got {raw!r}; fix the environment")
    return int(raw)


SUFFIX_CORPUS_ENV = "DSPARK_SUFFIX_CORPUS"  # "0": serve without the build's corpus.npz (spec_decode.corpus)


CALIBRATE_ENV = "DSPARK_CALIBRATE"  # "0": price rounds with the startup profile as is (spec_decode.calibrate off)


def _switch(env: str, off: str) -> bool:
    """An on/off environment switch: unset or "1" → True, "0" → False; ServeError on another value."""
    raw = os.environ.get(env, "").strip()
    if raw not in ("", "0", "1"):
        raise ServeError(f"{env} must be 0 ({off}) or 1, got {raw!r}; fix the environment")
    return raw != "0"


def suffix_corpus_on() -> bool:
    """Whether the served suffix proposer loads the build's corpus (DSPARK_SUFFIX_CORPUS unset or "1"; "0": off,
    e.g. to compare); ServeError on another value."""
    return _switch(SUFFIX_CORPUS_ENV, "no corpus")


def calibrate_on() -> bool:
    """Whether the round loop refits its cost table and the drafter's confidences from its own rounds
    (DSPARK_CALIBRATE unset or "1"; "0": the startup profile and the head's c_j as they are, e.g. to compare);
    ServeError on another value."""
    return _switch(CALIBRATE_ENV, "the startup profile as is")


def _prefill_chunk(param: str) -> int:
    """DSPARK_PREFILL_CHUNK, else the optional PREFILL_CHUNK parameter, else DEFAULT_PREFILL_CHUNK (0 = whole prompts);
    ServeError if it is not an integer ≥ 0."""
    raw = os.environ.get(PREFILL_CHUNK_ENV) or param or str(DEFAULT_PREFILL_CHUNK)
    if not raw.strip().isdigit():
        raise ServeError(f"{PREFILL_CHUNK_ENV} / PREFILL_CHUNK must be an integer ≥ 0 (prompt tokens per round, 0 = "
                         f"whole prompts), got {raw!r}; fix the environment or the config.pbtxt parameter")
    return int(raw)


@dataclass(frozen=True)
class ServeConfig:
    """A build's serving limits and defaults (config.pbtxt parameters) and, where known, its vocabulary size."""

    max_seq_len: int  # MAX_SEQ_LEN: KV positions per slot
    max_batch: int  # MAX_BATCH_SIZE: KV slots (requests in flight)
    gamma: int  # GAMMA: the draft block size γ
    vocab_size: int | None = None  # the target's (the OpenAI frontend: its tokenizer's); None: prompt ids unchecked
    policy: str = "survival"  # POLICY: a request's K policy unless it names one
    min_k: int = 2  # MIN_K
    max_k: int = 8  # MAX_K (0 in config.pbtxt = γ)
    max_queue: int = 64  # MAX_QUEUE: above this many waiting + active requests, rounds run without speculation
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # PREFILL_CHUNK (optional; env DSPARK_PREFILL_CHUNK wins): prompt tokens
    # per round, 0 = whole prompts
    build_dir: Path | None = None  # BUILD_DIR: the build the stubs load

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any], vocab_size: int | None = None) -> "ServeConfig":
        """The parameters of a model config (the python backend's args["model_config"] JSON, or a config.pbtxt
        parsed to the same shape); ServeError naming the fix when one is missing or not a number."""
        raw = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        try:
            gamma = int(raw["GAMMA"])
            return cls(max_seq_len=int(raw["MAX_SEQ_LEN"]), max_batch=int(raw["MAX_BATCH_SIZE"]), gamma=gamma,
                       vocab_size=vocab_size, policy=raw["POLICY"], min_k=int(raw["MIN_K"]),
                       max_k=int(raw["MAX_K"]) or gamma, max_queue=int(raw["MAX_QUEUE"]),
                       prefill_chunk=_prefill_chunk(raw.get("PREFILL_CHUNK", "")),
                       build_dir=Path(raw["BUILD_DIR"]))
        except (KeyError, ValueError) as exc:
            raise ServeError(f"config.pbtxt of {model_config.get('name')!r} lacks parameter {exc} or it is not a "
                             "number; rebuild the repository with `dspark-trt build` (templates in "
                             "dspark_trt/model_repo/)") from exc

    def with_vocab(self, vocab_size: int) -> "ServeConfig":
        """This config once the vocabulary size is known (the stub after loading the build)."""
        return replace(self, vocab_size=int(vocab_size))

    @property
    def build(self) -> Path:
        """BUILD_DIR; ServeError where this config did not come from a model repository."""
        if self.build_dir is None:
            raise ServeError("this serving config names no build directory (BUILD_DIR); read it from the model "
                             "repository written by `dspark-trt build`")
        return self.build_dir

    @property
    def room(self) -> int:
        """prompt + max_tokens may not exceed this (spec_decode.limits.request_room)."""
        return request_room(self.max_seq_len, self.gamma)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that still leaves room for one generated token and a γ-block verify."""
        return self.room - 1
