"""Settings of the OpenAI-compatible frontend: one frozen OpenAIConfig, whose defaults are the CLI's
(`dspark-trt openai`, `dspark-trt serve --openai-port`). Imported by serve.openai.app (the request logic) and
serve.openai.server (hosting), which no longer import each other's settings; stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["OpenAIConfig"]


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
    log_level: str = "warning"  # uvicorn's
