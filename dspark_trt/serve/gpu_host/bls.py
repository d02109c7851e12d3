"""The BLS side of the GPU-host repository (model_repo_trtllm/): EngineCalls as tensorrtllm requests over pb_utils.

Owns: the tensor names / dtypes / shapes of the requests we send to a `tensorrtllm` model and the outputs we read
(TensorRT-LLM 1.2.x triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt; checked by
tests/builder/test_trtllm_serving_contract.py: `call_tensors`, `reply_from_arrays`) and PbEngineClient (the
serve.gpu_host.rounds.EngineClient of the stub: one pb_utils.InferenceRequest per EngineCall, all of a fan-out
issued at once with async_exec so Triton's dynamic batcher hands them to the in-flight batcher together). The
model that uses it is serve.gpu_host.dspark.TrtllmDsparkModel.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from dspark_trt.serve.gpu_host.rounds import EngineCall, EngineReply

log = logging.getLogger(__name__)

__all__ = ["INPUT_DTYPES", "OUTPUT_NAMES", "PbEngineClient", "call_tensors", "reply_from_arrays"]

# What we send: name → numpy dtype; every tensor is [1, n] (batch 1; scalars [1, 1]).
INPUT_DTYPES: dict[str, type] = {
    "input_ids": np.int32,  # [1, T] the committed sequence
    "input_lengths": np.int32,  # [1, 1] T
    "request_output_len": np.int32,  # [1, 1] tokens to return (K + 1 for a verify)
    "draft_input_ids": np.int32,  # [1, K] external draft tokens (verify with K ≥ 1 only)
    "exclude_input_in_output": np.bool_,  # [1, 1] True: output_ids holds only the new tokens
    "return_generation_logits": np.bool_,  # [1, 1] the target's logits of the returned tokens (always sent: a
    # fan-out's requests then carry the same inputs but draft_input_ids, which Triton's dynamic batcher needs)
    "return_context_logits": np.bool_,  # [1, 1] the tapped target (DSpark): logits of the computed input rows
    "temperature": np.float32,  # [1, 1] sampled requests only
    "runtime_top_p": np.float32,  # [1, 1] sampled requests only
    "seed": np.uint64,  # [1, 1] sampled requests with a seed only
}
# What we read: output_ids [1, beam=1, n] INT32, sequence_length [1, 1] INT32, generation_logits [1, 1, n, V] FP32,
# context_logits [1, n, V] FP32 and (the tapped target) dspark_tap_<layer> [1, n, H].
OUTPUT_NAMES: tuple[str, ...] = ("output_ids", "sequence_length", "generation_logits", "context_logits")


def call_tensors(call: EngineCall) -> dict[str, np.ndarray]:
    """EngineCall → {tensorrtllm input name: array} with the shapes and dtypes above."""
    def scalar(name: str, value: object) -> np.ndarray:
        return np.array([[value]], dtype=INPUT_DTYPES[name])

    t = {"input_ids": np.asarray([call.input_ids], dtype=np.int32),  # [1, T]
         "input_lengths": scalar("input_lengths", len(call.input_ids)),
         "request_output_len": scalar("request_output_len", call.output_len),
         "exclude_input_in_output": scalar("exclude_input_in_output", True)}
    if call.draft_ids:
        t["draft_input_ids"] = np.asarray([call.draft_ids], dtype=np.int32)  # [1, K]
    t["return_generation_logits"] = scalar("return_generation_logits", call.return_logits)  # always, as the BLS does
    if call.context_logits:
        t["return_context_logits"] = scalar("return_context_logits", True)
    if call.temperature > 0:
        t["temperature"] = scalar("temperature", call.temperature)
        t["runtime_top_p"] = scalar("runtime_top_p", call.top_p)
        if call.seed is not None:
            t["seed"] = scalar("seed", call.seed)
    return t


def reply_from_arrays(output_ids: np.ndarray, sequence_length: np.ndarray | None, logits: np.ndarray | None,
                      context_logits: np.ndarray | None = None,
                      taps: dict[str, np.ndarray] | None = None) -> EngineReply:
    """output_ids [1, 1, n] (+ sequence_length [1, 1], generation_logits [1, 1, n, V], context_logits [1, m, V],
    taps name → [1, m, H]) → EngineReply."""
    ids = np.asarray(output_ids).reshape(-1)  # beam 1, batch 1
    n = len(ids) if sequence_length is None else min(len(ids), int(np.asarray(sequence_length).reshape(-1)[0]))
    lg = None
    if logits is not None and np.asarray(logits).size:
        arr = np.asarray(logits, dtype=np.float32)
        lg = arr.reshape(-1, arr.shape[-1])[:n]  # [n, V]
    ctx = None
    if context_logits is not None and np.asarray(context_logits).size:
        arr = np.asarray(context_logits, dtype=np.float32)
        ctx = arr.reshape(-1, arr.shape[-1])  # [m, V]
    rows = None if taps is None else {k: np.asarray(v, dtype=np.float32).reshape(-1, np.asarray(v).shape[-1])
                                      for k, v in taps.items()}  # name → [m, H]
    return EngineReply([int(x) for x in ids[:n]], lg, context_logits=ctx, taps=rows)


def _as_array(tensor: object) -> np.ndarray:
    """A pb_utils.Tensor → numpy (BF16 outputs have no numpy dtype: through DLPack as float32)."""
    try:
        return tensor.as_numpy()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - pb_utils raises a generic error for BF16
        import torch  # noqa: PLC0415

        return torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).float().cpu().numpy()  # type: ignore[attr-defined]


class PbEngineClient:
    """EngineClient over pb_utils BLS: a fan-out's requests run concurrently (async_exec on a thread pool of
    `concurrency` workers), so they reach the tensorrtllm model together."""

    def __init__(self, pb: Any, concurrency: int) -> None:
        self.pb = pb
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="dspark-bls")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)  # async_exec runs exec() in the loop's default executor

    def _request(self, model: str, call: EngineCall) -> Any:
        inputs = [self.pb.Tensor(name, arr) for name, arr in call_tensors(call).items()]
        outputs = [n for n in OUTPUT_NAMES if (n != "generation_logits" or call.return_logits)
                   and (n != "context_logits" or call.context_logits)] + list(call.taps)
        return self.pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                        request_id=call.request_id)

    def _reply(self, model: str, resp: Any, call: EngineCall) -> EngineReply:
        if isinstance(resp, BaseException):
            return EngineReply([], error=f"{model}: {type(resp).__name__}: {resp}")
        if resp.has_error():
            return EngineReply([], error=f"{model}: {resp.error().message()}")

        def out(name: str) -> np.ndarray | None:
            t = self.pb.get_output_tensor_by_name(resp, name)
            return None if t is None else _as_array(t)

        ids = out("output_ids")
        if ids is None:
            return EngineReply([], error=f"{model} returned no output_ids")
        taps = {n: out(n) for n in call.taps}
        missing = [n for n, v in taps.items() if v is None]
        if missing:
            return EngineReply([], error=f"{model} returned no {', '.join(missing)}: the engine is not the tapped "
                                         "target, or its backend does not forward additional outputs (docs/gpu.md)")
        return reply_from_arrays(ids, out("sequence_length"), out("generation_logits"),
                                 out("context_logits") if call.context_logits else None,
                                 taps if call.taps else None)  # type: ignore[arg-type]

    def generate(self, model: str, calls: Sequence[EngineCall]) -> list[EngineReply]:
        reqs = [self._request(model, c) for c in calls]

        async def fan_out() -> list[Any]:
            return await asyncio.gather(*(r.async_exec() for r in reqs), return_exceptions=True)

        return [self._reply(model, r, c) for r, c in zip(self._loop.run_until_complete(fan_out()), calls)]

    def close(self) -> None:
        self._loop.close()
        self._pool.shutdown(wait=False)
