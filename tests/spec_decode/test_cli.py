"""`dspark-trt generate` argument handling and the --url path (serve client stubbed: no server needed here)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from dspark_trt.cli import main


@pytest.mark.parametrize("extra, needle", [
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be ≥ 1"),
    (["--temperature", "-1"], "--temperature must be ≥ 0"),
    (["--gamma", "0"], "--gamma must be in [1, 64]"),
    (["--stream"], "--stream needs --url"),
    (["--url", "localhost:8000", "--target", "x"], "drop --engine-dir/--target/--draft"),
])
def test_bad_arguments_exit_2_with_a_clear_message(extra, needle, caplog) -> None:
    assert main(["generate", "--prompt", "hi"] + extra) == 2
    assert needle in caplog.text and "InvalidArgumentError" in caplog.text


def test_url_goes_through_the_serve_client(monkeypatch, capsys) -> None:
    import dspark_trt.serve.client as client

    seen: dict[str, Any] = {}

    def fake(url: str, prompt: str, **kw: Any) -> dict[str, Any]:
        seen.update(url=url, prompt=prompt, **kw)
        return {"text": "ok", "token_ids": [1, 2], "stats": {"tau": 1.5}}

    monkeypatch.setattr(client, "generate_remote", fake)
    assert main(["generate", "--prompt", "hello", "--url", "h:9", "--protocol", "grpc", "--policy", "survival",
                 "--max-new-tokens", "7", "--temperature", "0.5", "--seed", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "ok", "token_ids": [1, 2], "stats": {"tau": 1.5}}
    assert seen["url"] == "h:9" and seen["prompt"] == "hello" and seen["protocol"] == "grpc"
    assert seen["policy"] == "survival" and seen["max_tokens"] == 7 and seen["seed"] == 3
    assert seen["temperature"] == 0.5
