"""The `dspark` model of the GPU-host repository (model_repo_trtllm/dspark/1/model.py): the reference `dspark`
model — the same inputs, validation, streaming, finish_reason, `stop` and cancellation — with its rounds driven over
the TensorRT-LLM engines instead of the in-process runtime.

Owns `TrtllmDsparkModel` (LM / PARD drafters: serve.gpu_host.rounds.TrtllmRoundScheduler over a
serve.gpu_host.bls.PbEngineClient; DSpark drafters: spec_decode.loop.RoundScheduler over serve.gpu_host.taps.TapExecutor
— the tapped target + the drafter in this process; both inside serve.worker.InflightBatcher), `read_build_info`
(vocabulary, eos ids and drafter kind from the build's checkpoint configs) and `load_tap_drafter`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dspark_trt.errors import ServeError
from dspark_trt.serve.build_loader import LoadedBackend
from dspark_trt.serve.gpu_host.bls import PbEngineClient
from dspark_trt.serve.gpu_host.rounds import TrtllmRoundScheduler
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.triton.dspark import DsparkModel

log = logging.getLogger(__name__)

__all__ = ["BuildInfo", "TrtllmDsparkModel", "read_build_info"]


@dataclass(frozen=True)
class BuildInfo:
    """What the GPU-host stub needs of a build without loading weights."""

    vocab_size: int
    eos_ids: tuple[int, ...]
    draft_kind: str  # "lm" | "dspark"


def read_build_info(build_dir: Path) -> BuildInfo:
    """Vocabulary, eos ids and drafter kind of a build, from its checkpoint configs (no weights loaded)."""
    from dspark_trt.runtime.trtllm_checkpoint import model_config_from_trtllm, read_checkpoint_config  # noqa: PLC0415

    tckpt, dckpt = build_dir / "target" / "checkpoint", build_dir / "draft" / "checkpoint"
    if not (tckpt / "config.json").is_file() or not (dckpt / "config.json").is_file():
        raise ServeError(f"{build_dir} lacks target/ or draft/ checkpoints: the build is incomplete; rerun "
                         "`dspark-trt build --serving trtllm`")
    mc = model_config_from_trtllm(read_checkpoint_config(tckpt))
    arch = json.loads((dckpt / "config.json").read_text()).get("architecture")
    return BuildInfo(int(mc.vocab_size), tuple(int(e) for e in mc.eos_token_ids),
                     "dspark" if arch == "DSparkDrafter" else "lm")


def load_tap_drafter(build_dir: Path) -> tuple[object, tuple[str, ...]]:
    """The build's DSpark drafter (reference runtime; CUDA when present) sharing the target's embeddings and lm_head,
    and the tapped target's output names of its target_layer_ids. Loads the target checkpoint once for those two
    tensors (the engines hold the target itself)."""
    import torch  # noqa: PLC0415

    from dspark_trt.builder.artifacts import load_dspark_export, read_manifest  # noqa: PLC0415
    from dspark_trt.builder.options import BuildOptions  # noqa: PLC0415
    from dspark_trt.builder.trtllm_taps import tap_output_names  # noqa: PLC0415
    from dspark_trt.runtime.trtllm_checkpoint import STR_DTYPES, load_trtllm_checkpoint  # noqa: PLC0415

    opts = BuildOptions.from_dict(read_manifest(build_dir).get("options") or {})
    dtype = STR_DTYPES[opts.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_trtllm_checkpoint(build_dir / "target" / "checkpoint", dtype=dtype)
    drafter = load_dspark_export(build_dir / "draft" / "checkpoint", target, dtype, device)
    del target
    names = tap_output_names(drafter.target_layer_ids)
    log.info("DSpark drafter on %s over the tapped target's outputs %s", device, list(names))
    return drafter, names


class TrtllmDsparkModel(DsparkModel):
    """The decoupled scheduler of model_repo_trtllm/: as DsparkModel, but each round goes to the `draft` and
    `target` tensorrtllm models over BLS instead of the in-process reference runtime."""

    TARGET_MODEL = "target"
    DRAFT_MODEL = "draft"

    def initialize(self, args: dict[str, str]) -> None:
        super(DsparkModel, self).initialize(args)  # the stub's setup (StubModel), not the reference backend
        from dspark_trt.serve.worker import InflightBatcher, latency_observer  # noqa: PLC0415
        from dspark_trt.spec_decode.loop import LoopConfig, RoundScheduler  # noqa: PLC0415

        info = read_build_info(self.cfg.build)
        self.loaded = LoadedBackend(None, info.vocab_size, info.eos_ids)
        self.cfg = self.cfg.with_vocab(info.vocab_size)
        self.metrics = ServeMetrics(self.pb, gamma=self.cfg.gamma, model=self.name)
        self.client = PbEngineClient(self.pb, concurrency=2 * self.cfg.max_batch)
        observe = latency_observer(self.metrics)
        if info.draft_kind == "dspark":  # the tapped target + the DSpark drafter in this process
            from dspark_trt.serve.gpu_host.taps import TapExecutor  # noqa: PLC0415

            drafter, taps = load_tap_drafter(self.cfg.build)
            ex = TapExecutor(self.client, drafter, taps, self.cfg.max_batch, self.cfg.max_seq_len, info.vocab_size,
                             self.TARGET_MODEL, observe)
            from dspark_trt.serve.build_loader import load_build_corpus  # noqa: PLC0415
            from dspark_trt.serve.config import suffix_corpus_on  # noqa: PLC0415
            from dspark_trt.spec_decode.suffix import SuffixProposer  # noqa: PLC0415

            corpus = load_build_corpus(self.cfg, info.vocab_size) if suffix_corpus_on() else None
            sched = RoundScheduler(ex, LoopConfig(gamma=self.cfg.gamma), suffix=SuffixProposer(corpus=corpus))
        else:
            sched = TrtllmRoundScheduler(self.client, LoopConfig(gamma=self.cfg.gamma), self.cfg.max_batch,
                                         self.cfg.max_seq_len, info.vocab_size, self.TARGET_MODEL, self.DRAFT_MODEL,
                                         observe=observe)
        self.batcher = InflightBatcher(sched, self.metrics, max_queue=self.cfg.max_queue).start()
        log.info("%s: rounds over tensorrtllm models %r (+ draft %r), γ %d, max batch %d", self.name,
                 self.TARGET_MODEL, self.DRAFT_MODEL, self.cfg.gamma, self.cfg.max_batch)

    def finalize(self) -> None:
        super().finalize()
        self.client.close()
