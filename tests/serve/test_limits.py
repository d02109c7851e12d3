"""The request limits of docs/serving.md ("Limits") on the REAL servers of conftest.py, through each entry point
with its own client: the official openai SDK (and raw HTTP where the SDK cannot send the body) against the OpenAI
frontend, tritonclient gRPC and HTTP against Triton. Each limit: its status, OpenAI's error shape with `param` and
`code` (or Triton's INVALID_ARG / HTTP 400), and a good request answered exactly right after it."""
from __future__ import annotations

import http.client
import json
from typing import Iterator
from urllib.parse import urlsplit

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dspark_trt.serve.clients.client import generate_remote
from dspark_trt.serve.openai.config import DEFAULT_MAX_BODY_BYTES, OpenAIConfig
from dspark_trt.serve.openai.server import OpenAIServer
from dspark_trt.serve.text import pack_stop_words
from dspark_trt.serve.validate import MAX_STOP_CHARS, MAX_STOP_WORDS

pytestmark = pytest.mark.triton

MODEL = "tiny"
PROMPT, N = "def main(argv):", 6


@pytest.fixture(scope="module")
def frontend(server) -> Iterator[OpenAIServer]:  # noqa: ANN001
    with OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0)) as fe:
        yield fe


@pytest.fixture(scope="module")
def client(frontend: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.url, api_key="x", max_retries=0, timeout=120)


def _good(client: openai.OpenAI, reference) -> None:  # noqa: ANN001
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N)
    assert out.choices[0].text == reference.text(reference(PROMPT, N))


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    return body


def test_body_over_the_limit_is_413_with_a_fix(client, frontend, reference) -> None:  # noqa: ANN001
    huge = "x" * (DEFAULT_MAX_BODY_BYTES + 10)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt=huge, max_tokens=4)
    assert info.value.status_code == 413
    err = _error(info.value)
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert f"at most {DEFAULT_MAX_BODY_BYTES} bytes" in err["message"] and "Fix:" in err["message"]
    # chunked (no Content-Length): counted as it arrives
    url = urlsplit(frontend.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = json.dumps({"model": MODEL, "prompt": huge}).encode()
    conn.request("POST", "/v1/completions", body=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    _good(client, reference)


def test_body_limit_is_configurable(server, reference) -> None:  # noqa: ANN001
    with OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0, max_body_bytes=4096)) as fe:
        small = openai.OpenAI(base_url=fe.url, api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.APIStatusError) as info:
            small.completions.create(model=MODEL, prompt="def f(): pass\n" * 400, max_tokens=4)
        assert info.value.status_code == 413 and "at most 4096 bytes" in _error(info.value)["message"]
        _good(small, reference)


def test_stop_strings_limits_on_every_entry_point(client, server, reference) -> None:  # noqa: ANN001
    too_many = [f"s{i}" for i in range(MAX_STOP_WORDS + 1)]
    too_long = ["y" * (MAX_STOP_CHARS + 1)]
    for stops, needle in ((too_many, f"at most {MAX_STOP_WORDS} strings"), (too_long, f"the {MAX_STOP_CHARS}")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=stops,
                                           max_tokens=4)
        assert needle in info.value.message and _error(info.value)["param"] == "stop"
        r = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", timeout=60,
                          json={"text_input": PROMPT, "max_tokens": 4, "stop_words": stops})
        assert r.status_code == 400 and needle in r.json()["error"]
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, stop=["\x00a", "\x00b", "\x00c", "zzz"])
    assert ok.choices[0].text == reference.text(reference(PROMPT, N))  # 4 stop strings are fine
    # the dspark model checks stop_words_ids itself (direct gRPC clients skip preprocessing)
    msg = _dspark_stream_error(server, reference.ids(PROMPT), pack_stop_words([[5]] * (MAX_STOP_WORDS + 1))[None])
    assert f"more than the {MAX_STOP_WORDS}" in msg
    msg = _dspark_stream_error(server, reference.ids(PROMPT), np.array([[[5, 6], [2, 1]]], dtype=np.int32))
    assert "non-decreasing end offsets" in msg
    _good(client, reference)


def _dspark_stream_error(server, ids: list[int], stop_words_ids: np.ndarray) -> str:  # noqa: ANN001
    import queue

    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    inputs = []
    for name, arr, dt in (("input_ids", np.array([ids], dtype=np.int32), "INT32"),
                          ("max_tokens", np.array([[4]], dtype=np.int32), "INT32"),
                          ("stop_words_ids", stop_words_ids.astype(np.int32), "INT32")):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client.start_stream(callback=lambda result, error: q.put(error))
    try:
        client.async_stream_infer("dspark", inputs, request_id="limits")
        error = q.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None, "the dspark model accepted bad stop_words_ids"
    return error.message()


def test_known_unsupported_vs_ignored_fields(client, reference) -> None:  # noqa: ANN001
    for fields, param, code in (({"n": 2}, "n", "unsupported_value"),
                                ({"logit_bias": {"50": 5}}, "logit_bias", "unsupported_parameter"),
                                ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **fields)
        err = _error(info.value)
        assert (err["param"], err["code"]) == (param, code), err
    # neutral values of known-unsupported parameters, ignored ones and unknown fields: accepted, output unchanged
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, n=1, logit_bias={}, presence_penalty=0,
                                    user="u", extra_body={"no_such_field": {"nested": [1, None]}, "store": True})
    assert out.choices[0].text == reference.text(reference(PROMPT, N))


def test_bad_bodies_get_openai_errors(frontend, client, reference) -> None:  # noqa: ANN001
    base = frontend.url
    for raw, status, needle in (
            (b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', 400, "lone surrogate"),
            (b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}', 400, "could not parse the JSON"),
            (b'{"model": "tiny", "prompt": ', 400, "could not parse the JSON"),
            (b"[" * 5000 + b"]" * 5000, 400, "")):
        r = requests.post(f"{base}/completions", data=raw, headers={"Content-Type": "application/json"}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == status and needle in err["message"], (raw[:40], r.status_code, err)
        assert err["type"] == "invalid_request_error"
    r = requests.get(f"{base}/nothing-here", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("Invalid URL (GET /v1/nothing-here)")
    r = requests.put(f"{base}/completions", timeout=60)
    assert r.status_code == 405 and "Method not allowed" in r.json()["error"]["message"]
    _good(client, reference)


def test_ensemble_infer_request_errors_are_400_not_500(server, reference) -> None:  # noqa: ANN001
    """A request the dspark model rejects, through `ensemble` infer (preprocessing → dspark_sync → BLS): Triton
    2.51 hands the BLS caller the error as INTERNAL; dspark_sync answers it as INVALID_ARG again."""
    arrays = {"text_input": (np.array([[PROMPT.encode()]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[10_000]], dtype=np.int32), "INT32")}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, (arr, dt) in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    with pytest.raises(InferenceServerException) as info:
        client.infer("ensemble", tensors)
    client.close()
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "lower max_tokens" in info.value.message()
    hclient = httpclient.InferenceServerClient(server.http_url)
    tensors = []
    for name, (arr, dt) in arrays.items():
        t = httpclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    with pytest.raises(InferenceServerException) as hinfo:
        hclient.infer("ensemble", tensors)
    hclient.close()
    assert hinfo.value.status() == "400" and "lower max_tokens" in hinfo.value.message()
    assert generate_remote(server.grpc_url, PROMPT, max_tokens=N, protocol="grpc")["token_ids"] == reference(PROMPT, N)
