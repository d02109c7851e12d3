"""What the `dspark` stubs load from a build directory: the tokenizer, the speculative backend and the batcher.

Owns `load_tokenizer_for` (BUILD_DIR/tokenizer), `LoadedBackend` + `load_backend` (the builder's load_built_pair
+ the runtime's SpecBackend), `load_build_corpus` (BUILD_DIR/corpus.npz, the suffix proposer's corpus) and
`make_batcher` (backend → metrics-timed, overload-gated RoundScheduler →
InflightBatcher, started). The limits come from serve.config.ServeConfig. Used by the Triton stubs
(serve.triton); no pb_utils here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dspark_trt.errors import ServeError
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


def load_tokenizer_for(cfg: ServeConfig) -> Any:
    """The build's tokenizer (build/NAME/tokenizer)."""
    from dspark_trt.runtime.hf_loader import load_tokenizer  # noqa: PLC0415

    path = cfg.build / "tokenizer"
    if not path.is_dir():
        raise ServeError(f"{path} is missing: the build directory is incomplete; rerun `dspark-trt build`")
    return load_tokenizer(path)


@dataclass(frozen=True)
class LoadedBackend:
    """A loaded build: the backend the round loop drives (None on a GPU host: the engines are Triton models), its
    vocabulary size and eos ids."""

    backend: Any  # dspark_trt.runtime.backend.SpecBackend
    vocab_size: int
    eos_ids: tuple[int, ...]


def load_backend(cfg: ServeConfig) -> LoadedBackend:
    """load_built_pair(BUILD_DIR) → SpecBackend(target, drafter, MAX_BATCH_SIZE, MAX_SEQ_LEN)."""
    from dspark_trt.builder.artifacts import load_built_pair  # noqa: PLC0415
    from dspark_trt.runtime.backend import SpecBackend  # noqa: PLC0415

    pair = load_built_pair(cfg.build)
    backend = SpecBackend(pair.target, pair.drafter, max_batch=cfg.max_batch, max_seq=cfg.max_seq_len)
    eos = tuple(int(e) for e in getattr(pair.target.config, "eos_token_ids", ()) or ())
    log.info("loaded %s: vocab %d, eos %s, max_batch %d, max_seq %d, γ %d", cfg.build_dir, backend.vocab_size, eos,
             cfg.max_batch, cfg.max_seq_len, cfg.gamma)
    return LoadedBackend(backend, int(backend.vocab_size), eos)


def load_build_corpus(cfg: ServeConfig, vocab_size: int) -> Any:
    """The build's suffix corpus (BUILD_DIR/corpus.npz, written by `dspark-trt build --corpus`) as a
    spec_decode.corpus.CorpusIndex, or None when the build has none."""
    from dspark_trt.runtime.default_model import cache_root  # noqa: PLC0415
    from dspark_trt.spec_decode.corpus import load_corpus  # noqa: PLC0415

    path = cfg.build / "corpus.npz"
    if not path.is_file():
        return None
    index = load_corpus(path, vocab_size, cache=cache_root())
    log.info("suffix corpus %s: %d positions", path, index.size)
    return index


def make_batcher(cfg: ServeConfig, loaded: LoadedBackend, metrics: ServeMetrics, faults: str = "") -> Any:
    """The in-flight batching worker over the loaded backend (started)."""
    from dspark_trt.serve.worker import InflightBatcher, proposers_from_env, serving_backend  # noqa: PLC0415
    from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler  # noqa: PLC0415

    table = None
    if loaded.backend.drafter is not None and cfg.gamma > 0:  # measured verify + drafter costs for the survival policy
        from dspark_trt.runtime.profile import profile_costs  # noqa: PLC0415

        # every verify size 1..γ+1, then pass sizes up to a full batch's verify (slots × (γ + 1) tokens, ≤ 512)
        table = profile_costs(loaded.backend, cfg.gamma + 1, reps=3, pass_tokens=cfg.max_batch * (cfg.gamma + 1))
    from dspark_trt.serve.config import calibrate_on, suffix_corpus_on, suffix_recent_tokens  # noqa: PLC0415

    config = LoopConfig(gamma=cfg.gamma, prefill_chunk=cfg.prefill_chunk, calibrate=calibrate_on()) if table is None \
        else LoopConfig(gamma=cfg.gamma, cost_table=table, prefill_chunk=cfg.prefill_chunk, calibrate=calibrate_on())
    from dspark_trt.spec_decode.suffix import SuffixConfig, SuffixProposer  # noqa: PLC0415

    base = SuffixConfig()
    suffix = SuffixProposer(base.with_recent_tokens(suffix_recent_tokens(base.ring_tokens)),  # 0: own tokens only
                            corpus=load_build_corpus(cfg, loaded.vocab_size) if suffix_corpus_on() else None)
    sched = RoundScheduler(serving_backend(loaded.backend, metrics, faults), config, suffix=suffix)
    return InflightBatcher(sched, metrics, max_queue=cfg.max_queue, proposers=proposers_from_env()).start()
