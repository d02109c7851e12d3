"""The `target` model of a DSpark GPU-host repository: a Triton Python-backend model running the tapped target engine
(builder/trtllm_taps.py) through TensorRT-LLM 1.2.x's executor bindings (`tensorrt_llm.bindings.executor`).

Why it exists: the stock tensorrtllm backend's C++ model (triton_backend/inflight_batcher_llm/src/
model_instance_state.cc) never sets ExecutorConfig.additional_model_outputs, so its engine outputs other than the
stock ones never reach a response and every DSpark request would fail with "returned no dspark_tap_…". This model
asks for them: ExecutorConfig(additional_model_outputs=[AdditionalModelOutput(tap, gather_context=True)]) and, per
request, OutputConfig(return_context_logits=True, additional_model_outputs=[the same]). In-flight batching is the
executor's own: execute() enqueues every Triton request at once and returns; one awaiter thread maps the executor's
responses back to each request's response sender (as tensorrtllm_backend's Python model over the same bindings does).

Owns:
- ExecutorModelConfig (frozen): the config.pbtxt parameters (engine_dir, dspark_tap_names, kv cache fraction / reuse,
  tokens_per_block, scheduler policy) and the declared tap outputs, cross-checked;
- TargetRequest + parse_request: the Triton input arrays the BLS side sends (serve/gpu_host/bls.py INPUT_DTYPES:
  [1, T] input_ids, [1, 1] scalars) → one checked request, an ExecutorModelError naming the fix otherwise;
- executor_config / executor_request: the 1.2.1 binding objects (every name and keyword checked against the sources
  in tests/builder/trtllm_1_2_1_names.json "executor_bindings");
- reply_arrays: an executor Response → the output arrays the BLS side reads (output_ids [1, 1, n] INT32,
  sequence_length [1, 1], context_logits [1, m, V] FP32, dspark_tap_<layer> [1, m, H] FP32);
- ExecutorBridge: enqueue + the awaiter thread over any object with the Executor's methods (free of pb_utils);
- ExecutorTargetModel: the TritonPythonModel base of model_repo_trtllm/_variants/target_executor/1/model.py.

KV-cache reuse (the 1.2.1 sources): the executor returns context logits and context additional outputs as
[prompt_len, ·] host tensors (LlmRequest::allocContextLogitsHost / allocAdditionalOutputs) written from the request's
context position on (handleContextLogits.cpp, utils/inflightBatchingUtils.cpp copyAdditionalOutputs): rows of a
reused prefix are never written. The result names a context output "context_<name>" (LlmRequest::createResult).
Every request asks return_perf_metrics, and the rows kept are those after min(P − 1, num_reused_blocks ×
tokens_per_block) — an upper bound of the reused length (kvCacheManager.cpp loadOrAllocateBlocks counts one reused
block per match, each at most tokens_per_block tokens; partial reuse is switched off, so it is exact but for a short
last block) — so the reply carries exactly the computed suffix, the contract serve/gpu_host/taps.py reads.
"""
from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dspark_trt.errors import ServeError

log = logging.getLogger(__name__)

__all__ = ["CONTEXT_PREFIX", "INPUT_NAMES", "ExecutorBridge", "ExecutorModelConfig", "ExecutorModelError",
           "ExecutorTargetModel", "TargetRequest", "executor_config", "executor_request", "parse_request",
           "reply_arrays"]

CONTEXT_PREFIX = "context_"  # LlmRequest::createResult: context additional outputs are "context_" + name
TAP_PREFIX = "dspark_tap_"
# The inputs this model declares (the BLS side's, serve/gpu_host/bls.py INPUT_DTYPES) → numpy dtype.
INPUT_NAMES: dict[str, type] = {"input_ids": np.int32, "input_lengths": np.int32, "request_output_len": np.int32,
                                "draft_input_ids": np.int32, "exclude_input_in_output": np.bool_,
                                "return_generation_logits": np.bool_, "return_context_logits": np.bool_,
                                "temperature": np.float32, "runtime_top_p": np.float32, "seed": np.uint64}
Reply = dict  # output name → array, the success value of a finished request


class ExecutorModelError(ServeError):
    """The executor `target` model cannot serve a request or cannot start; the message names the fix."""


def _truthy(v: str | None) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "t")


@dataclass(frozen=True)
class ExecutorModelConfig:
    """What the executor model reads from its config.pbtxt (parameters + declared outputs)."""

    name: str
    engine_dir: Path
    tap_names: tuple[str, ...]
    tokens_per_block: int = 32
    kv_cache_free_gpu_mem_fraction: float = 0.5
    enable_kv_cache_reuse: bool = True
    scheduler_policy: str = "guaranteed_no_evict"  # | "max_utilization"
    max_queue_size: int | None = None
    exclude_input_default: bool = True

    @classmethod
    def from_model_config(cls, cfg: Mapping[str, Any]) -> "ExecutorModelConfig":
        """The Triton model config (json.loads(args["model_config"])) → config; ExecutorModelError when the tap
        parameter and the declared outputs disagree or a parameter is malformed."""
        params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
        name = str(cfg.get("name", "target"))
        declared = tuple(o["name"] for o in cfg.get("output", []) if o["name"].startswith(TAP_PREFIX))
        listed = tuple(n.strip() for n in params.get("dspark_tap_names", "").split(",") if n.strip())
        if not listed or set(listed) != set(declared):
            raise ExecutorModelError(
                f"{name}: parameter dspark_tap_names {list(listed)} does not match the declared tap outputs "
                f"{list(declared)}; rebuild the repository with `dspark-trt build --serving trtllm` (it writes both "
                "from the drafter's target_layer_ids)")
        if not params.get("engine_dir"):
            raise ExecutorModelError(f"{name}: parameter engine_dir is missing; rebuild the repository")
        try:
            tpb = int(params.get("tokens_per_block", "32"))
            frac = float(params.get("kv_cache_free_gpu_mem_fraction", "0.5"))
        except ValueError as exc:
            raise ExecutorModelError(f"{name}: malformed parameter ({exc}); fix config.pbtxt") from exc
        policy = params.get("batch_scheduler_policy", "guaranteed_no_evict").lower()
        if tpb < 1 or not 0.0 < frac <= 1.0 or policy not in ("guaranteed_no_evict", "max_utilization"):
            raise ExecutorModelError(f"{name}: tokens_per_block must be ≥ 1, kv_cache_free_gpu_mem_fraction in "
                                     "(0, 1] and batch_scheduler_policy guaranteed_no_evict | max_utilization; fix "
                                     "config.pbtxt")
        queue = (cfg.get("dynamic_batching") or {}).get("default_queue_policy", {}).get("max_queue_size")
        return cls(name, Path(params["engine_dir"]), listed, tpb, frac,
                   _truthy(params.get("enable_kv_cache_reuse", "true")), policy,
                   None if queue in (None, "", 0, "0") else int(queue),
                   _truthy(params.get("exclude_input_in_output", "true")))

    def with_engine_block_size(self) -> "ExecutorModelConfig":
        """tokens_per_block from the engine's config.json (build_config.plugin_config.tokens_per_block) when it is
        readable: the engine's value is the one the KV cache uses."""
        try:
            plugin = json.loads((self.engine_dir / "config.json").read_text())["build_config"]["plugin_config"]
            tpb = int(plugin["tokens_per_block"])
        except (OSError, KeyError, TypeError, ValueError):
            return self
        if tpb != self.tokens_per_block:
            log.warning("%s: the engine's tokens_per_block is %d (config.pbtxt says %d); using the engine's",
                        self.name, tpb, self.tokens_per_block)
        return ExecutorModelConfig(self.name, self.engine_dir, self.tap_names, tpb,
                                   self.kv_cache_free_gpu_mem_fraction, self.enable_kv_cache_reuse,
                                   self.scheduler_policy, self.max_queue_size, self.exclude_input_default)


@dataclass(frozen=True)
class TargetRequest:
    """One Triton request to the tapped target, checked."""

    input_ids: tuple[int, ...]
    max_tokens: int
    context_logits: bool
    taps: tuple[str, ...]
    exclude_input: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def parse_request(arrays: Mapping[str, np.ndarray], requested: Sequence[str] | None,
                  cfg: ExecutorModelConfig) -> TargetRequest:
    """Triton input arrays (name → array, batch 1) + the requested output names (None: every declared one) →
    TargetRequest; ExecutorModelError naming the fix for what this target cannot do."""
    def scalar(name: str, default: Any) -> Any:
        v = arrays.get(name)
        return default if v is None or np.asarray(v).size == 0 else np.asarray(v).reshape(-1)[0].item()

    ids = arrays.get("input_ids")
    if ids is None or np.asarray(ids).size == 0:
        raise ExecutorModelError(f"{cfg.name}: input_ids is required and must not be empty")
    ids = np.asarray(ids)
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ExecutorModelError(f"{cfg.name}: one sequence per request (input_ids [1, T]); got {list(ids.shape)}")
    flat = ids.reshape(-1)
    n = int(scalar("input_lengths", flat.size))
    if not 0 < n <= flat.size:
        raise ExecutorModelError(f"{cfg.name}: input_lengths {n} is outside 1..{flat.size} (the input_ids sent)")
    draft = arrays.get("draft_input_ids")
    if draft is not None and np.asarray(draft).size:
        raise ExecutorModelError(f"{cfg.name}: draft_input_ids are not supported: the tapped target is built without "
                                 "a speculative mode; send sequence + draft as input_ids (serve/gpu_host/taps.py)")
    if bool(scalar("return_generation_logits", False)):
        raise ExecutorModelError(f"{cfg.name}: return_generation_logits is not supported by the tapped target; ask "
                                 "return_context_logits (the logits of the input rows)")
    max_tokens = int(scalar("request_output_len", 0))
    if max_tokens < 1:
        raise ExecutorModelError(f"{cfg.name}: request_output_len must be ≥ 1, got {max_tokens}")
    taps = cfg.tap_names if requested is None else tuple(t for t in cfg.tap_names if t in set(requested))
    temperature = float(scalar("temperature", 0.0))
    seed = scalar("seed", None)
    return TargetRequest(tuple(int(t) for t in flat[:n]), max_tokens, bool(scalar("return_context_logits", False)),
                         taps, bool(scalar("exclude_input_in_output", cfg.exclude_input_default)), temperature,
                         float(scalar("runtime_top_p", 1.0)), None if seed is None else int(seed))


# ---- the 1.2.1 binding objects (tle = tensorrt_llm.bindings.executor) ---------------------------------------------
def _outputs(tle: Any, names: Sequence[str]) -> list[Any]:
    return [tle.AdditionalModelOutput(name, gather_context=True) for name in names]


def executor_config(tle: Any, cfg: ExecutorModelConfig) -> Any:
    """ExecutorConfig: in-flight batching, beam 1, the KV cache (block reuse without partial reuse, so the reused
    length is a whole number of blocks) and every tap as an additional output gathered over the context."""
    policy = (tle.CapacitySchedulerPolicy.MAX_UTILIZATION if cfg.scheduler_policy == "max_utilization"
              else tle.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    kv = tle.KvCacheConfig(enable_block_reuse=cfg.enable_kv_cache_reuse,
                           free_gpu_memory_fraction=cfg.kv_cache_free_gpu_mem_fraction, enable_partial_reuse=False)
    kwargs: dict[str, Any] = dict(max_beam_width=1, scheduler_config=tle.SchedulerConfig(policy), kv_cache_config=kv,
                                  enable_chunked_context=False, batching_type=tle.BatchingType.INFLIGHT,
                                  additional_model_outputs=_outputs(tle, cfg.tap_names))
    if cfg.max_queue_size is not None:
        kwargs["max_queue_size"] = cfg.max_queue_size
    return tle.ExecutorConfig(**kwargs)


def executor_request(tle: Any, req: TargetRequest) -> Any:
    """Request: the input as context, max_tokens new tokens, context logits + the asked taps + perf metrics (the
    reused-block count the reply trims by)."""
    sampling: dict[str, Any] = {}
    if req.temperature > 0:
        sampling = {"temperature": req.temperature, "top_p": req.top_p}
        if req.seed is not None:
            sampling["seed"] = req.seed
    out = tle.OutputConfig(return_context_logits=req.context_logits, exclude_input_from_output=req.exclude_input,
                           return_perf_metrics=True, additional_model_outputs=_outputs(tle, req.taps) or None)
    return tle.Request(list(req.input_ids), req.max_tokens, streaming=False,
                       sampling_config=tle.SamplingConfig(1, **sampling), output_config=out)


def _as_numpy(t: Any) -> np.ndarray:
    """A result tensor (torch from the bindings; BF16 included) → float32 numpy."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float32, copy=False)
    return t.detach().float().cpu().numpy()


def reused_rows(result: Any, req: TargetRequest, cfg: ExecutorModelConfig) -> int:
    """Input rows the engine did not compute (KV-cache reuse): an upper bound, never the last input position."""
    if not cfg.enable_kv_cache_reuse:
        return 0
    perf = getattr(result, "request_perf_metrics", None)
    if perf is None:
        raise ExecutorModelError(f"{cfg.name}: the executor returned no request_perf_metrics with KV-cache reuse on, "
                                 "so the computed context rows are unknown; set enable_kv_cache_reuse false")
    blocks = int(perf.kv_cache_metrics.num_reused_blocks)
    return max(0, min(len(req.input_ids) - 1, blocks * cfg.tokens_per_block))


def _suffix(arr: np.ndarray, keep: int) -> np.ndarray:
    """The last `keep` rows of a [P, ·] context tensor (fewer rows: already the suffix)."""
    return np.ascontiguousarray(arr[-keep:] if arr.shape[0] >= keep else arr)


def reply_arrays(response: Any, req: TargetRequest, cfg: ExecutorModelConfig) -> Reply:
    """An executor Response → {output name: array}; ExecutorModelError naming the fix when it failed or lacks an
    asked output."""
    if response.has_error():
        raise ExecutorModelError(f"{cfg.name}: the executor failed the request: {response.error_msg}")
    result = response.result
    beam = list(result.output_token_ids[0]) if result.output_token_ids else []
    out: Reply = {"output_ids": np.asarray(beam, dtype=np.int32).reshape(1, 1, -1),  # [1, beam, n]
                  "sequence_length": np.array([[len(beam)]], dtype=np.int32)}  # [1, beam]
    if not (req.context_logits or req.taps):
        return out
    keep = len(req.input_ids) - reused_rows(result, req, cfg)
    if req.context_logits:
        if result.context_logits is None:
            raise ExecutorModelError(f"{cfg.name}: the executor returned no context logits; build the tapped target "
                                     "with --gather_context_logits (engines/build_engines.sh does)")
        out["context_logits"] = _suffix(_as_numpy(result.context_logits), keep)[None]  # [1, m, V]
    got = {a.name: a.output for a in (result.additional_outputs or ())}
    for tap in req.taps:
        t = got.get(CONTEXT_PREFIX + tap)
        if t is None:
            raise ExecutorModelError(f"{cfg.name}: the executor returned no {CONTEXT_PREFIX}{tap} (got {sorted(got)}); "
                                     "the engine is not the tapped target for these layers: rebuild it with "
                                     "engines/build_engines.sh (--tap_layers from the drafter)")
        out[tap] = _suffix(_as_numpy(t), keep)[None]  # [1, m, H]
    return out


class ExecutorBridge:
    """Requests in, replies out over an executor (tensorrt_llm.bindings.executor.Executor or any object with its
    enqueue_requests / await_responses / shutdown): `done(reply | ExecutorModelError)` is called once per request
    from the awaiter thread."""

    def __init__(self, executor: Any, tle: Any, cfg: ExecutorModelConfig, poll_ms: int = 1) -> None:
        self.executor, self.tle, self.cfg = executor, tle, cfg
        self._poll = datetime.timedelta(milliseconds=poll_ms)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[TargetRequest, Callable[[Any], None]]] = {}
        self._running = True
        self._thread = threading.Thread(target=self._await_loop, name=f"{cfg.name}-executor-responses", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def submit(self, reqs: Sequence[TargetRequest], done: Sequence[Callable[[Any], None]]) -> None:
        """Enqueue all at once (the executor batches them in flight with everything else it runs)."""
        if not reqs:
            return
        built = [executor_request(self.tle, r) for r in reqs]
        with self._lock:  # the awaiter maps ids under the lock: no response is looked up before it is registered
            try:
                ids = self.executor.enqueue_requests(built)
            except Exception as exc:  # noqa: BLE001 - the bindings raise RuntimeError subclasses
                err = ExecutorModelError(f"{self.cfg.name}: the executor refused the requests: {exc}")
                for cb in done:
                    cb(err)
                return
            for rid, req, cb in zip(ids, reqs, done):
                self._pending[int(rid)] = (req, cb)

    def _await_loop(self) -> None:
        while self._running:
            try:
                responses = self.executor.await_responses(timeout=self._poll)
            except Exception:  # noqa: BLE001 - keep serving; the error is logged
                log.exception("%s: await_responses failed", self.cfg.name)
                continue
            for resp in responses:
                rid = int(resp.request_id)
                with self._lock:
                    entry = self._pending.get(rid)
                    final = entry is not None and (resp.has_error() or bool(resp.result.is_final))
                    if final:
                        del self._pending[rid]
                if not final:
                    continue
                req, cb = entry  # type: ignore[misc]
                try:
                    reply: Any = reply_arrays(resp, req, self.cfg)
                except ExecutorModelError as exc:
                    reply = exc
                try:
                    cb(reply)
                except Exception:  # noqa: BLE001 - one failed send must not stop the others
                    log.exception("%s: sending a response failed", self.cfg.name)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=10)
        self.executor.shutdown()


class ExecutorTargetModel:
    """The Triton Python-backend `target` model over the executor bindings (pb set by 1/model.py). Not decoupled:
    one final response per request, sent from the awaiter thread through the request's response sender."""

    pb: Any = None  # triton_python_backend_utils
    bindings: Any = None  # tensorrt_llm.bindings.executor (imported in initialize when None)

    def initialize(self, args: dict[str, str]) -> None:
        if not logging.getLogger("dspark_trt").handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger("dspark_trt").addHandler(h)
            logging.getLogger("dspark_trt").setLevel(logging.INFO)
        self.cfg = ExecutorModelConfig.from_model_config(json.loads(args["model_config"])).with_engine_block_size()
        tle = self.bindings
        if tle is None:
            try:
                import tensorrt_llm.bindings.executor as tle  # noqa: PLC0415 - only on the GPU host
            except ImportError as exc:
                raise ExecutorModelError(f"{self.cfg.name}: tensorrt_llm.bindings.executor is not importable ({exc}); "
                                         "serve model_repo_trtllm/ in a TensorRT-LLM 1.2.x Triton container "
                                         "(docs/gpu.md)") from exc
        if not (self.cfg.engine_dir / "config.json").is_file():
            raise ExecutorModelError(f"{self.cfg.name}: no engine at {self.cfg.engine_dir} (config.json missing); "
                                     "run engines/build_engines.sh of the build first")
        executor = tle.Executor(str(self.cfg.engine_dir), tle.ModelType.DECODER_ONLY, executor_config(tle, self.cfg))
        self.bridge = ExecutorBridge(executor, tle, self.cfg)
        log.info("%s: tapped target %s over the executor bindings, taps %s, KV reuse %s (%d tokens per block)",
                 self.cfg.name, self.cfg.engine_dir, list(self.cfg.tap_names), self.cfg.enable_kv_cache_reuse,
                 self.cfg.tokens_per_block)

    def _arrays(self, request: Any) -> dict[str, np.ndarray]:
        out = {}
        for name in INPUT_NAMES:
            t = self.pb.get_input_tensor_by_name(request, name)
            if t is not None:
                out[name] = np.asarray(t.as_numpy())
        return out

    def _requested(self, request: Any) -> list[str] | None:
        try:
            return list(request.requested_output_names())
        except Exception:  # noqa: BLE001 - older python backends: every declared output
            return None

    def _sender(self, sender: Any) -> Callable[[Any], None]:
        pb = self.pb

        def send(reply: Any) -> None:
            if isinstance(reply, ExecutorModelError):
                resp = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(str(reply)))
            else:
                resp = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in reply.items()])
            sender.send(resp, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        return send

    def execute(self, requests: list[Any]) -> None:
        reqs, done = [], []
        for r in requests:
            send = self._sender(r.get_response_sender())
            try:
                reqs.append(parse_request(self._arrays(r), self._requested(r), self.cfg))
                done.append(send)
            except ExecutorModelError as exc:
                send(exc)
        self.bridge.submit(reqs, done)
        return None

    def finalize(self) -> None:
        bridge = getattr(self, "bridge", None)
        if bridge is not None:
            bridge.close()
