"""The logic behind dspark_trt/model_repo/*/1/model.py: each TritonPythonModel there subclasses one class here and sets
`pb = triton_python_backend_utils` (only importable inside the python-backend stub, hence passed in).

Owns tensor plumbing between Triton and dspark_trt: reading optional inputs, error responses (a DsparkError
becomes pb_utils.TritonError with its message; anything else is logged and answered, never a crashed stub),
and the response sender wrapper handed to the in-flight batching worker. Models:
- PreprocessingModel: text_input (+ apply_chat_template, stop_words) → input_ids, stop_words_ids.
- DsparkModel (decoupled): input_ids + generation inputs → the worker; responses output_ids / context_ids /
  final / stats, and text_output (the text delta, detokenized here, in the worker thread) when it is requested —
  the streamed path has no detokenizing model after this one (one IPC hop less per round).
- TargetModel / DraftModel: one explicit-batch pass (max_batch_size 0) over the same backend, for scoring and
  debugging; they are the slots where TRT-LLM engines sit on a GPU host (see dspark_trt.serve.worker for why the
  round loop executes the models in process).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from dspark_trt.errors import DsparkError, RequestError
from dspark_trt.serve.metrics import ServeMetrics
from dspark_trt.serve.pipeline import ServeConfig, load_backend, load_tokenizer_for, make_batcher
from dspark_trt.serve.text import delta_text, encode_prompt, encode_stop_words, pack_stop_words, unpack_stop_words
from dspark_trt.serve.validate import (check_request_parameters, decode_text, parse_generation, request_key,
                                       single)

log = logging.getLogger("dspark_trt.serve")

GEN_INPUTS = ("max_tokens", "stream", "temperature", "top_p", "random_seed", "end_id", "policy", "min_k", "max_k",
              "return_stats")


def _setup_logging() -> None:
    root = logging.getLogger("dspark_trt")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
        root.setLevel(logging.INFO)


def _utf8_locale() -> None:
    """The stub embeds Python in isolated mode, which never sets LC_CTYPE: the locale stays "C" and every
    open()/read_text() without an encoding decodes ASCII (it broke loading the runtime's native kernels in the
    stub, halving served speed). Take LC_CTYPE from the environment as a normal interpreter does, else C.UTF-8."""
    import locale  # noqa: PLC0415

    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("", "C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            return
    log.warning("no UTF-8 locale in the python-backend stub (preferred encoding %s); text files without an explicit "
                "encoding may fail to load", locale.getpreferredencoding(False))


def _fast_exit() -> None:
    """Last atexit hook of the stub: skip CPython's module teardown, which takes seconds with torch loaded
    (measured 2–9 s per stub here) and made every server stop run into --exit-timeout-secs. It runs after
    the stub has finalized the model and answered the server, so nothing is lost; shm belongs to the server."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_EXIT_HOOKED: list[bool] = []


class _Base:
    pb: Any = None  # triton_python_backend_utils, set by model.py

    def initialize(self, args: dict[str, str]) -> None:
        _setup_logging()
        _utf8_locale()
        if not _EXIT_HOOKED:
            atexit.register(_fast_exit)  # registered after torch's hooks → runs first
            _EXIT_HOOKED.append(True)
        self.model_config = json.loads(args["model_config"])
        self.cfg = ServeConfig.from_model_config(self.model_config)
        self.name = self.model_config.get("name", "?")

    def _get(self, request: Any, name: str) -> np.ndarray | None:
        t = self.pb.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def _error(self, exc: BaseException) -> Any:
        if isinstance(exc, DsparkError):
            msg = str(exc)
        else:
            log.exception("%s: unexpected error", self.name)
            msg = f"internal error in {self.name} ({type(exc).__name__}: {exc}); see the server log"
        try:
            err = self.pb.TritonError(msg, self.pb.TritonError.INVALID_ARG if isinstance(exc, RequestError)
                                      else self.pb.TritonError.INTERNAL)
        except (AttributeError, TypeError):
            err = self.pb.TritonError(msg)
        return self.pb.InferenceResponse(output_tensors=[], error=err)

    def _bytes(self, name: str, values: Sequence[bytes], shape: tuple[int, ...]) -> Any:
        return self.pb.Tensor(name, np.array(list(values), dtype=np.object_).reshape(shape))

    def finalize(self) -> None:
        log.info("%s unloaded", getattr(self, "name", "?"))


class PreprocessingModel(_Base):
    """Tokenize the prompt (optionally through the chat template) and the stop words."""

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        self.tokenizer = load_tokenizer_for(self.cfg)

    def _one(self, request: Any) -> Any:
        check_request_parameters(request.parameters())
        text = decode_text(single({"text_input": self._get(request, "text_input")}, "text_input"), "text_input")
        chat = single({"c": self._get(request, "apply_chat_template")}, "c")
        ids = encode_prompt(self.tokenizer, text, bool(chat) if chat is not None else False,
                            self.cfg.max_prompt_tokens)
        words = self._get(request, "stop_words")
        stops = encode_stop_words(self.tokenizer, list(np.asarray(words).reshape(-1))) if words is not None else []
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1)),  # [1, T]
            self.pb.Tensor("stop_words_ids", pack_stop_words(stops)[None]),  # [1, 2, N]
        ])

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for r in requests:
            try:
                out.append(self._one(r))
            except Exception as exc:  # noqa: BLE001 - answered as an error response
                out.append(self._error(exc))
        return out


class _Responder:
    """One thread that sends the round loop's responses, in order: detokenizing and the blocking round trip of
    `sender.send` to the server (≈ 1 ms per response measured here, paid per streaming request per round) then
    overlap the next round instead of delaying it."""

    def __init__(self) -> None:
        self._q: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dspark-responses", daemon=True)
        self._thread.start()

    def put(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._q.append(fn)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._stop:
                    self._cond.wait()
                if not self._q:
                    return
                fn = self._q.popleft()
            try:
                fn()
            except Exception:  # noqa: BLE001 - one client's failed send must not stop the others'
                log.exception("sending a response failed")

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)


class _Sink:
    """ResponseSink over a python-backend response sender (thread-safe, at most one final response). The worker's
    calls only queue the response; the model's _Responder builds the text and sends it, in order."""

    def __init__(self, model: "DsparkModel", sender: Any, text: bool = False) -> None:
        self.m, self.sender, self.text = model, sender, text
        self.closed = False
        self.broken = False  # a send failed: the worker drops the request at its next cancellation check
        self.lock = threading.Lock()

    def send(self, new_ids: Sequence[int], context_ids: Sequence[int], final: bool,
             stats: dict[str, object] | None) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = final
        new, ctx = list(new_ids), list(context_ids)
        self.m.responder.put(lambda: self._send(new, ctx, final, stats))

    def _send(self, new_ids: list[int], context_ids: list[int], final: bool, stats: dict[str, object] | None) -> None:
        if self.broken:
            return
        try:
            self._send_now(new_ids, context_ids, final, stats)
        except Exception:  # noqa: BLE001 - one client's broken stream must not fail the others
            log.exception("%s: sending a response failed; the request will be dropped", self.m.name)
            self.broken = True

    def _send_now(self, new_ids: list[int], context_ids: list[int], final: bool,
                  stats: dict[str, object] | None) -> None:
        pb = self.m.pb
        tensors = [pb.Tensor("output_ids", np.asarray(new_ids, dtype=np.int32).reshape(1, -1)),  # [1, n]
                   pb.Tensor("context_ids", np.asarray(context_ids, dtype=np.int32).reshape(1, -1)),
                   pb.Tensor("final", np.array([[final]], dtype=np.bool_))]
        if self.text:  # the delta after context_ids; a trailing partial UTF-8 character waits for the next response
            piece = delta_text(self.m.tokenizer, context_ids, new_ids, final)
            tensors.append(self.m._bytes("text_output", [piece.encode("utf-8")], (1, 1)))
        if final:
            payload = json.dumps(stats).encode() if stats is not None else b""
            tensors.append(self.m._bytes("stats", [payload], (1, 1)))
        self.sender.send(pb.InferenceResponse(output_tensors=tensors),
                         flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def error(self, message: str) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        pb = self.m.pb
        self.m.responder.put(lambda: self.sender.send(self.m._error(RequestError(message)),
                                                      flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def is_cancelled(self) -> bool:
        if self.broken:
            return True
        try:
            return bool(self.sender.is_cancelled())
        except Exception:  # noqa: BLE001 - a sender already closed counts as gone
            return self.closed


class DsparkModel(_Base):
    """Decoupled scheduler model: validates, then hands each request to the in-flight batching worker."""

    _tokenizer: Any = None
    _responder: _Responder | None = None
    _responder_lock = threading.Lock()

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        from dspark_trt.serve.tuning import apply_threads  # noqa: PLC0415 - torch: only in this model
        from dspark_trt.serve.worker import faults_from_env  # noqa: PLC0415

        self.loaded = load_backend(self.cfg)
        self._tokenizer = load_tokenizer_for(self.cfg)
        apply_threads(self.loaded.backend)  # before the cost profile in make_batcher: it times these threads
        self.limits = self.cfg.limits(self.loaded.vocab_size)
        self.metrics = ServeMetrics(self.pb, gamma=self.cfg.gamma, model=self.name)
        self.batcher = make_batcher(self.cfg, self.loaded, self.metrics, faults_from_env())

    @property
    def responder(self) -> _Responder:
        """The thread sending this model's responses (started on first use)."""
        if self._responder is None:
            with self._responder_lock:
                if self._responder is None:
                    self._responder = _Responder()
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

    def _job(self, request: Any, sink: _Sink) -> Any:  # dspark_trt.serve.worker.Job
        ids = self._get(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is required")
        arr = np.asarray(ids)
        if arr.ndim == 2 and arr.shape[0] != 1:
            raise RequestError(f"one prompt per request, got a batch of {arr.shape[0]}; send concurrent requests "
                               "instead (they are batched in flight)")
        prompt = tuple(int(t) for t in arr.reshape(-1))
        bad = [t for t in prompt if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise RequestError(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.limits.vocab_size})")
        inputs = {name: self._get(request, name) for name in GEN_INPUTS}
        stops = unpack_stop_words(self._get(request, "stop_words_ids"))
        params = parse_generation(inputs, len(prompt), self.limits, stops)
        from dspark_trt.serve.worker import Job  # noqa: PLC0415

        key = request_key(request.request_id(), request.parameters())
        return Job(prompt, params, sink, self.loaded.eos_ids, key=key)

    def execute(self, requests: list[Any]) -> None:
        for r in requests:
            sink = _Sink(self, r.get_response_sender(), text=self._wants_text(r))
            try:
                stop = single({"stop": self._get(r, "stop")}, "stop")
                if stop is not None and bool(stop):
                    self.batcher.request_stop(request_key(r.request_id(), r.parameters()), sink)
                    continue
                self.batcher.submit(self._job(r, sink))
            except Exception as exc:  # noqa: BLE001
                self.metrics.inc("dspark_errors_total")
                self.metrics.flush()
                sink.error(str(exc)) if isinstance(exc, DsparkError) else sink.sender.send(
                    self._error(exc), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self) -> None:
        self.batcher.stop()
        if self._responder is not None:
            self._responder.close()
        self.metrics.close()
        super().finalize()


class _OnePass(_Base):
    """Explicit-batch model over the backend: input_ids [B, T] right-padded + input_lengths [B].

    The models load on the first request: the `dspark` model already loads (and so checks) the same build at
    startup, and loading it three times at once roughly doubled server start time on a small CPU host."""

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        self.lock = threading.Lock()
        self._loaded: Any = None

    @property
    def loaded(self) -> Any:
        if self._loaded is None:
            self._loaded = load_backend(self.cfg)
        return self._loaded

    def _prompts(self, request: Any) -> list[list[int]]:
        ids = self._get(request, "input_ids")
        lens = self._get(request, "input_lengths")
        if ids is None or lens is None:
            raise RequestError("input_ids [B, T] and input_lengths [B] are required")
        ids, lens = np.asarray(ids).reshape(len(np.asarray(lens).reshape(-1)), -1), np.asarray(lens).reshape(-1)
        if not 1 <= len(lens) <= self.cfg.max_batch:
            raise RequestError(f"batch must have 1..{self.cfg.max_batch} rows (MAX_BATCH_SIZE), got {len(lens)}")
        prompts = [[int(t) for t in ids[i, : int(n)]] for i, n in enumerate(lens)]
        for p in prompts:
            if not 1 <= len(p) <= self.cfg.max_prompt_tokens:
                raise RequestError(f"each row needs 1..{self.cfg.max_prompt_tokens} tokens, got {len(p)}")
            if any(not 0 <= t < self.loaded.vocab_size for t in p):
                raise RequestError(f"input_ids must be in [0, {self.loaded.vocab_size})")
        return prompts

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for r in requests:
            try:
                with self.lock:
                    prompts = self._prompts(r)
                    slots = list(range(len(prompts)))
                    try:
                        out.append(self._run(r, slots, prompts))
                    finally:
                        for s in slots:
                            self.loaded.backend.release(s)
            except Exception as exc:  # noqa: BLE001
                out.append(self._error(exc))
        return out

    def _run(self, request: Any, slots: list[int], prompts: list[list[int]]) -> Any:
        raise NotImplementedError


class TargetModel(_OnePass):
    """One target forward per row: the next greedy token and the last-position logits."""

    def _run(self, request: Any, slots: list[int], prompts: list[list[int]]) -> Any:
        logits = self.loaded.backend.prefill(slots, prompts).float()  # [B, V]
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("next_token_ids", logits.argmax(-1).numpy().astype(np.int32)),  # [B]
            self.pb.Tensor("last_logits", logits.numpy().astype(np.float32))])  # [B, V]


class DraftModel(_OnePass):
    """One drafter block per row after the target's greedy next token: draft_ids [B, γ], confidence [B, γ]."""

    def _run(self, request: Any, slots: list[int], prompts: list[list[int]]) -> Any:
        import torch  # noqa: PLC0415

        from dspark_trt.spec_decode.protocols import SamplingParams  # noqa: PLC0415

        g = single({"gamma": self._get(request, "gamma")}, "gamma")
        gamma = self.cfg.gamma if g is None else int(g)
        if not 1 <= gamma <= self.cfg.gamma:
            raise RequestError(f"gamma must be in 1..{self.cfg.gamma} (the build's γ), got {gamma}")
        anchors = self.loaded.backend.prefill(slots, prompts).float().argmax(-1)  # [B]
        block = self.loaded.backend.draft(slots, anchors.long(), gamma, [SamplingParams()] * len(slots))
        conf = block.conf if block.conf is not None else torch.full(block.tokens.shape, float("nan"))
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("anchor_ids", anchors.numpy().astype(np.int32)),  # [B]
            self.pb.Tensor("draft_ids", block.tokens.numpy().astype(np.int32)),  # [B, γ]
            self.pb.Tensor("confidence", conf.float().numpy().astype(np.float32))])  # [B, γ]
