#!/usr/bin/env python3
"""Property-based fuzzing (hypothesis) of the served API against REAL servers: OpenAI request bodies (wrong types,
out-of-range numbers, unicode with lone surrogates and invalid UTF-8 bytes, empty and huge values, nested junk,
unparsable JSON) to /v1/completions and /v1/chat/completions, and Triton requests — gRPC input tensors of any
dtype, shape and range (empty ones too) to `ensemble`, `ensemble_stream`, `dspark`, `target`, `draft`, and
JSON bodies to the HTTP generate / infer endpoints. The properties, per request:

- no 5xx for bad input (OpenAI: HTTP status < 500 and the OpenAI error shape; Triton gRPC: no INTERNAL / UNKNOWN
  status and no "internal error" message from a model). Exception, counted apart: the 500s Triton 2.51's own HTTP
  JSON parser gives for bodies it cannot map onto tensors (TRITON_CORE_500), before any model sees them;
- no hang: every request finishes within REQUEST_TIMEOUT_S;
- the next good request is answered correctly: a greedy completion equal to the reference answer.

    .venv/bin/python scripts/fuzz_api.py --minutes 30                       # builds the tiny test pair, own servers
    .venv/bin/python scripts/fuzz_api.py --minutes 30 --repo build/default/model_repo
    .venv/bin/python scripts/fuzz_api.py --minutes 5 --openai-url http://127.0.0.1:9000/v1 --triton-grpc \\
        127.0.0.1:8001 --triton-http 127.0.0.1:8000                         # servers started elsewhere

It prints the requests by surface and status (e.g. `openai 400: 1234`) and every failure, and exits 1 if any
property failed. tests/serve/test_fuzz_api.py runs the same properties bounded (derandomized, ~60 s in all) in CI.
"""
from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

log = logging.getLogger("fuzz_api")

REQUEST_TIMEOUT_S = 60.0  # a request (streamed or not) must be answered within this
GOOD_PROMPT, GOOD_TOKENS = "def main(argv):", 4
# Error messages of Triton 2.51's own HTTP frontend answering a body it cannot map onto tensors with HTTP 500, before
# any model runs (not ours to change; docs/serving.md "Limits"): counted apart, never a property failure.
TRITON_CORE_500 = ("failed to parse the request JSON buffer", "Unable to parse ", "attempt to ",
                   "failed to get request params", "Expected JSON object for keyword", "parameter key ",
                   "Converting keyword")
INTERNAL_MARKERS = ("internal error", "Stub process", "Traceback", "unexpected error")
POLICIES = ("plain", "fixed", "confidence", "survival", "seed", "bogus", " Fixed ", "")
SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
            HealthCheck.large_base_example]

# ---- strategies -----------------------------------------------------------------------------------------------
surrogate = st.integers(0xD800, 0xDFFF).map(chr)
any_char = st.one_of(st.characters(exclude_categories=()), surrogate,
                     st.sampled_from(["\x00", "\u2028", "\ufeff", "\U0010ffff", "\ufffd", "\n", "é"]))
huge_text = st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "\U0001f600", " ", "def f(): pass\n"]),
                      st.sampled_from([300, 5000, 90_000, 1_100_000]))
texts = st.one_of(st.text(max_size=30), st.text(alphabet=any_char, max_size=30),
                  st.sampled_from(["", " ", "\n", "def main(", "<|im_start|>", "\x00", "null", "tiny"]))
prompts = st.one_of(texts, texts, texts, texts, huge_text)  # where a long text matters: prompts, contents, stops
numbers = st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70),
                    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e-300]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
junk = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                    st.dictionaries(texts, kids, max_size=4)), max_leaves=10)
small_tokens = st.integers(1, 4)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly `valid`, sometimes junk of any type."""
    return st.one_of(valid, valid, valid, junk)


def _common(model: str) -> dict[str, st.SearchStrategy[Any]]:
    return {"model": st.one_of(st.just(model), st.just(model), st.just(model), texts, junk),
            "max_tokens": st.one_of(small_tokens, small_tokens, small_tokens, numbers, junk)}


def _optional() -> dict[str, st.SearchStrategy[Any]]:
    return {"temperature": _maybe(st.sampled_from([0, 0.0, 0.7, 2, 2.5, -0.1])), "top_p": _maybe(numbers),
            "seed": _maybe(numbers), "stream": _maybe(st.booleans()),
            "stream_options": _maybe(st.fixed_dictionaries({"include_usage": _maybe(st.booleans())})),
            "stop": _maybe(st.one_of(prompts, st.lists(prompts, max_size=6))), "n": _maybe(st.sampled_from([1, 2, 0])),
            "logit_bias": _maybe(st.dictionaries(st.text(max_size=3), numbers, max_size=2)),
            "presence_penalty": _maybe(numbers), "frequency_penalty": _maybe(numbers), "user": _maybe(texts),
            "policy": _maybe(st.sampled_from(POLICIES)), "min_k": _maybe(st.integers(-1, 6)),
            "max_k": _maybe(st.integers(-1, 6)), "return_stats": _maybe(st.booleans()),
            "tools": _maybe(st.lists(junk, max_size=2)), "response_format": _maybe(junk), "echo": _maybe(st.booleans()),
            "logprobs": _maybe(st.one_of(st.booleans(), st.integers(0, 5))), "best_of": _maybe(st.integers(0, 3)),
            "suffix": _maybe(texts)}


def _with_extra(body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    extra = st.dictionaries(texts, junk, max_size=3)
    return st.one_of(body, body, body, st.builds(lambda b, e: {**e, **b}, body, extra), junk)


def completion_bodies(model: str) -> st.SearchStrategy[Any]:
    prompt = st.one_of(st.sampled_from(["def main(", "import os", "x"]), prompts,
                       st.lists(st.integers(-5, 600), max_size=8), st.lists(texts, max_size=3),
                       st.lists(st.lists(st.integers(0, 511), max_size=4), max_size=2), junk)
    return _with_extra(st.fixed_dictionaries({**_common(model), "prompt": prompt}, optional=_optional()))


def chat_bodies(model: str) -> st.SearchStrategy[Any]:
    role = st.one_of(st.sampled_from(["user", "user", "system", "assistant", "developer", "tool"]), texts)
    part = st.fixed_dictionaries({"type": st.one_of(st.just("text"), texts)}, optional={"text": _maybe(prompts)})
    content = st.one_of(st.sampled_from(["Hi!", "def main("]), prompts, st.lists(part, max_size=3), st.none(), junk)
    message = _maybe(st.fixed_dictionaries({"role": role, "content": content}, optional={"name": _maybe(texts)}))
    messages = st.one_of(st.lists(message, min_size=1, max_size=3), st.just([]), junk)
    optional = {**_optional(), "max_completion_tokens": _maybe(small_tokens)}
    return _with_extra(st.fixed_dictionaries({**_common(model), "messages": messages}, optional=optional))


def encoded(bodies: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """A body as bytes: JSON (ASCII-escaped, or raw UTF-8 with lone surrogates as invalid bytes), sometimes with
    random bytes spliced in, or no JSON at all (deep nesting, truncation, binary)."""
    def dump(obj: Any, ascii_only: bool) -> bytes:
        return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")

    def splice(raw: bytes, at: int, junk_bytes: bytes) -> bytes:
        at %= len(raw) + 1
        return raw[:at] + junk_bytes + raw[at:]

    plain = st.builds(dump, bodies, st.booleans())
    spliced = st.builds(splice, plain, st.integers(0, 2**16), st.binary(min_size=1, max_size=8))
    raw = st.one_of(st.binary(max_size=64), st.builds(lambda d: b"[" * d + b"]" * d, st.sampled_from([10, 10_000])),
                    plain.map(lambda b: b[: len(b) // 2]))
    return st.one_of(plain, plain, plain, plain, spliced, raw)


# Triton: gRPC tensors and HTTP JSON
DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32,
          "FP64": np.float64, "BYTES": np.object_}
VALID = {"text_input": ("BYTES", [[b"def main("]]), "max_tokens": ("INT32", [[3]]), "input_ids": ("INT32", [[5, 6, 7]]),
         "input_lengths": ("INT32", [3]), "gamma": ("INT32", [2])}
MODELS = {"ensemble": ("text_input", "max_tokens"), "ensemble_stream": ("text_input", "max_tokens"),
          "dspark": ("input_ids", "max_tokens"), "target": ("input_ids", "input_lengths"),
          "draft": ("input_ids", "input_lengths", "gamma")}
INPUT_NAMES = ("text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words", "end_id",
               "policy", "min_k", "max_k", "return_stats", "stop", "apply_chat_template", "input_ids",
               "stop_words_ids", "input_lengths", "gamma")
byte_values = st.one_of(texts.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=12))


@st.composite
def tensor(draw: Callable[..., Any], name: str | None = None) -> tuple[str, str, np.ndarray]:
    """(name, datatype, array): any dtype, a shape of up to 3 dims (0 allowed), values across the dtype's range."""
    name = name if name is not None else draw(st.one_of(st.sampled_from(INPUT_NAMES), st.text("abcz_", max_size=6)))
    dt = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape)) if shape else 1
    if dt == "BYTES":
        arr = np.array(draw(st.lists(byte_values, min_size=n, max_size=n)), dtype=np.object_).reshape(shape)
    elif dt == "BOOL":
        arr = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_).reshape(shape)
    else:
        np_dt = np.dtype(DTYPES[dt])
        if np_dt.kind == "f":
            vals = draw(st.lists(st.floats(width=8 * np_dt.itemsize, allow_nan=True), min_size=n, max_size=n))
        else:
            info = np.iinfo(np_dt)
            vals = draw(st.lists(st.one_of(st.integers(-3, 600), st.integers(int(info.min), int(info.max))),
                                 min_size=n, max_size=n).map(lambda v: [min(max(x, info.min), info.max) for x in v]))
        arr = np.array(vals, dtype=np_dt).reshape(shape)
    return name, dt, arr


GEN_TYPES = {"max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32", "random_seed": "UINT64",
             "end_id": "INT32", "policy": "BYTES", "min_k": "INT32", "max_k": "INT32", "return_stats": "BOOL",
             "stop": "BOOL"}  # the generation inputs of ensemble / ensemble_stream / dspark, their config dtypes
TYPED = {"ensemble": {**GEN_TYPES, "stop_words": "BYTES", "apply_chat_template": "BOOL"},
         "dspark": {**GEN_TYPES, "stop_words_ids": "INT32"}, "target": {}, "draft": {"gamma": "INT32"}}
TYPED["ensemble_stream"] = TYPED["ensemble"]


@st.composite
def typed_tensor(draw: Callable[..., Any], name: str, dt: str) -> tuple[str, str, np.ndarray]:
    """An input of its config dtype and shape ([1, 1]; stop_words [1, n]; stop_words_ids [1, 2, n]), any value."""
    if dt == "BYTES":
        vals = draw(st.one_of(st.sampled_from(POLICIES).map(lambda p: p.encode()), byte_values)) if name == "policy" \
            else draw(byte_values)
        n = draw(st.integers(0, 6)) if name == "stop_words" else 1
        return name, dt, np.array([[vals] * n], dtype=np.object_)
    if name == "stop_words_ids":
        n = draw(st.integers(0, 5))
        vals = draw(st.lists(st.integers(-2, 600), min_size=2 * n, max_size=2 * n))
        return name, dt, np.array(vals, dtype=np.int32).reshape(1, 2, n)
    np_dt = np.dtype(DTYPES[dt])
    if dt == "BOOL":
        v: Any = draw(st.booleans())
    elif np_dt.kind == "f":
        v = draw(st.one_of(st.floats(width=32, allow_nan=True), st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0])))
    else:
        info = np.iinfo(np_dt)
        v = draw(st.one_of(st.integers(-3, 300), st.integers(int(info.min), int(info.max))))
        v = min(max(v, int(info.min)), int(info.max))
    return name, dt, np.array([[v]], dtype=np_dt)


@st.composite
def triton_requests(draw: Callable[..., Any], models: tuple[str, ...] = tuple(MODELS)
                    ) -> tuple[str, list[tuple[str, str, np.ndarray]]]:
    """(model, inputs): the model's valid inputs, some of its other inputs of the right dtype with any value, some
    replaced by random tensors (any dtype / shape), some dropped, some unknown ones added."""
    model = draw(st.sampled_from(sorted(models)))
    inputs = {}
    for name in MODELS[model]:
        dt, data = VALID[name]
        inputs[name] = (name, dt, np.array(data, dtype=DTYPES[dt]))
    typed = TYPED[model]
    for name in draw(st.lists(st.sampled_from(sorted(typed)), max_size=4, unique=True)) if typed else []:
        inputs[name] = draw(typed_tensor(name, typed[name]))
    for name in draw(st.lists(st.sampled_from(MODELS[model]), max_size=2, unique=True)):
        if draw(st.booleans()):
            inputs[name] = draw(tensor(name))
        else:
            del inputs[name]
    for extra in draw(st.lists(tensor(), max_size=3)):
        inputs[extra[0]] = extra
    return model, list(inputs.values())


GENERATE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "text_input": st.one_of(st.sampled_from(["def main(", "x"]), prompts), "max_tokens": st.one_of(small_tokens, numbers),
    "stream": st.booleans(), "temperature": numbers, "top_p": numbers, "random_seed": numbers,
    "stop_words": st.one_of(prompts, st.lists(prompts, max_size=6)), "end_id": numbers,
    "policy": st.sampled_from(POLICIES), "min_k": st.integers(-1, 6), "max_k": st.integers(-1, 6),
    "return_stats": st.booleans(), "stop": st.booleans(), "apply_chat_template": st.booleans(),
    "id": texts, "parameters": st.dictionaries(texts, scalars, max_size=2)}


def generate_bodies() -> st.SearchStrategy[Any]:
    """JSON for /v2/models/{ensemble,ensemble_stream}/generate[_stream]: the inputs by name (mostly of their type,
    out of range; sometimes any JSON), unknown keys."""
    required = ("text_input", "max_tokens")
    body = st.fixed_dictionaries({k: _maybe(GENERATE_VALUES[k]) for k in required},
                                 optional={k: _maybe(v) for k, v in GENERATE_VALUES.items() if k not in required})
    return _with_extra(body)


def _as_json(t: tuple[str, str, np.ndarray]) -> dict[str, Any]:
    name, dt, arr = t
    flat = [x.decode("latin-1") if isinstance(x, bytes) else x for x in arr.reshape(-1).tolist()]
    return {"name": name, "shape": list(arr.shape), "datatype": dt, "data": flat}


def infer_bodies() -> st.SearchStrategy[Any]:
    """KServe v2 JSON for /v2/models/{model}/infer: the gRPC fuzzer's tensors as JSON (model, body); the models
    that answer HTTP infer (a decoupled one answers 501, documented)."""
    return triton_requests(("ensemble", "target", "draft")).map(lambda r: (r[0], {"inputs": [_as_json(t) for t in r[1]]}))


# ---- running one request and checking it ---------------------------------------------------------------------
@dataclass
class Tally:
    """Requests by (surface, outcome) and the property failures seen."""

    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, surface: str, what: str, request: Any) -> None:
        text = f"{surface}: {what} — request {repr(request)[:300]}"
        log.error("%s", text)
        self.failures.append(text)

    def report(self) -> str:
        lines = [f"{k[0]} {k[1]}: {v}" for k, v in sorted(self.counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
        lines.append(f"requests: {sum(self.counts.values())}, property failures: {len(self.failures)}")
        return "\n".join(lines + [f"FAILED {f}" for f in self.failures[:20]])


@dataclass
class Targets:
    """Where the servers are, the served model id, and the reference answers of the good requests."""

    openai_url: str | None  # http://HOST:PORT/v1
    grpc_url: str | None  # HOST:PORT of Triton's gRPC
    http_url: str | None  # HOST:PORT of Triton's HTTP
    model: str = "tiny"
    good_text: str | None = None  # the OpenAI greedy completion of GOOD_PROMPT
    good_ids: list[int] | None = None  # Triton's greedy answer to GOOD_PROMPT
    api_key: str = "unused"


class Fuzzer:
    """Sends one fuzzed request, checks the properties, then (check_good) a good request."""

    def __init__(self, targets: Targets, tally: Tally) -> None:
        import requests  # noqa: PLC0415

        self.t, self.tally, self.http = targets, tally, requests.Session()

    # OpenAI
    def openai(self, path: str, body: bytes) -> None:
        import requests  # noqa: PLC0415

        url = f"{self.t.openai_url}/{path}"
        t0 = time.monotonic()
        try:
            with self.http.post(url, data=body, stream=True, timeout=(10, REQUEST_TIMEOUT_S),
                                headers={"Content-Type": "application/json",
                                         "Authorization": f"Bearer {self.t.api_key}"}) as r:
                chunks = []
                for chunk in r.iter_content(65536):
                    chunks.append(chunk)
                    if time.monotonic() - t0 > REQUEST_TIMEOUT_S:
                        raise TimeoutError(f"still streaming after {REQUEST_TIMEOUT_S:.0f} s")
                self._check_openai(r.status_code, r.headers.get("content-type", ""), b"".join(chunks), body)
        except (requests.RequestException, TimeoutError) as exc:
            self.tally.counts[("openai", "no answer")] += 1
            self.tally.fail("openai", f"no answer within {REQUEST_TIMEOUT_S:.0f} s ({type(exc).__name__}: {exc})",
                            body)

    def _check_openai(self, status: int, ctype: str, raw: bytes, request: bytes) -> None:
        self.tally.counts[("openai", status)] += 1
        if status >= 500:
            self.tally.fail("openai", f"HTTP {status}: {raw[:300]!r}", request)
            return
        if status != 200:
            err = json.loads(raw).get("error", {})
            if set(err) != {"message", "type", "param", "code"} or not err["message"]:
                self.tally.fail("openai", f"HTTP {status} without OpenAI's error shape: {raw[:300]!r}", request)
            return
        if "text/event-stream" not in ctype:
            json.loads(raw)["choices"][0]  # noqa: B018 - a completion, or KeyError/ValueError (a failure)
            return
        events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            self.tally.fail("openai", f"stream does not end with [DONE]: {raw[-200:]!r}", request)
        for ev in events[:-1]:
            err = json.loads(ev).get("error")
            if err is not None and err.get("type") == "server_error":
                self.tally.fail("openai", f"server error in the stream: {err}", request)

    def check_good_openai(self) -> None:
        import openai  # noqa: PLC0415

        client = openai.OpenAI(base_url=self.t.openai_url, api_key=self.t.api_key, max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        try:
            text = client.completions.create(model=self.t.model, prompt=GOOD_PROMPT, max_tokens=GOOD_TOKENS,
                                             temperature=0).choices[0].text
        except openai.OpenAIError as exc:
            self.tally.fail("openai good", f"{type(exc).__name__}: {exc}", GOOD_PROMPT)
            return
        finally:
            client.close()
        if text != self.t.good_text:
            self.tally.fail("openai good", f"{text!r} != reference {self.t.good_text!r}", GOOD_PROMPT)

    # Triton
    def triton_grpc(self, model: str, inputs: list[tuple[str, str, np.ndarray]]) -> None:
        import tritonclient.grpc as grpcclient  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        tensors = []
        for name, dt, arr in inputs:
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        client = grpcclient.InferenceServerClient(self.t.grpc_url)
        try:
            if model in ("ensemble_stream", "dspark"):
                outcome, message = _stream_outcome(client, model, tensors)
            else:
                try:
                    client.infer(model, tensors, client_timeout=REQUEST_TIMEOUT_S)
                    outcome, message = "ok", ""
                except InferenceServerException as exc:
                    outcome, message = str(exc.status() or "error"), exc.message() or ""
        finally:
            client.close()
        self.tally.counts[(f"grpc {model}", outcome)] += 1
        if outcome == "timeout" or any(s in outcome for s in ("INTERNAL", "UNKNOWN", "DEADLINE")) or any(
                m in message for m in INTERNAL_MARKERS):
            self.tally.fail(f"grpc {model}", f"{outcome}: {message[:300]}", [(n, d, a.shape) for n, d, a in inputs])

    def triton_http(self, path: str, body: bytes) -> None:
        import requests  # noqa: PLC0415

        try:
            r = self.http.post(f"http://{self.t.http_url}/{path}", data=body, timeout=(10, REQUEST_TIMEOUT_S))
        except requests.RequestException as exc:
            self.tally.counts[("http", "no answer")] += 1
            self.tally.fail("http", f"no answer ({type(exc).__name__}: {exc})", body)
            return
        text = r.text
        try:
            message = str(json.loads(text).get("error", ""))
        except (ValueError, AttributeError):
            message = ""
        core = r.status_code == 500 and message.startswith(TRITON_CORE_500)
        self.tally.counts[("http", f"{r.status_code}{' (triton core json)' if core else ''}")] += 1
        if r.status_code >= 500 and not core:
            self.tally.fail("http", f"HTTP {r.status_code}: {text[:300]}", body)

    def warm_up(self) -> None:
        """One good request to each one-pass model: `target` and `draft` load the build on their first request
        (serve.triton.one_pass), which on a loaded host can take longer than REQUEST_TIMEOUT_S."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        client = grpcclient.InferenceServerClient(self.t.grpc_url)
        try:
            for model in ("target", "draft"):
                tensors = []
                for name in MODELS[model]:
                    dt, data = VALID[name]
                    arr = np.array(data, dtype=DTYPES[dt])
                    t = grpcclient.InferInput(name, list(arr.shape), dt)
                    t.set_data_from_numpy(arr)
                    tensors.append(t)
                client.infer(model, tensors, client_timeout=600.0)
        finally:
            client.close()

    def check_good_triton(self) -> None:
        from dspark_trt.errors import DsparkError  # noqa: PLC0415
        from dspark_trt.serve.clients.client import generate_remote  # noqa: PLC0415

        try:
            ids = generate_remote(self.t.grpc_url, GOOD_PROMPT, max_tokens=GOOD_TOKENS, protocol="grpc",
                                  timeout=REQUEST_TIMEOUT_S)["token_ids"]
        except DsparkError as exc:
            self.tally.fail("triton good", f"{type(exc).__name__}: {exc}", GOOD_PROMPT)
            return
        if ids != self.t.good_ids:
            self.tally.fail("triton good", f"{ids} != reference {self.t.good_ids}", GOOD_PROMPT)


def _stream_outcome(client: Any, model: str, tensors: list[Any]) -> tuple[str, str]:
    """One request on a gRPC stream until its final response: ("ok" | "error" | "timeout" | a status, message)."""
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    try:
        client.async_stream_infer(model, tensors, request_id="fuzz", enable_empty_final_response=True)
        while True:
            try:
                result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                return "timeout", f"no final response within {REQUEST_TIMEOUT_S:.0f} s"
            if error is not None:
                return "error", error.message() if hasattr(error, "message") else str(error)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return "ok", ""
    except InferenceServerException as exc:
        return str(exc.status() or "error"), exc.message() or ""
    finally:
        client.stop_stream(cancel_requests=True)


# ---- the properties as hypothesis tests ----------------------------------------------------------------------
def run_properties(fz: Fuzzer, surfaces: tuple[str, ...], max_examples: int, derandomize: bool,
                   good_every: int = 1) -> None:
    """Each surface's property over max_examples inputs (hypothesis: derandomized = the same inputs every run)."""
    cfg = settings(max_examples=max_examples, derandomize=derandomize, database=None, deadline=None,
                   suppress_health_check=SUPPRESS, phases=[Phase.explicit, Phase.generate], print_blob=False)
    seen = Counter()

    def after(kind: str) -> None:
        seen[kind] += 1
        if seen[kind] % good_every == 0:
            (fz.check_good_openai if kind == "openai" else fz.check_good_triton)()

    props: dict[str, Callable[[], None]] = {}

    @cfg
    @given(encoded(completion_bodies(fz.t.model)))
    def completions(body: bytes) -> None:
        fz.openai("completions", body)
        after("openai")

    @cfg
    @given(encoded(chat_bodies(fz.t.model)))
    def chat(body: bytes) -> None:
        fz.openai("chat/completions", body)
        after("openai")

    @cfg
    @given(triton_requests())
    def grpc(request: tuple[str, list[tuple[str, str, np.ndarray]]]) -> None:
        fz.triton_grpc(*request)
        after("triton")

    @cfg
    @given(st.one_of(st.tuples(st.sampled_from(["ensemble/generate", "ensemble_stream/generate_stream",
                                                "ensemble_stream/generate"]), encoded(generate_bodies())),
                     infer_bodies().map(lambda mb: (f"{mb[0]}/infer", json.dumps(mb[1]).encode()))))
    def http(request: tuple[str, bytes]) -> None:
        fz.triton_http(f"v2/models/{request[0]}", request[1])
        after("triton")

    props.update(completions=completions, chat=chat, grpc=grpc, http=http)
    for name in surfaces:
        props[name]()
    for kind in ("openai", "triton"):  # the last example was bad: the next good request still gets its answer
        if any(s in surfaces for s in (("completions", "chat") if kind == "openai" else ("grpc", "http"))):
            (fz.check_good_openai if kind == "openai" else fz.check_good_triton)()


def fuzz_for(fz: Fuzzer, minutes: float, surfaces: tuple[str, ...], batch: int = 50) -> None:
    """Rounds of `batch` random examples per surface (new random inputs each round) until `minutes` have passed."""
    deadline = time.monotonic() + 60 * minutes
    rounds = 0
    while time.monotonic() < deadline:
        run_properties(fz, surfaces, batch, derandomize=False, good_every=5)
        rounds += 1
        log.info("round %d: %d requests, %d failures", rounds, sum(fz.tally.counts.values()), len(fz.tally.failures))


# ---- the command ---------------------------------------------------------------------------------------------
def _tiny_repo(workdir: Path) -> Path:
    """`dspark-trt build` of the tiny test pair (as tests/serve/conftest.py builds it) → its model repository."""
    import subprocess  # noqa: PLC0415

    from dspark_trt.testing.tiny import default_tiny_root, make_tiny_pair  # noqa: PLC0415

    pair = make_tiny_pair(default_tiny_root())
    out = workdir / "tiny"
    cmd = [sys.executable, "-m", "dspark_trt.cli", "build", "--target", str(pair.target), "--draft", str(pair.draft),
           "--output", str(out), "--dtype", "float32", "--max-draft-len", "4", "--max-batch-size", "16",
           "--max-seq-len", "256", "--policy", "confidence", "--min-k", "1", "--no-bench", "--no-engines"]
    subprocess.run(cmd, check=True, capture_output=True)
    return out / "model_repo"


def references(fz: Fuzzer) -> None:
    """The good requests' answers before any fuzzing (greedy: every later answer must equal them)."""
    import openai  # noqa: PLC0415

    from dspark_trt.serve.clients.client import generate_remote  # noqa: PLC0415

    if fz.t.openai_url:
        client = openai.OpenAI(base_url=fz.t.openai_url, api_key=fz.t.api_key, max_retries=0, timeout=300)
        fz.t.model = client.models.list().data[0].id
        fz.t.good_text = client.completions.create(model=fz.t.model, prompt=GOOD_PROMPT, max_tokens=GOOD_TOKENS,
                                                   temperature=0).choices[0].text
    if fz.t.grpc_url:
        fz.warm_up()
        fz.t.good_ids = generate_remote(fz.t.grpc_url, GOOD_PROMPT, max_tokens=GOOD_TOKENS, protocol="grpc")["token_ids"]


def main(argv: list[str] | None = None) -> int:
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default 10)")
    p.add_argument("--repo", type=Path, default=None, help="model repository to serve (default: build the tiny pair)")
    p.add_argument("--openai-url", default=None, help="fuzz this running OpenAI frontend (http://HOST:PORT/v1)")
    p.add_argument("--triton-grpc", default=None, help="... and this running Triton's gRPC HOST:PORT")
    p.add_argument("--triton-http", default=None, help="... and its HTTP HOST:PORT")
    p.add_argument("--surfaces", nargs="+", default=["completions", "chat", "grpc", "http"],
                   choices=["completions", "chat", "grpc", "http"], help="what to fuzz (default: all)")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("dspark_trt.serve.openai.protocol", "httpx"):  # one line per fuzzed request otherwise
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from dspark_trt.serve.openai.config import OpenAIConfig  # noqa: PLC0415
    from dspark_trt.serve.openai.server import OpenAIServer  # noqa: PLC0415
    from dspark_trt.serve.server import TritonServer  # noqa: PLC0415

    own = args.openai_url is None and args.triton_grpc is None
    with tempfile.TemporaryDirectory(prefix="fuzz_api_") as tmp:
        server = frontend = None
        try:
            if own:
                repo = args.repo or _tiny_repo(Path(tmp))
                server = TritonServer(repo).start()
                frontend = OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0, repo=repo)).start()
                targets = Targets(frontend.url, server.grpc_url, server.http_url)
            else:
                targets = Targets(args.openai_url, args.triton_grpc, args.triton_http,
                                  api_key=os.environ.get("DSPARK_API_KEY", "unused"))
            surfaces = tuple(s for s in args.surfaces if (targets.openai_url if s in ("completions", "chat") else
                                                          targets.grpc_url if s == "grpc" else targets.http_url))
            fz = Fuzzer(targets, Tally())
            references(fz)
            log.info("fuzzing %s for %.1f min", ", ".join(surfaces), args.minutes)
            t0 = time.monotonic()
            fuzz_for(fz, args.minutes, surfaces)
            wall = time.monotonic() - t0
        finally:
            if frontend is not None:
                frontend.stop()
            if server is not None:
                server.stop()
    counts = {f"{k[0]} {k[1]}": v for k, v in sorted(fz.tally.counts.items(), key=lambda kv: str(kv[0]))}
    if args.json:
        print(json.dumps({"wall_s": round(wall, 1), "counts": counts, "failures": fz.tally.failures}))
    else:
        print(f"fuzzed {wall / 60:.1f} min\n{fz.tally.report()}")
    return 1 if fz.tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
