"""Hosting the OpenAI-compatible frontend (dspark_trt.serve.openai.app) with uvicorn.

Owns: OpenAIServer (uvicorn in a background thread: `serve --openai-port`, tests) and serve_forever (uvicorn in
the foreground: `dspark-trt openai`); both warn before binding beyond loopback without an API key
(serve.openai.auth.warn_if_exposed). Settings are serve.openai.config.OpenAIConfig. Light to import: FastAPI,
uvicorn and the app load on start.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from dspark_trt.errors import ServeError
from dspark_trt.serve.openai.config import OpenAIConfig

log = logging.getLogger(__name__)

__all__ = ["OpenAIServer", "serve_forever"]


def _uvicorn_server(config: OpenAIConfig) -> Any:
    """uvicorn.Server for app_for(config), not started; warns first if it will listen beyond loopback without a key."""
    import uvicorn  # noqa: PLC0415

    from dspark_trt.serve.openai.app import app_for  # noqa: PLC0415
    from dspark_trt.serve.openai.auth import warn_if_exposed  # noqa: PLC0415

    warn_if_exposed(config)
    return uvicorn.Server(uvicorn.Config(app_for(config), host=config.host, port=config.port,
                                         log_level=config.log_level, access_log=False))


class OpenAIServer:
    """uvicorn serving app_for(config) in a background thread (`dspark-trt serve --openai-port`, tests)."""

    def __init__(self, config: OpenAIConfig) -> None:
        from dspark_trt.serve.server import free_port  # noqa: PLC0415

        self.config = config if config.port else replace(config, port=free_port())
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL (what openai.OpenAI(base_url=...) takes)."""
        return f"http://{self.config.host}:{self.config.port}/v1"

    def start(self, timeout: float = 300.0) -> "OpenAIServer":
        self._server = _uvicorn_server(self.config)
        self._thread = threading.Thread(target=self._server.run, name="openai-frontend", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"the OpenAI frontend did not start on {self.url} (see the log above: Triton at "
                                 f"{self.config.triton_url} unreachable, or the port taken?)")
            time.sleep(0.05)
        log.info("OpenAI-compatible API on %s", self.url)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(config: OpenAIConfig) -> bool:
    """uvicorn in the foreground until SIGINT/SIGTERM (`dspark-trt openai`); False if it could not start."""
    import signal  # noqa: PLC0415

    server = _uvicorn_server(config)

    def stopped(signum: int, frame: object) -> None:  # uvicorn re-raises the signal it handled after shutdown
        log.info("%s: OpenAI frontend stopped", signal.Signals(signum).name)

    old = {s: signal.signal(s, stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except SystemExit:  # uvicorn's exit on a startup failure (port taken); logged by uvicorn
        return False
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return bool(server.started)
