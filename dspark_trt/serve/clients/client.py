"""Client side of the served pipeline: `generate_remote` over HTTP (the generate / generate_stream endpoints) or
gRPC (unary infer, or a decoupled stream), returning the JSON shape of `dspark-trt generate --json`:
{"text": str, "token_ids": [int], "finish_reason": str | None, "stats": {...}} (finish_reason from the model's
`finish_reason` output: "eos" | "length" | "stop" | "stopped"; stats only with return_stats). Unstreamed requests
go to the non-decoupled `ensemble`, streamed ones to the decoupled `ensemble_stream` (same tensors;
docs/serving.md says why there are two).

Owns the request encoding (tensorrtllm_backend tensor names + ours: GenerationRequest, `infer_inputs`, shared
with serve.clients.aio_client and `dspark-trt load`), the response decoding and `stop_remote` (the `stop` input, one
of the two entry points of the stub's cancellation path; see serve.worker). Errors: the server's error message
comes back as RequestError (bad input) or ServeError (unreachable / failed server, a dead stub: SERVER_FAULTS).
"""
from __future__ import annotations

import json
import logging
import queue
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from dspark_trt.errors import RequestError, ServeError

log = logging.getLogger(__name__)

MODEL = "ensemble"  # non-decoupled: one response (HTTP/gRPC infer, /generate)
STREAM_MODEL = "ensemble_stream"  # decoupled: streamed responses (gRPC stream_infer, /generate_stream)
OUTPUTS = ("text_output", "output_ids", "finish_reason", "stats")  # what generate_remote asks the ensembles for


@dataclass(frozen=True)
class GenerationRequest:
    """One call's inputs (None = the server's default)."""

    prompt: str
    max_tokens: int = 64
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    random_seed: int | None = None
    stop_words: tuple[str, ...] = ()
    end_id: int | None = None
    policy: str | None = None
    min_k: int | None = None
    max_k: int | None = None
    apply_chat_template: bool | None = None
    return_stats: bool = True
    stop: bool = False
    proposers: str | None = None  # "dspark" | "suffix" | "dspark,suffix" | "none" (serve.validate.check_proposers)

    def fields(self) -> dict[str, Any]:
        """Input name → value, optional ones only when set (names as in the ensemble's config.pbtxt)."""
        out: dict[str, Any] = {"text_input": self.prompt, "max_tokens": int(self.max_tokens),
                               "stream": bool(self.stream), "return_stats": bool(self.return_stats)}
        for name in ("temperature", "top_p", "random_seed", "end_id", "policy", "min_k", "max_k",
                     "apply_chat_template", "proposers"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        if self.stop_words:
            out["stop_words"] = list(self.stop_words)
        if self.stop:
            out["stop"] = True
        return out


INPUT_TYPES = {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32",
           "random_seed": "UINT64", "stop_words": "BYTES", "end_id": "INT32", "policy": "BYTES", "min_k": "INT32",
           "max_k": "INT32", "return_stats": "BOOL", "apply_chat_template": "BOOL", "stop": "BOOL",
           "proposers": "BYTES"}
_NP = {"BYTES": np.object_, "INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32, "UINT64": np.uint64}


def input_array(name: str, value: Any) -> np.ndarray:
    """One ensemble input as the array tritonclient sends (dtype from INPUT_TYPES)."""
    dt = INPUT_TYPES[name]
    if dt == "BYTES":
        vals = value if isinstance(value, list) else [value]
        return np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in vals]], dtype=np.object_)  # [1, n]
    return np.array([[value]], dtype=_NP[dt])  # [1, 1]


class _Result:
    """Accumulates streamed (or single) responses."""

    def __init__(self, on_text: Callable[[str], None] | None) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.stats: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.on_text = on_text

    def add(self, text: str, ids: list[int], stats: str | None, finish_reason: str | None = None) -> None:
        if text:
            self.text.append(text)
            if self.on_text is not None:
                self.on_text(text)
        self.ids.extend(int(t) for t in ids)
        if stats:
            self.stats = json.loads(stats)
        if finish_reason:
            self.finish_reason = finish_reason

    def as_dict(self) -> dict[str, Any]:
        return {"text": "".join(self.text), "token_ids": self.ids, "finish_reason": self.finish_reason,
                "stats": self.stats}


# What an error of a failed server (not of the request) says: our models' own markers
# (serve.triton.stub.SERVER_SIDE_MARKERS) and Triton's for a dead python stub or a server that went away mid-request
# (docs/serving.md, Faults).
SERVER_FAULTS = ("internal error", "shutting down", "unloaded", "generation failed", "is not healthy",
                 "Socket closed", "Stream removed", "failed to connect", "Connection reset")


def _raise(message: str, status: int | None = None) -> None:
    if any(m in message for m in SERVER_FAULTS):
        raise ServeError(f"server error: {message}")
    raise RequestError(message)


def _sse_events(resp: Any) -> Iterator[dict[str, Any]]:
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data:"):
            yield json.loads(line[5:].strip())


def _first(v: Any) -> Any:
    while isinstance(v, list) and len(v) == 1 and not isinstance(v[0], int):
        v = v[0]
    return v


def _http(url: str, req: GenerationRequest, model: str, timeout: float, on_text: Callable[[str], None] | None,
          request_id: str) -> dict[str, Any]:
    import requests  # noqa: PLC0415

    base = url if url.startswith("http") else f"http://{url}"
    endpoint = f"{base}/v2/models/{model}/{'generate_stream' if req.stream else 'generate'}"
    res = _Result(on_text)
    try:
        body = dict(req.fields(), id=request_id)
        with requests.post(endpoint, json=body, stream=req.stream, timeout=timeout) as r:
            if not req.stream:
                body = r.json()
                if "error" in body:
                    _raise(body["error"], r.status_code)
                ids = body.get("output_ids", [])
                res.add(_text(body.get("text_output", "")), ids if isinstance(ids, list) else [ids],
                        body.get("stats"), _text(body.get("finish_reason")))
                return res.as_dict()
            for ev in _sse_events(r):
                if "error" in ev:
                    _raise(ev["error"], r.status_code)
                ids = ev.get("output_ids", [])
                res.add(_text(ev.get("text_output", "")), ids if isinstance(ids, list) else [ids], ev.get("stats"),
                        _text(ev.get("finish_reason")))
    except requests.ConnectionError as exc:
        raise ServeError(f"cannot reach Triton at {base} ({exc}); start it with `dspark-trt serve`") from exc
    return res.as_dict()


def _text(v: Any) -> str:
    v = _first(v)
    if isinstance(v, list):
        return "".join(str(x) for x in v)
    return "" if v is None else str(v)


def infer_inputs(module: Any, fields: dict[str, Any]) -> list[Any]:
    """`fields` (input name → value, as GenerationRequest.fields()) as InferInputs of `module` (tritonclient.grpc,
    .grpc.aio or .http)."""
    inputs = []
    for name, value in fields.items():
        arr = input_array(name, value)
        t = module.InferInput(name, list(arr.shape), INPUT_TYPES[name])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _add_result(res: _Result, result: Any) -> None:
    text = result.as_numpy("text_output")
    ids = result.as_numpy("output_ids")
    stats = result.as_numpy("stats")
    reason = result.as_numpy("finish_reason")
    res.add("".join(x.decode("utf-8") for x in text.reshape(-1)) if text is not None else "",
            [] if ids is None else [int(t) for t in ids.reshape(-1)],
            stats.reshape(-1)[0].decode("utf-8") if stats is not None and stats.size else None,
            reason.reshape(-1)[0].decode("utf-8") if reason is not None and reason.size else None)


def _grpc(url: str, req: GenerationRequest, model: str, timeout: float, on_text: Callable[[str], None] | None,
          request_id: str) -> dict[str, Any]:
    """Unstreamed: one unary ModelInfer; streamed: a bidirectional stream until the final response."""
    import tritonclient.grpc as grpcclient  # noqa: PLC0415
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(url)
    inputs = infer_inputs(grpcclient, req.fields())
    outputs = [grpcclient.InferRequestedOutput(n) for n in OUTPUTS]
    res = _Result(on_text)
    if not req.stream:
        try:
            _add_result(res, client.infer(model, inputs, outputs=outputs, request_id=request_id,
                                          client_timeout=timeout))
        except InferenceServerException as exc:
            _raise_grpc(exc, url)
        finally:
            client.close()
        return res.as_dict()
    q: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer(model, inputs, outputs=outputs, request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            try:
                result, error = q.get(timeout=timeout)
            except queue.Empty as exc:
                raise ServeError(f"no response from {url} within {timeout:.0f} s") from exc
            if error is not None:
                _raise(error.message() if hasattr(error, "message") else str(error))
            final = result.get_response().parameters.get("triton_final_response")
            _add_result(res, result)
            if final is not None and final.bool_param:
                break
    except InferenceServerException as exc:
        raise ServeError(f"gRPC call to {url} failed: {exc.message()}; is `dspark-trt serve` running?") from exc
    finally:
        client.stop_stream()
        client.close()
    return res.as_dict()


def _raise_grpc(exc: Any, url: str) -> None:
    """A unary call's failure: the model's own error (RequestError / ServeError), or an unreachable server."""
    status = str(exc.status() or "")
    if "UNAVAILABLE" in status or "DEADLINE" in status:
        raise ServeError(f"gRPC call to {url} failed: {exc.message()}; is `dspark-trt serve` running?") from exc
    _raise(exc.message(), 500 if "INTERNAL" in status else None)


def generate_remote(url: str, prompt: str, max_tokens: int = 64, protocol: str = "http", stream: bool = False,
                    policy: str | None = None, min_k: int | None = None, max_k: int | None = None,
                    temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                    stop_words: tuple[str, ...] | list[str] = (), end_id: int | None = None,
                    apply_chat_template: bool | None = None, model: str | None = None, timeout: float = 600.0,
                    on_text: Callable[[str], None] | None = None, request_id: str | None = None,
                    proposers: str | None = None) -> dict[str, Any]:
    """Generate through a running server's ensemble → {"text", "token_ids", "finish_reason", "stats"}.

    url is HOST:PORT (the HTTP port for protocol "http", the gRPC port for "grpc"); model defaults to `ensemble`
    (one response) or, with stream, `ensemble_stream`; on_text receives each streamed piece of text as it
    arrives; request_id (default: a fresh uuid) is what stop_remote() targets; proposers: who proposes this
    request's drafts ("dspark", "suffix", "dspark,suffix", "none"; None = the server's DSPARK_PROPOSERS).
    """
    if protocol not in ("http", "grpc"):
        raise RequestError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, stream=stream, temperature=temperature,
                            top_p=top_p, random_seed=seed, stop_words=tuple(stop_words), end_id=end_id,
                            policy=policy, min_k=min_k, max_k=max_k, apply_chat_template=apply_chat_template,
                            proposers=proposers)
    fn = _http if protocol == "http" else _grpc
    name = model or (STREAM_MODEL if stream else MODEL)
    return fn(url, req, name, timeout, on_text, request_id or uuid.uuid4().hex)


def stop_remote(url: str, request_id: str, protocol: str = "grpc", model: str = MODEL, timeout: float = 60.0) -> None:
    """End the in-flight request `request_id` (its KV slot is freed; it gets its final response with the tokens so
    far and finish_reason "stopped"). tensorrtllm_backend's `stop` input: a request with stop=true and the same id;
    the `dspark` stub ends it through the same cancellation path as a cancelled request (serve.worker). Use this
    rather than closing the stream: Triton 2.51 does not pass a client's cancel into an ensemble's running step."""
    req = GenerationRequest(prompt="stop", max_tokens=1, stop=True, return_stats=False)
    fn = _http if protocol == "http" else _grpc
    fn(url, req, model, timeout, None, request_id)
