"""`dspark-trt openai`: the OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) in front of
an already running tritonserver (`dspark-trt serve`). Logic: dspark_trt.serve.openai.app; the defaults are
dspark_trt.serve.openai.config.OpenAIConfig's. `dspark-trt serve --openai-port PORT` runs the same frontend next to
the server it starts (its options: add_frontend_arguments, config_from_args).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dspark_trt.errors import InvalidArgumentError, ServeError
from dspark_trt.serve.openai.config import API_KEY_ENV, OpenAIConfig, resolve_api_key

log = logging.getLogger(__name__)


def add_frontend_arguments(parser: argparse.ArgumentParser, with_triton: bool = True) -> None:
    """Options shared with `dspark-trt serve --openai-port` (with_triton=False there: it knows its server)."""
    d = OpenAIConfig()
    if with_triton:
        parser.add_argument("--triton-url", default=d.triton_url,
                            help="Triton's gRPC endpoint HOST:PORT (default: %(default)s)")
        parser.add_argument("--repo", type=Path, default=None,
                            help="read the build's limits from this model repository instead of asking Triton")
    parser.add_argument("--served-model-name", default=d.model_name,
                        help="model id in /v1/models (default: the build directory's name)")
    parser.add_argument("--tokenizer", type=Path, default=d.tokenizer_dir,
                        help="tokenizer directory (default: BUILD_DIR/tokenizer from the dspark model's config)")
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                        help="/v1/completions max_tokens when a request has none (default: %(default)s; chat: the "
                             "room left)")
    parser.add_argument("--default-temperature", type=float, default=d.default_temperature,
                        help="temperature when a request has none (default: %(default)s = greedy)")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                        help="seconds one request may stream from Triton (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N",
                        help="largest request body accepted; larger ones get HTTP 413 (default: %(default)s = 1 MiB)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require `Authorization: Bearer KEY` on every /v1/... request (401 otherwise; /health "
                             f"stays open); default: ${API_KEY_ENV} when set (safer than the flag, which `ps` shows "
                             "to other users), else no key")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = OpenAIConfig()
    parser.add_argument("--host", default=d.host, help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="port to listen on (default: %(default)s)")
    add_frontend_arguments(parser)
    parser.add_argument("--log-level", default=d.log_level, help="uvicorn log level (default: %(default)s)")


def config_from_args(args: argparse.Namespace, **overrides: object) -> OpenAIConfig:
    fields = dict(model_name=args.served_model_name, tokenizer_dir=args.tokenizer,
                  default_max_tokens=args.default_max_tokens, default_temperature=args.default_temperature,
                  request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                  api_key=resolve_api_key(getattr(args, "api_key", None)))
    for name in ("triton_url", "repo", "host", "port", "log_level"):
        if hasattr(args, name):
            fields[name] = getattr(args, name)
    fields.update(overrides)
    return OpenAIConfig(**fields)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    from dspark_trt.serve.openai.server import serve_forever  # noqa: PLC0415

    if args.default_max_tokens < 1:
        raise InvalidArgumentError(f"--default-max-tokens must be ≥ 1, got {args.default_max_tokens}")
    config = config_from_args(args)
    log.info("starting the OpenAI-compatible API on %s:%d → Triton %s (%s)", config.host, config.port,
             config.triton_url, "API key required" if config.api_key is not None else "no API key")
    if not serve_forever(config):
        raise ServeError(f"the OpenAI frontend did not start (Triton at {config.triton_url} unreachable, or port "
                         f"{config.port} taken?); see the log above")
    return 0
