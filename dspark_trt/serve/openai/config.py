"""Settings of the OpenAI-compatible frontend: one frozen OpenAIConfig, whose defaults are the CLI's
(`dspark-trt openai`, `dspark-trt serve --openai-port`). Imported by serve.openai.app (the request logic) and
serve.openai.server (hosting), which no longer import each other's settings; stdlib only (+ dspark_trt.errors).

Also owns where the API key comes from: API_KEY_ENV (`DSPARK_API_KEY`, the default when `--api-key` is absent) and
resolve_api_key; checking it on requests is serve.openai.auth's. The key is kept out of the config's repr.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from dspark_trt.errors import InvalidArgumentError

__all__ = ["API_KEY_ENV", "DEFAULT_MAX_BODY_BYTES", "OpenAIConfig", "check_api_key_format", "resolve_api_key"]

API_KEY_ENV = "DSPARK_API_KEY"  # the API key when --api-key is not given
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB (serve.openai.limits: larger bodies get HTTP 413)
MIN_BODY_BYTES = 1024  # the smallest --max-body-bytes


@dataclass(frozen=True)
class OpenAIConfig:
    """Settings of the OpenAI-compatible frontend (defaults = the CLI's)."""

    triton_url: str = "127.0.0.1:8001"  # Triton's gRPC endpoint
    host: str = "127.0.0.1"
    port: int = 9000  # 0 = any free port
    model_name: str | None = None  # the id in /v1/models; default: the build directory's name
    tokenizer_dir: Path | None = None  # default: BUILD_DIR/tokenizer of the dspark model's config
    repo: Path | None = None  # read the build's config from this model repository instead of asking Triton
    triton_model: str = "dspark"  # the decoupled scheduler model (token ids in and out)
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default); chat: the room left
    default_temperature: float = 0.0  # greedy unless the request sets temperature (as Triton's ensemble)
    request_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies: HTTP 413 (serve.openai.limits; docs/serving.md)
    log_level: str = "warning"  # uvicorn's
    # when set, every /v1/... request needs `Authorization: Bearer <api_key>` (serve.openai.auth); never in repr
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key_format(self.api_key)
        if self.max_body_bytes < MIN_BODY_BYTES:
            raise InvalidArgumentError(f"--max-body-bytes must be ≥ {MIN_BODY_BYTES} (a small chat request is a few "
                                       f"hundred bytes), got {self.max_body_bytes}")
        if not self.request_timeout_s > 0:
            raise InvalidArgumentError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")


def check_api_key_format(key: str) -> None:
    """A key a client can send as `Authorization: Bearer <key>`: non-empty printable ASCII, no spaces (the message
    never repeats the key)."""
    if not key:
        raise InvalidArgumentError(f"the API key is empty; pass a non-empty --api-key (or {API_KEY_ENV}), or leave "
                                   "both unset to serve without a key")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise InvalidArgumentError(f"the API key (--api-key / {API_KEY_ENV}, {len(key)} characters) has spaces, "
                                   "control or non-ASCII characters, which an HTTP Authorization header cannot "
                                   "carry; use printable ASCII, e.g. the output of "
                                   "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")


def resolve_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The API key to require: `--api-key` when given, else $DSPARK_API_KEY when set and non-empty, else None (no
    key: the frontend is open)."""
    if flag is not None:
        check_api_key_format(flag)
        return flag
    env = os.environ if environ is None else environ
    return env.get(API_KEY_ENV) or None
