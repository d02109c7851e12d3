"""Each bad input gets an error response naming the problem, and the next good request still succeeds."""
from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from dspark_trt.errors import RequestError
from dspark_trt.serve.clients.client import generate_remote

pytestmark = pytest.mark.triton

LONG = "x = 1\n" * 400  # far more than MAX_SEQ_LEN tokens

BAD_HTTP = [  # (JSON body, substring of the error)
    ({"text_input": "", "max_tokens": 4}, "empty"),
    ({"text_input": LONG, "max_tokens": 4}, "shorten the prompt"),
    ({"text_input": "def f", "max_tokens": 0}, "max_tokens must be"),
    ({"text_input": "def f", "max_tokens": 250}, "lower max_tokens"),
    ({"text_input": "def f", "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"text_input": "def f", "max_tokens": 4, "top_p": 0.0}, "top_p"),
    ({"text_input": "def f", "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"text_input": "def f", "max_tokens": 4, "min_k": 3, "max_k": 2}, "min_k"),
    ({"text_input": "def f", "max_tokens": 4, "max_k": 99}, "max_k"),
    ({"text_input": "def f", "max_tokens": 4, "policy": "bogus"}, "policy must be one of"),
    ({"text_input": "def f", "max_tokens": 4, "end_id": 99999}, "end_id"),
    ({"text_input": "def f", "max_tokens": 4, "stop_words": [""]}, "stop_words"),
    ({"text_input": "def f", "max_tokens": 4, "top_k": 5}, "unknown parameter"),
    ({"text_input": "def f", "max_tokens": 4, "parameters": {"beam": 2}}, "unknown parameter"),
]


def _good(server, reference) -> None:
    out = generate_remote(server.http_url, "def main(argv):", max_tokens=3)
    assert out["token_ids"] == reference("def main(argv):", 3)


@pytest.mark.parametrize("body,needle", BAD_HTTP, ids=[n for _, n in BAD_HTTP])
def test_bad_http_input_then_good(server, reference, body: dict, needle: str) -> None:
    r = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    err = r.json().get("error", "")
    assert r.status_code >= 400 and needle in err, (r.status_code, err)
    _good(server, reference)


def _grpc_error(server, inputs: dict[str, tuple[np.ndarray, str]]) -> str:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: list = []
    try:
        tensors = []
        for name, (arr, dt) in inputs.items():
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        client.start_stream(callback=lambda result, error: got.append((result, error)))
        client.async_stream_infer("ensemble", tensors, request_id="bad", enable_empty_final_response=True)
    except InferenceServerException as exc:
        return exc.message()
    finally:
        client.stop_stream()  # waits for the outstanding response
        client.close()
    errs = [e for _, e in got if e is not None]
    assert errs, f"no error for {list(inputs)}: {got}"
    return errs[0].message()


def test_bad_utf8_over_grpc_then_good(server, reference) -> None:
    msg = _grpc_error(server, {"text_input": (np.array([[b"def \xff\xfe f"]], dtype=object), "BYTES"),
                               "max_tokens": (np.array([[4]], dtype=np.int32), "INT32")})
    assert "UTF-8" in msg
    _good(server, reference)


def test_unknown_grpc_input_then_good(server, reference) -> None:
    msg = _grpc_error(server, {"text_input": (np.array([[b"def f"]], dtype=object), "BYTES"),
                               "max_tokens": (np.array([[4]], dtype=np.int32), "INT32"),
                               "top_k": (np.array([[5]], dtype=np.int32), "INT32")})
    assert "top_k" in msg
    _good(server, reference)


def test_client_raises_request_error(server) -> None:
    with pytest.raises(RequestError, match="top_p"):
        generate_remote(server.grpc_url, "def f", max_tokens=4, protocol="grpc", top_p=2.0)
    with pytest.raises(RequestError, match="empty"):
        generate_remote(server.http_url, "   ", max_tokens=4, stream=True)
