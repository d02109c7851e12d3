"""What the served models load from a build directory: the tokenizer, the limits, and the speculative backend.

Owns `ServeConfig` (config.pbtxt parameters → typed, frozen), `load_tokenizer_for`, `load_backend` (the
builder's load_built_pair + the runtime's SpecBackend) and `make_batcher` (backend → metrics-timed,
overload-gated RoundScheduler → InflightBatcher). Used by dspark_trt.serve.triton_models; no pb_utils here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dspark_trt.errors import ServeError
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.validate import ServeLimits
from dspark_trt.spec_decode.limits import request_room

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """The template keys as filled into config.pbtxt parameters."""

    build_dir: Path
    max_batch: int
    gamma: int
    policy: str
    min_k: int
    max_k: int
    max_seq_len: int
    max_queue: int

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any]) -> "ServeConfig":
        raw = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        try:
            gamma = int(raw["GAMMA"])
            return cls(build_dir=Path(raw["BUILD_DIR"]), max_batch=int(raw["MAX_BATCH_SIZE"]), gamma=gamma,
                       policy=raw["POLICY"], min_k=int(raw["MIN_K"]), max_k=int(raw["MAX_K"]) or gamma,
                       max_seq_len=int(raw["MAX_SEQ_LEN"]), max_queue=int(raw["MAX_QUEUE"]))
        except (KeyError, ValueError) as exc:
            raise ServeError(f"config.pbtxt of {model_config.get('name')!r} lacks parameter {exc} or it is not a "
                             "number; rebuild the repository with `dspark-trt build` (templates in dspark_trt/model_repo/)") from exc

    def limits(self, vocab_size: int) -> ServeLimits:
        return ServeLimits(max_seq_len=self.max_seq_len, max_batch=self.max_batch, gamma=self.gamma,
                           vocab_size=vocab_size, policy=self.policy, min_k=self.min_k, max_k=self.max_k,
                           max_queue=self.max_queue)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that still leaves room for one generated token and a γ-block verify."""
        return request_room(self.max_seq_len, self.gamma) - 1


def load_tokenizer_for(cfg: ServeConfig) -> Any:
    """The build's tokenizer (build/NAME/tokenizer)."""
    from dspark_trt.runtime.hf_loader import load_tokenizer  # noqa: PLC0415

    path = cfg.build_dir / "tokenizer"
    if not path.is_dir():
        raise ServeError(f"{path} is missing: the build directory is incomplete; rerun `dspark-trt build`")
    return load_tokenizer(path)


@dataclass
class LoadedBackend:
    backend: Any  # dspark_trt.runtime.backend.SpecBackend
    vocab_size: int
    eos_ids: tuple[int, ...]


def load_backend(cfg: ServeConfig) -> LoadedBackend:
    """load_built_pair(BUILD_DIR) → SpecBackend(target, drafter, MAX_BATCH_SIZE, MAX_SEQ_LEN)."""
    from dspark_trt.builder.artifacts import load_built_pair  # noqa: PLC0415
    from dspark_trt.runtime.backend import SpecBackend  # noqa: PLC0415

    pair = load_built_pair(cfg.build_dir)
    backend = SpecBackend(pair.target, pair.drafter, max_batch=cfg.max_batch, max_seq=cfg.max_seq_len)
    eos = tuple(int(e) for e in getattr(pair.target.config, "eos_token_ids", ()) or ())
    log.info("loaded %s: vocab %d, eos %s, max_batch %d, max_seq %d, γ %d", cfg.build_dir, backend.vocab_size, eos,
             cfg.max_batch, cfg.max_seq_len, cfg.gamma)
    return LoadedBackend(backend, int(backend.vocab_size), eos)


def make_batcher(cfg: ServeConfig, loaded: LoadedBackend, metrics: ServeMetrics, faults: str = "") -> Any:
    """The in-flight batching worker over the loaded backend (started)."""
    from dspark_trt.serve.worker import InflightBatcher, serving_backend  # noqa: PLC0415
    from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler  # noqa: PLC0415

    table = None
    if loaded.backend.drafter is not None and cfg.gamma > 0:  # measured verify + drafter costs for the survival policy
        from dspark_trt.runtime.profile import profile_costs  # noqa: PLC0415

        table = profile_costs(loaded.backend, cfg.gamma + 1, reps=3)
    config = LoopConfig(gamma=cfg.gamma) if table is None else LoopConfig(gamma=cfg.gamma, cost_table=table)
    sched = RoundScheduler(serving_backend(loaded.backend, metrics, faults), config)
    return InflightBatcher(sched, metrics, max_queue=cfg.max_queue).start()
