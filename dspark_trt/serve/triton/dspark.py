"""The decoupled `dspark` model (model_repo/dspark/1/model.py): the scheduler every generating request reaches.

Owns `DsparkModel`: initialize() loads the build once (serve.build_loader: SpecBackend, tokenizer), picks torch's
threads (serve.tuning), makes the metrics and starts the in-flight batching worker (serve.worker.InflightBatcher);
execute() validates each request at this edge (serve.validate.prompt_ids + parse_generation, against the build's
serve.config.ServeConfig) and hands it, wrapped in a serve.triton.responder.TritonSink, to the worker — or, for a
`stop=true` request, asks the worker to stop the running request with the same id (`request_stop`; with Triton's
request cancellation, seen through TritonSink.is_cancelled, the two entry points of the worker's one cancellation
path, InflightBatcher._cancel → RoundScheduler.cancel). Responses: output_ids / context_ids / final, on the final
one finish_reason and stats, and text_output (the text delta, detokenized by the responder thread) when it is
requested — the streamed path has no detokenizing model after this one (one IPC hop less per round).
serve.gpu_host.dspark.TrtllmDsparkModel is this model with the rounds over TensorRT-LLM engines.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from dspark_trt.errors import DsparkError
from dspark_trt.serve.build_loader import LoadedBackend, load_backend, load_tokenizer_for, make_batcher
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.text import unpack_stop_words
from dspark_trt.serve.triton.responder import Responder, TritonSink
from dspark_trt.serve.triton.stub import StubModel
from dspark_trt.serve.validate import check_stop_words_ids, parse_generation, prompt_ids, request_key, single

log = logging.getLogger("dspark_trt.serve")

__all__ = ["DsparkModel", "GEN_INPUTS"]

GEN_INPUTS = ("max_tokens", "stream", "temperature", "top_p", "random_seed", "end_id", "policy", "min_k", "max_k",
              "return_stats", "proposers")


class DsparkModel(StubModel):
    """Decoupled scheduler model: validates, then hands each request to the in-flight batching worker."""

    _tokenizer: Any = None
    _responder: Responder | None = None
    _responder_lock = threading.Lock()
    loaded: LoadedBackend
    metrics: ServeMetrics
    batcher: Any  # dspark_trt.serve.worker.InflightBatcher

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        from dspark_trt.serve.tuning import on_fresh_thread  # noqa: PLC0415 - torch: only in this model

        on_fresh_thread(self._setup)  # no OpenMP pool may stay on this thread (tuning.on_fresh_thread says why)

    def _setup(self) -> None:
        """Load the build, pick the threads, profile the costs and start the round thread (initialize's work)."""
        from dspark_trt.serve.tuning import apply_threads  # noqa: PLC0415
        from dspark_trt.serve.worker import faults_from_env  # noqa: PLC0415

        self.loaded = load_backend(self.cfg)
        self._tokenizer = load_tokenizer_for(self.cfg)
        apply_threads(self.loaded.backend)  # before the cost profile in make_batcher: it times these threads
        self.cfg = self.cfg.with_vocab(self.loaded.vocab_size)
        self.metrics = ServeMetrics(self.pb, gamma=self.cfg.gamma, model=self.name)
        self.batcher = make_batcher(self.cfg, self.loaded, self.metrics, faults_from_env())

    @property
    def responder(self) -> Responder:
        """The thread sending this model's responses (started on first use)."""
        if self._responder is None:
            with self._responder_lock:
                if self._responder is None:
                    self._responder = Responder()
        return self._responder

    @property
    def tokenizer(self) -> Any:
        """The build's tokenizer (for text_output); loaded on first use where initialize did not load it."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer_for(self.cfg)
        return self._tokenizer

    def _wants_text(self, request: Any) -> bool:
        try:
            return "text_output" in set(request.requested_output_names())
        except AttributeError:  # an older python backend: always answer text
            return True

    def _job(self, request: Any, sink: TritonSink) -> Any:  # dspark_trt.serve.worker.Job
        """The request, validated (RequestError naming the fix otherwise), as the worker's Job."""
        from dspark_trt.serve.worker import Job  # noqa: PLC0415

        prompt = prompt_ids(self._get(request, "input_ids"), self.cfg)
        inputs = {name: self._get(request, name) for name in GEN_INPUTS}
        packed = self._get(request, "stop_words_ids")
        check_stop_words_ids(packed)  # the layout; parse_generation checks the sequences
        stops = unpack_stop_words(packed)
        params = parse_generation(inputs, len(prompt), self.cfg, stops)
        key = request_key(request.request_id(), request.parameters())
        return Job(prompt, params, sink, self.loaded.eos_ids, key=key)

    def execute(self, requests: list[Any]) -> None:
        for r in requests:
            sink = TritonSink(self, r.get_response_sender(), text=self._wants_text(r))
            try:
                stop = single({"stop": self._get(r, "stop")}, "stop")
                if stop is not None and bool(stop):  # tensorrtllm_backend's `stop`: end the request with this id
                    self.batcher.request_stop(request_key(r.request_id(), r.parameters()), sink)
                    continue
                self.batcher.submit(self._job(r, sink))
            except Exception as exc:  # noqa: BLE001
                self.metrics.inc("dspark_errors_total")
                self.metrics.flush()
                sink.error(str(exc)) if isinstance(exc, DsparkError) else sink.sender.send(
                    self.error_response(exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self) -> None:
        self.batcher.stop()
        if self._responder is not None:
            self._responder.close()
        self.metrics.close()
        super().finalize()
