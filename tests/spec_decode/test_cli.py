"""`dspark-trt generate` argument handling and the --url path (serve client stubbed: no server needed here)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from dspark_trt.cli import main


@pytest.mark.parametrize("extra, needle", [
    (["--top-p", "0"], "--top-p must be a number in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be ≥ 1"),
    (["--temperature", "-1"], "--temperature must be a finite number in [0, 100] (0 = greedy)"),
    (["--gamma", "0"], "--gamma must be in [1, 64]"),
    (["--stream"], "--stream needs --url"),
    (["--url", "localhost:8000", "--target", "x"], "drop --build-dir/--target/--draft"),
])
def test_bad_arguments_exit_2_with_a_clear_message(extra, needle, caplog) -> None:
    assert main(["generate", "--prompt", "hi"] + extra) == 2
    assert needle in caplog.text and "InvalidArgumentError" in caplog.text


def test_engine_dir_is_a_deprecated_spelling_of_build_dir(tmp_path, caplog) -> None:
    assert main(["generate", "--prompt", "hi", "--engine-dir", str(tmp_path), "--target", "x"]) == 2
    assert "--engine-dir is deprecated; use --build-dir" in caplog.text
    assert "--build-dir brings its own models: drop --target/--draft" in caplog.text
    caplog.clear()
    assert main(["generate", "--prompt", "hi", "--engine-dir", str(tmp_path), "--build-dir", str(tmp_path / "b")]) == 2
    assert "name different builds" in caplog.text


def test_url_goes_through_the_serve_client(monkeypatch, capsys) -> None:
    import dspark_trt.serve.clients.client as client

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


def test_policy_seed_is_accepted_as_confidence(monkeypatch, capsys) -> None:
    import dspark_trt.serve.clients.client as client

    seen: dict[str, Any] = {}
    monkeypatch.setattr(client, "generate_remote", lambda url, prompt, **kw: seen.update(kw) or {"text": "ok"})
    assert main(["generate", "--prompt", "hi", "--url", "h:9", "--policy", "seed"]) == 0
    assert seen["policy"] == "confidence"
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse: invalid choice
        main(["generate", "--prompt", "hi", "--policy", "seeds"])
    assert "invalid choice: 'seeds'" in capsys.readouterr().err


def test_build_policy_seed_is_accepted_as_confidence() -> None:
    import argparse

    from dspark_trt.commands import build

    p = argparse.ArgumentParser()
    build.add_arguments(p)
    opts = build.options_from_args(p.parse_args(["--policy", "seed"]))
    assert opts.policy == "confidence"
