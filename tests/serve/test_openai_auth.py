"""The OpenAI frontend's API key (serve.openai.auth, OpenAIConfig.api_key, `--api-key` / DSPARK_API_KEY): with the
official `openai` client against the real frontend in front of conftest's REAL tritonserver — no key or a wrong key
is a 401 `invalid_api_key` in OpenAI's error shape, the right key gets the greedy answer, /health stays open, the key
never reaches the logs (in process and the `dspark-trt openai` command's stderr) — and, without a server, the header
check, where the key comes from (flag, environment) and the warning for a non-loopback bind without a key."""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import openai
import pytest

from dspark_trt.errors import DsparkError, InvalidArgumentError
from dspark_trt.serve.openai.auth import (INVALID_API_KEY, APIKeyError, check_authorization, exposure_warning,
                                          is_loopback, warn_if_exposed)
from dspark_trt.serve.openai.config import API_KEY_ENV, OpenAIConfig, resolve_api_key
from dspark_trt.serve.openai.server import OpenAIServer
from dspark_trt.serve.server import free_port

MODEL = "tiny"  # the build directory's name (conftest: .../serve_build/tiny)
PROMPT = "def main(argv):"
KEY = "dsk-" + secrets.token_urlsafe(24)  # unique per run: any occurrence in a log is a leak
NO_AUTH = {"Authorization": openai.omit}  # per request: the SDK sends no Authorization header at all


# ---- the header check, the key's sources and the exposure warning (no server) ------------------------------------
REJECTED = {  # id: (Authorization header, the reason's start)
    "absent": (None, "Missing API key"), "empty": (b"", "Missing API key"), "blank": (b"   ", "Missing API key"),
    "basic": (b"Basic " + KEY.encode(), "Malformed"), "bearer-only": (b"Bearer", "Malformed"),
    "bearer-blank": (b"Bearer   ", "Malformed"), "no-scheme": (KEY.encode(), "Malformed"),
    "longer": (b"Bearer " + KEY.encode() + b"x", "Incorrect"), "shorter": (b"Bearer " + KEY[:-1].encode(), "Incorrect"),
    "other": (b"Bearer wrong", "Incorrect")}


@pytest.mark.parametrize("header,reason", REJECTED.values(), ids=REJECTED.keys())
def test_check_authorization_rejects(header: bytes | None, reason: str) -> None:
    err = check_authorization(header, KEY.encode())
    assert isinstance(err, APIKeyError) and isinstance(err, DsparkError)
    assert err.status == 401 and err.reason.startswith(reason)
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": None,
                                    "code": INVALID_API_KEY}}
    assert "Authorization: Bearer <key>" in err.message and API_KEY_ENV in err.message  # the fix
    assert KEY not in err.message and KEY[:-1] not in err.message


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"  Bearer {KEY}  ", f"BEARER  {KEY}"],
                         ids=["plain", "lowercase", "padded", "uppercase"])
def test_check_authorization_accepts(header: str) -> None:
    assert check_authorization(header.encode(), KEY.encode()) is None


def test_config_repr_never_shows_the_key() -> None:
    cfg = OpenAIConfig(api_key=KEY)
    assert cfg.api_key == KEY
    assert KEY not in repr(cfg) and KEY not in str(cfg) and "api_key" not in repr(cfg)
    assert "host='127.0.0.1'" in repr(cfg)  # the rest is still there


@pytest.mark.parametrize("bad", ["", "two words", "tab\tkey", "ключ-1234"])
def test_unusable_keys_are_refused_without_echoing(bad: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        OpenAIConfig(api_key=bad)
    assert "API key" in str(info.value) and (not bad or bad not in str(info.value))
    with pytest.raises(InvalidArgumentError):
        resolve_api_key(bad, {})


def test_resolve_api_key_flag_then_environment() -> None:
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None  # set but empty: no key
    assert resolve_api_key(None, {API_KEY_ENV: KEY}) == KEY
    assert resolve_api_key("flag-key", {API_KEY_ENV: KEY}) == "flag-key"


@pytest.mark.parametrize("command", ["openai", "serve"])
def test_cli_api_key_and_env_default(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both commands that start the frontend: $DSPARK_API_KEY when --api-key is absent, the flag wins, neither: None;
    the key stays out of --help (no default printed)."""
    import importlib

    from dspark_trt.commands.openai import config_from_args

    mod = importlib.import_module(f"dspark_trt.commands.{command}")

    def config(*argv: str) -> OpenAIConfig:
        parser = argparse.ArgumentParser()
        mod.add_arguments(parser)
        assert KEY not in parser.format_help()
        return config_from_args(parser.parse_args(list(argv)), port=0)

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config().api_key is None
    assert config("--api-key", "flag-key").api_key == "flag-key"
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert config().api_key == KEY
    assert config("--api-key", "flag-key").api_key == "flag-key"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_binds_do_not_warn(host: str) -> None:
    assert is_loopback(host)
    assert exposure_warning(host, 9000, None) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.20", "10.0.0.1", "fe80::1", "gpu-box.example.com"])
def test_open_bind_without_key_warns(host: str) -> None:
    assert not is_loopback(host)
    msg = exposure_warning(host, 9000, None)
    assert msg is not None and f"{host}:9000" in msg and "anyone who can reach this port" in msg
    assert "--api-key" in msg and API_KEY_ENV in msg  # how to fix it
    assert exposure_warning(host, 9000, KEY) is None  # with a key: nothing to warn about


def test_warn_if_exposed_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dspark_trt")
    warn_if_exposed(OpenAIConfig(host="0.0.0.0", port=9000))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "dspark_trt.serve.openai.auth"]
    assert len(warned) == 1 and "anyone who can reach" in warned[0].getMessage()
    caplog.clear()
    warn_if_exposed(OpenAIConfig(host="0.0.0.0", port=9000, api_key=KEY))
    warn_if_exposed(OpenAIConfig(host="127.0.0.1", port=9000))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert KEY not in caplog.text


def test_server_startup_path_warns(tiny_build: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The uvicorn server both hosting paths build (OpenAIServer, serve_forever) warns before binding 0.0.0.0
    without a key; nothing is bound here (the server is built, not started)."""
    from dspark_trt.serve.openai.server import _uvicorn_server

    caplog.set_level(logging.WARNING, logger="dspark_trt")
    _uvicorn_server(OpenAIConfig(host="0.0.0.0", port=free_port(), repo=tiny_build / "model_repo"))
    assert any("anyone who can reach" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# ---- the real frontend with a key ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(server) -> Iterator[OpenAIServer]:  # noqa: ANN001
    """The frontend of test_openai.py's `frontend`, started with an API key (debug uvicorn log)."""
    with OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0, api_key=KEY, log_level="debug")) as fe:
        yield fe


def _client(fe: OpenAIServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fe.url, api_key=key, max_retries=0, timeout=300)


def _assert_401(exc: openai.AuthenticationError, reason: str) -> None:
    assert exc.status_code == 401 and exc.code == INVALID_API_KEY
    assert isinstance(exc.body, dict) and set(exc.body) == {"message", "type", "param", "code"}
    assert (exc.body["type"], exc.body["param"], exc.body["code"]) == ("invalid_request_error", None, INVALID_API_KEY)
    message = exc.body["message"]  # exc.message is the SDK's "Error code: 401 - " + it
    assert message.startswith(reason) and "Authorization: Bearer <key>" in message


@pytest.mark.triton
def test_no_key_is_401(keyed: OpenAIServer) -> None:
    cl = _client(keyed, "unused")
    with pytest.raises(openai.AuthenticationError) as info:
        cl.models.list(extra_headers=NO_AUTH)
    _assert_401(info.value, "Missing API key")
    with pytest.raises(openai.AuthenticationError) as info:
        cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_headers=NO_AUTH)
    _assert_401(info.value, "Missing API key")
    with pytest.raises(openai.AuthenticationError) as info:
        list(cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        stream=True, extra_headers=NO_AUTH))
    _assert_401(info.value, "Missing API key")


@pytest.mark.triton
@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}", "/v1/no-such-route", "/v1"])
def test_raw_request_without_key_is_openai_401(keyed: OpenAIServer, path: str) -> None:
    """Exactly OpenAI's body; unknown /v1 paths too (401 before 404: no route is revealed without the key)."""
    base = keyed.url.removesuffix("/v1")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(base + path, timeout=30)
    err = info.value
    body = json.loads(err.read())
    err.close()
    assert err.code == 401 and err.headers["Content-Type"] == "application/json"
    assert err.headers["WWW-Authenticate"].startswith("Bearer")
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] is None and body["error"]["code"] == "invalid_api_key"
    assert "Missing API key" in body["error"]["message"] and "--api-key" in body["error"]["message"]


@pytest.mark.triton
@pytest.mark.parametrize("wrong", ["sk-wrong-0000", KEY + "x", KEY[:-1], KEY.swapcase()],
                         ids=["other", "longer", "shorter", "case"])
def test_wrong_key_is_401(keyed: OpenAIServer, wrong: str) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        _client(keyed, wrong).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    _assert_401(info.value, "Incorrect API key")
    assert wrong not in info.value.message


@pytest.mark.triton
def test_right_key_gets_the_greedy_answer(keyed: OpenAIServer, reference) -> None:  # noqa: ANN001
    cl = _client(keyed, KEY)
    assert [m.id for m in cl.models.list()] == [MODEL]
    out = cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == reference.text(reference(PROMPT, 12))
    chunks = list(cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference.text(reference(PROMPT, 12))


@pytest.mark.triton
def test_health_stays_open(keyed: OpenAIServer) -> None:
    base = keyed.url.removesuffix("/v1")
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    req = urllib.request.Request(base + "/health", headers={"Authorization": "Bearer wrong"})
    with urllib.request.urlopen(req, timeout=30) as r:  # a wrong key does not matter there either
        assert r.status == 200


@pytest.mark.triton
def test_key_never_logged_in_process(keyed: OpenAIServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dspark_trt")
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, KEY + "-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, KEY).models.list(extra_headers=NO_AUTH)
    _client(keyed, KEY).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert "401 GET /v1/models" in caplog.text  # the rejections are logged (so the capture works) ...
    assert KEY not in caplog.text  # ... without the key, right or wrong
    assert KEY not in repr(keyed.config)


@pytest.mark.slow
@pytest.mark.triton
def test_cli_env_key_and_log_output(server, reference, tmp_path: Path) -> None:  # noqa: ANN001
    """`dspark-trt -vv openai` with DSPARK_API_KEY (no flag): /health open, 401 without the key, the answer with it;
    stderr (our debug log + uvicorn's) names the 401 and never the key; SIGTERM → exit 0."""
    port, log_path = free_port(), tmp_path / "openai.log"
    env = dict(os.environ, **{API_KEY_ENV: KEY})
    with log_path.open("w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "-vv", "openai", "--triton-url",
                                 server.grpc_url, "--port", str(port), "--log-level", "debug"],
                                env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            from .test_openai import _wait_http

            _wait_http(f"http://127.0.0.1:{port}/health", proc)  # open: no key needed
            base = f"http://127.0.0.1:{port}/v1"
            with pytest.raises(openai.AuthenticationError) as info:
                openai.OpenAI(base_url=base, api_key="nope", max_retries=0, timeout=120).models.list()
            _assert_401(info.value, "Incorrect API key")
            out = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=8)
            assert out.choices[0].text == reference.text(reference(PROMPT, 8))
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    text = log_path.read_text()
    assert "API key required" in text and "401 GET /v1/models" in text  # the log is there ...
    assert KEY not in text  # ... and the key is not
