"""Request validation for the served pipeline: every bad input becomes a RequestError that names the problem
and the fix (the Triton adapters turn it into an error response; the server keeps serving).

Owns: ServeLimits (the build's limits, from config.pbtxt parameters), GenerationParams (one request's checked
parameters), `decode_text`, `check_request_parameters`, `parse_generation`, `to_loop_request`. Knows the tensor
names of the `dspark` model's optional inputs; knows nothing of Triton itself (plain numpy in, dataclasses out).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from dspark_trt.errors import InvalidArgumentError, RequestError
from dspark_trt.spec_decode.limits import request_room  # torch-free
from dspark_trt.spec_decode.policies import POLICIES, resolve_policy_alias  # torch-free
from dspark_trt.spec_decode.sampling import check_sampling  # torch-free

# Inputs of the ensemble (tensorrtllm_backend names + ours); anything else is unknown.
KNOWN_INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words", "end_id",
                "policy", "min_k", "max_k", "return_stats", "stop", "apply_chat_template")

# Request parameters we accept: "id" = the request id over the HTTP generate endpoints (which pass unknown JSON
# keys as parameters and have no request-id field); a `stop` request targets it.
KNOWN_PARAMETERS = ("id",)


def request_key(request_id: str, params_json: str | None) -> str:
    """The id a `stop` request targets: the Triton request id, else the "id" request parameter."""
    if request_id:
        return request_id
    params = json.loads(params_json) if params_json else {}
    return str(params.get("id", ""))


@dataclass(frozen=True)
class ServeLimits:
    """What the build allows (template keys MAX_SEQ_LEN, MAX_BATCH_SIZE, GAMMA, POLICY, MIN_K, MAX_K, MAX_QUEUE), as
    serve.pipeline.ServeConfig.limits(vocab_size) makes it from the one parse of config.pbtxt."""

    max_seq_len: int
    max_batch: int
    gamma: int
    vocab_size: int
    policy: str = "survival"
    min_k: int = 2
    max_k: int = 8
    max_queue: int = 64


@dataclass(frozen=True)
class GenerationParams:
    """One request's checked generation parameters."""

    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    policy: str = "survival"
    min_k: int = 2
    max_k: int = 8
    return_stats: bool = False
    stop_sequences: tuple[tuple[int, ...], ...] = ()


def decode_text(raw: object, what: str = "text_input") -> str:
    """bytes/str → str; bad UTF-8 raises RequestError naming the byte offset."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, (bytes, bytearray, np.bytes_)):
        raise RequestError(f"{what} must be a string (BYTES tensor), got {type(raw).__name__}")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 encoded "
                           "text") from exc


def check_request_parameters(params_json: str | Mapping[str, object] | None) -> None:
    """Triton request parameters (the generate endpoint turns unknown JSON keys into these) must be empty."""
    if not params_json:
        return
    params = json.loads(params_json) if isinstance(params_json, str) else dict(params_json)
    unknown = sorted(k for k in params if not k.startswith("triton_") and k not in KNOWN_PARAMETERS)
    if unknown:
        raise RequestError(f"unknown parameter(s) {', '.join(map(repr, unknown))}; known inputs are "
                           f"{', '.join(KNOWN_INPUTS)}")


def single(inputs: Mapping[str, np.ndarray | None], name: str) -> object | None:
    """The one element of an optional input ([1] or [1, 1]); None if absent; RequestError if several."""
    arr = inputs.get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name} must hold exactly one value per request, got shape {tuple(np.shape(arr))}; "
                           "send one prompt per request (concurrent requests are batched in flight)")
    return flat[0]


def _int(inputs: Mapping[str, np.ndarray | None], name: str) -> int | None:
    v = single(inputs, name)
    if v is None:
        return None
    if isinstance(v, (float, np.floating)) and not float(v).is_integer():
        raise RequestError(f"{name} must be an integer, got {v}")
    return int(v)


def _float(inputs: Mapping[str, np.ndarray | None], name: str) -> float | None:
    v = single(inputs, name)
    if v is None:
        return None
    out = float(v)
    if not math.isfinite(out):
        raise RequestError(f"{name} must be a finite number, got {out}")
    return out


def parse_generation(inputs: Mapping[str, np.ndarray | None], prompt_len: int, limits: ServeLimits,
                     stop_sequences: tuple[tuple[int, ...], ...] = ()) -> GenerationParams:
    """Check the `dspark` model's inputs for one request against the build's limits."""
    max_tokens = _int(inputs, "max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens is required (INT32, ≥ 1)")
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be ≥ 1, got {max_tokens}")
    if prompt_len < 1:
        raise RequestError("the prompt is empty; send a non-empty text_input")
    room = request_room(limits.max_seq_len, limits.gamma)
    if prompt_len + max_tokens > room:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the {room} tokens this build allows "
            f"(MAX_SEQ_LEN {limits.max_seq_len} − γ {limits.gamma} − 1); shorten the prompt or lower max_tokens, or "
            "rebuild with a larger --max-seq-len")
    temperature = _float(inputs, "temperature")
    temperature = 0.0 if temperature is None else temperature
    top_p = _float(inputs, "top_p")
    top_p = 1.0 if top_p is None else top_p
    seed = _int(inputs, "random_seed")
    try:
        check_sampling(temperature, top_p, seed, names={"seed": "random_seed"})
    except InvalidArgumentError as exc:
        raise RequestError(str(exc)) from exc
    end_id = _int(inputs, "end_id")
    if end_id is not None and not 0 <= end_id < limits.vocab_size:
        raise RequestError(f"end_id must be a token id in [0, {limits.vocab_size}), got {end_id}")
    raw_policy = single(inputs, "policy")
    policy = limits.policy if raw_policy is None else decode_text(raw_policy, "policy").strip().lower()
    policy = resolve_policy_alias(policy)
    if policy not in POLICIES:
        raise RequestError(f"policy must be one of {', '.join(POLICIES)} (\"seed\" = \"confidence\"), got {policy!r}")
    min_k = _int(inputs, "min_k")
    max_k = _int(inputs, "max_k")
    min_k = limits.min_k if min_k is None else min_k
    max_k = limits.max_k if max_k is None else max_k
    if not 0 <= min_k <= max_k <= limits.gamma:
        raise RequestError(f"need 0 ≤ min_k ≤ max_k ≤ γ ({limits.gamma}), got min_k={min_k}, max_k={max_k}")
    if policy == "confidence" and min_k < 1:
        raise RequestError(f"min_k must be ≥ 1 for the confidence policy, got {min_k}; use policy \"plain\" for K = 0")
    stream = single(inputs, "stream")
    stats = single(inputs, "return_stats")
    return GenerationParams(max_tokens=max_tokens, stream=bool(stream) if stream is not None else False,
                            temperature=temperature, top_p=top_p, seed=seed, end_id=end_id, policy=policy,
                            min_k=min_k, max_k=max_k, return_stats=bool(stats) if stats is not None else False,
                            stop_sequences=stop_sequences)


def policy_config(params: GenerationParams):  # noqa: ANN201 - dspark_trt.spec_decode.scheduler.PolicyConfig
    """The loop's PolicyConfig for a request (fixed verifies max_k every round)."""
    from dspark_trt.spec_decode.scheduler import PolicyConfig  # noqa: PLC0415 - torch only where the loop runs

    try:
        return PolicyConfig(policy=params.policy, k=params.max_k, min_k=params.min_k, max_k=params.max_k)
    except InvalidArgumentError as exc:
        raise RequestError(str(exc)) from exc


def to_loop_request(prompt_ids: tuple[int, ...], params: GenerationParams, eos_ids: tuple[int, ...]):  # noqa: ANN201
    """→ dspark_trt.spec_decode.loop.Request (end_id, when given, replaces the model's eos ids)."""
    from dspark_trt.spec_decode.loop import Request  # noqa: PLC0415
    from dspark_trt.spec_decode.protocols import SamplingParams  # noqa: PLC0415

    eos = (params.end_id,) if params.end_id is not None else tuple(eos_ids)
    try:
        return Request(prompt_ids=tuple(int(t) for t in prompt_ids), max_new_tokens=params.max_tokens,
                       sampling=SamplingParams(params.temperature, params.top_p, params.seed),
                       policy=policy_config(params), eos_ids=eos, stop_sequences=params.stop_sequences)
    except InvalidArgumentError as exc:
        raise RequestError(str(exc)) from exc
