"""The OpenAI-compatible frontend (dspark_trt.serve.openai) in front of the REAL tritonserver of conftest.py,
called with the official `openai` client over real HTTP (uvicorn on a free loopback port): completions and chat,
streamed and not, greedy text equal to in-process generation, usage counts, stop strings, the DSpark extension
fields, OpenAI error shapes and statuses (404 / 400 / 503), a client disconnect freeing the KV slot, 8 concurrent
streams, and the two commands (`dspark-trt openai`, `dspark-trt serve --openai-port`)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import openai
import pytest

from dspark_trt.serve.openai.config import OpenAIConfig
from dspark_trt.serve.openai.server import OpenAIServer
from dspark_trt.serve.server import TritonServer, free_port
from dspark_trt.serve.text import encode_prompt

from .conftest import GAMMA, MAX_SEQ_LEN, read_metrics

pytestmark = pytest.mark.triton

MODEL = "tiny"  # the build directory's name (conftest: .../serve_build/tiny)
PROMPTS = ["def main(argv):", "import os\nimport sys", "class Queue:", "for i in range(10):",
           "with open(path) as f:", "raise ValueError(", "return self._", "# Copyright 2001"]


@pytest.fixture(scope="module")
def frontend(server) -> Iterator[OpenAIServer]:  # noqa: ANN001
    """The frontend as `dspark-trt openai --triton-url` runs it: limits and tokenizer from Triton's model config."""
    with OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0)) as fe:
        yield fe


@pytest.fixture(scope="module")
def client(frontend: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.url, api_key="x", max_retries=0, timeout=300)


def greedy(reference, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    """In-process plain greedy generation from prompt ids (what `dspark-trt generate --build-dir` runs)."""
    from dspark_trt.spec_decode.loop import LoopConfig, generate
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    with reference.lock:
        res = generate(reference.backend, ids, max_new_tokens=n, policy=PolicyConfig(policy="plain", min_k=0),
                       eos_ids=reference.eos, config=LoopConfig(gamma=GAMMA))
    return list(res.tokens)


def chat_ids(reference, prompt: str) -> list[int]:  # noqa: ANN001
    return encode_prompt(reference.pair.tokenizer, prompt, True, MAX_SEQ_LEN)


def _reason(ids: list[int], n: int) -> str:
    return "length" if len(ids) == n else "stop"


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "dspark_trt"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_in_process(client, reference, stream: bool) -> None:  # noqa: ANN001
    prompt, n = PROMPTS[0 + stream], 24
    want = reference(prompt, n)
    if not stream:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert out.object == "text_completion" and len(out.choices) == 1
        text, reason, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    else:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        assert len([p for p in pieces if p]) > 1, "streaming sent everything at once"
        text, usage = "".join(pieces), chunks[-1].usage
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert text == reference.text(want)
    assert reason == _reason(want, n)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(reference.ids(prompt)), len(want))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_token_id_prompt(client, reference) -> None:  # noqa: ANN001
    prompt = PROMPTS[2]
    out = client.completions.create(model=MODEL, prompt=reference.ids(prompt), max_tokens=10)
    assert out.choices[0].text == reference.text(reference(prompt, 10))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_in_process(client, reference, stream: bool) -> None:  # noqa: ANN001
    prompt, n = PROMPTS[3 + stream], 30
    ids = chat_ids(reference, prompt)
    want = greedy(reference, ids, n)
    msgs = [{"role": "user", "content": prompt}]
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0)
        assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
        text, reason, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    else:
        chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len([p for p in pieces if p]) > 1, "streaming sent everything at once"
        text, usage = "".join(pieces), chunks[-1].usage
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert text == reference.text(want)
    assert reason == _reason(want, n)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want))


@pytest.mark.slow
def test_chat_stream_equals_cli_generate_chat(client, tiny_build: Path) -> None:
    """The issue's acceptance check on the tiny build: the openai client's streamed chat text (server default
    policy, speculative) == `dspark-trt generate --chat` in process for the same prompt."""
    prompt, n = "Write a function that adds two numbers.", 40
    local = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", "--build-dir", str(tiny_build),
                            "--chat", "--policy", "plain", "--dtype", "float32", "--prompt", prompt,
                            "--max-new-tokens", str(n), "--json"], capture_output=True, text=True)
    assert local.returncode == 0, local.stderr[-3000:]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=n, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == json.loads(local.stdout)["text"]


def test_extensions_policy_and_stats(client, reference) -> None:  # noqa: ANN001
    prompt, n = PROMPTS[5], 24
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                    extra_body={"policy": "fixed", "max_k": 3, "return_stats": True})
    assert out.choices[0].text == reference.text(reference(prompt, n))
    stats = out.model_extra["dspark_stats"]
    assert stats["drafted_tokens"] > 0 and max(stats["k_per_round"]) <= 3 and stats["committed_tokens"] == n
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stream=True,
                                            extra_body={"policy": "plain", "return_stats": True}))
    stats = [c.model_extra["dspark_stats"] for c in chunks if (c.model_extra or {}).get("dspark_stats")]
    assert len(stats) == 1 and stats[0]["drafted_tokens"] == 0
    assert "dspark_stats" not in (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).model_extra or {})


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(client, reference, stream: bool) -> None:  # noqa: ANN001
    prompt, n = PROMPTS[6], 40
    full = reference.text(reference(prompt, n))
    clean = [i for i in range(6, len(full) - 3) if "\ufffd" not in full[i:i + 3] and full[i:i + 3].strip()]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[0]:clean[0] + 3]
    want = full[:full.find(stop)]
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stop=[stop, "\x00never"],
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stop=stop)
        text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert out.usage.completion_tokens < n
    assert text == want and reason == "stop"


def test_seeded_sampling_plain_equals_in_process(client, reference) -> None:  # noqa: ANN001
    from dspark_trt.spec_decode.loop import LoopConfig, generate
    from dspark_trt.spec_decode.protocols import SamplingParams
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    prompt = PROMPTS[1]
    with reference.lock:
        want = generate(reference.backend, reference.ids(prompt), max_new_tokens=20,
                        sampling=SamplingParams(0.8, 0.95, 11), policy=PolicyConfig(policy="plain", min_k=0),
                        eos_ids=reference.eos, config=LoopConfig(gamma=GAMMA)).tokens
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.8, top_p=0.95, seed=11,
                                    extra_body={"policy": "plain"})
    assert out.choices[0].text == reference.text(list(want))


LONG = "x = 1\n" * 400  # far more than MAX_SEQ_LEN tokens
BAD = [  # (endpoint, request fields, openai exception, substring of the message)
    ("completions", {"model": "nope", "prompt": "def f"}, openai.NotFoundError, "does not exist"),
    ("chat", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, openai.NotFoundError, "nope"),
    ("completions", {"prompt": ""}, openai.BadRequestError, "empty"),
    ("completions", {"prompt": LONG}, openai.BadRequestError, "tokens, more than"),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, openai.BadRequestError, "tokens, more than"),
    ("chat", {"messages": []}, openai.BadRequestError, "messages"),
    ("chat", {"messages": [{"role": "user", "content": ""}]}, openai.BadRequestError, "empty"),
    ("completions", {"prompt": "def f", "max_tokens": 250}, openai.BadRequestError, "lower max_tokens"),
    ("completions", {"prompt": "def f", "max_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ("completions", {"prompt": "def f", "temperature": 5}, openai.BadRequestError, "temperature"),
    ("completions", {"prompt": "def f", "top_p": 0}, openai.BadRequestError, "top_p"),
    ("completions", {"prompt": "def f", "seed": -1}, openai.BadRequestError, "seed"),
    ("completions", {"prompt": "def f", "n": 2}, openai.BadRequestError, "n must be 1"),
    ("completions", {"prompt": ["a", "b"]}, openai.BadRequestError, "one prompt"),
    ("completions", {"prompt": "def f", "stop": [""]}, openai.BadRequestError, "stop"),
    ("completions", {"prompt": "def f", "logprobs": 2}, openai.BadRequestError, "logprobs"),
    ("completions", {"prompt": "def f", "extra_body": {"policy": "bogus"}}, openai.BadRequestError, "policy"),
    ("completions", {"prompt": "def f", "stream": True, "extra_body": {"max_k": 99}}, openai.BadRequestError,
     "max_k"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "extra_body": {"policy": "bogus"}},
     openai.BadRequestError, "policy"),
]


@pytest.mark.parametrize("endpoint,fields,exc,needle", BAD, ids=[f"{e}-{n}" for e, _, _, n in BAD])
def test_bad_requests_get_openai_errors(client, reference, endpoint, fields, exc, needle) -> None:  # noqa: ANN001
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(exc) as info:
        out = create(**{"model": MODEL, "max_tokens": 4, **fields})
        if fields.get("stream"):
            list(out)
    assert needle in info.value.message
    body = info.value.body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body)
    assert body["type"] == "invalid_request_error"
    # the server keeps serving
    ok = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    assert ok.choices[0].text == reference.text(reference(PROMPTS[0], 3))


def test_triton_down_is_503(tiny_build: Path) -> None:
    """Nothing listens at the Triton URL: every generation answers 503 in OpenAI's shape; the frontend stays up."""
    dead = f"127.0.0.1:{free_port()}"
    with OpenAIServer(OpenAIConfig(triton_url=dead, repo=tiny_build / "model_repo", port=0)) as fe:
        cl = openai.OpenAI(base_url=fe.url, api_key="x", max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, stream=stream)
            assert info.value.status_code == 503 and "unavailable" in info.value.message
            assert info.value.body["code"] == "triton_unavailable"
        assert [m.id for m in cl.models.list()] == [MODEL]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(fe.url.removesuffix("/v1") + "/health", timeout=30)
        assert health.value.code == 503
        health.value.close()


def _settled(url: str) -> dict[str, float]:
    deadline = time.monotonic() + 60  # waits for the server to notice; not a timing assertion
    m = read_metrics(url)
    while m.get("dspark_active_requests", 0.0) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        m = read_metrics(url)
    return m


@pytest.fixture(scope="module")
def slow_server(tiny_build: Path) -> Iterator[TritonServer]:
    """The tiny build with every verify pass 20 ms longer (DSPARK_SERVE_FAULTS=slow:20): a 240-token answer stays in
    flight for seconds instead of the tiny model's few milliseconds, so a disconnect always lands mid-answer."""
    with TritonServer(tiny_build / "model_repo", env=dict(os.environ, DSPARK_SERVE_FAULTS="slow:20")) as srv:
        yield srv


@pytest.fixture(scope="module")
def slow_frontend(slow_server: TritonServer) -> Iterator[OpenAIServer]:
    with OpenAIServer(OpenAIConfig(triton_url=slow_server.grpc_url, port=0)) as fe:
        yield fe


@pytest.fixture(scope="module")
def slow_client(slow_frontend: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=slow_frontend.url, api_key="x", max_retries=0, timeout=300)


def test_disconnect_mid_stream_frees_kv_slot(slow_client, slow_server, reference) -> None:  # noqa: ANN001
    client, server = slow_client, slow_server
    before = _settled(server.metrics_url).get("dspark_cancelled_total", 0.0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[7]}],
                                            max_tokens=200, stream=True, extra_body={"policy": "plain"})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 2:
            break
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 60
    m = read_metrics(server.metrics_url)
    while m.get("dspark_cancelled_total", 0.0) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
        m = read_metrics(server.metrics_url)
    assert m["dspark_cancelled_total"] == before + 1
    assert _settled(server.metrics_url)["dspark_active_requests"] == 0
    ok = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    assert ok.choices[0].text == reference.text(reference(PROMPTS[0], 3))


def test_disconnect_while_waiting_for_a_whole_answer(slow_frontend: OpenAIServer, slow_server: TritonServer) -> None:
    """Non-streamed: the client closes its connection while the answer is being generated → request stopped."""
    server = slow_server
    before = _settled(server.metrics_url).get("dspark_cancelled_total", 0.0)
    _disconnect_mid_answer(slow_frontend, server)
    m = read_metrics(server.metrics_url)
    deadline = time.monotonic() + 60
    while m.get("dspark_cancelled_total", 0.0) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
        m = read_metrics(server.metrics_url)
    assert m["dspark_cancelled_total"] == before + 1
    assert _settled(server.metrics_url)["dspark_active_requests"] == 0


def _disconnect_mid_answer(frontend: OpenAIServer, server: TritonServer) -> None:
    host, port = frontend.url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "policy": "plain"}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while read_metrics(server.metrics_url).get("dspark_active_requests", 0.0) < 1:
            assert time.monotonic() < deadline, "the request never became active"
            time.sleep(0.02)


def test_eight_concurrent_streams(client, reference) -> None:  # noqa: ANN001
    jobs = [(PROMPTS[i], 16 + 4 * i, ("confidence", "fixed", "survival", "plain")[i % 4], i % 2 == 0)
            for i in range(8)]
    wants = [greedy(reference, chat_ids(reference, p), n) if chat else reference(p, n) for p, n, _, chat in jobs]
    results: dict[int, tuple[str, int, dict]] = {}
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(len(jobs))

    def one(i: int) -> None:
        prompt, n, policy, chat = jobs[i]
        extra = {"policy": policy, "return_stats": True}
        barrier.wait()
        try:
            if chat:
                chunks = list(client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=n, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, stream=True,
                                                        stream_options={"include_usage": True}, extra_body=extra))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
            stats = next(c.model_extra["dspark_stats"] for c in chunks if (c.model_extra or {}).get("dspark_stats"))
            results[i] = (text, chunks[-1].usage.completion_tokens, stats)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (text, n_tokens, _) in results.items():
        assert text == reference.text(wants[i]), f"stream {i} ({jobs[i]}) got someone else's or wrong text"
        assert n_tokens == len(wants[i])
    assert max(s["batch"]["max"] for _, _, s in results.values()) >= 2, "rounds were not batched"


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the command exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise AssertionError(f"{url} not up after {timeout:.0f} s")


@pytest.mark.slow
def test_cli_openai_command(server, reference) -> None:  # noqa: ANN001
    """`dspark-trt openai --triton-url` (standalone, in front of the session's server); SIGTERM → exit 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "openai", "--triton-url", server.grpc_url,
                             "--port", str(port), "--served-model-name", "dspark-tiny"])
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        out = cl.completions.create(model="dspark-tiny", prompt=PROMPTS[0], max_tokens=8)
        assert out.choices[0].text == reference.text(reference(PROMPTS[0], 8))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.slow
def test_cli_serve_with_openai_port(tiny_build: Path, reference) -> None:  # noqa: ANN001
    """`dspark-trt serve --openai-port 0`: READY names the OpenAI URL; one streamed chat call; clean stop."""
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "serve", "--repo", str(tiny_build / "model_repo"),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"`dspark-trt serve` did not become ready (exit {proc.poll()})"
        urls = dict(kv.split("=", 1) for kv in line.split()[1:])
        cl = openai.OpenAI(base_url=urls["openai"], api_key="x", max_retries=0, timeout=120)
        prompt = PROMPTS[2]
        stream = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=12, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == reference.text(greedy(reference, chat_ids(reference, prompt), 12))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
