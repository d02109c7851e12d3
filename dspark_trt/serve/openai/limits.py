"""The request-size limit of the OpenAI-compatible frontend: bodies larger than OpenAIConfig.max_body_bytes
(`--max-body-bytes`, default DEFAULT_MAX_BODY_BYTES = 1 MiB) are answered with HTTP 413 in OpenAI's error shape
(code `request_too_large`, a "Fix:" line), before the JSON is parsed or anything is tokenized.

Owns: BodyLimitMiddleware (the ASGI layer serve.openai.app installs inside the API-key check: a request without
the key gets its 401 without its body being read) and RequestTooLargeError (that 413: an OpenAIError and a
DsparkError). A Content-Length above the limit is refused at once; a chunked body is counted as it arrives. Either
way the rest of the body is read and dropped (up to DRAIN_FACTOR times the limit) before the answer, so a client
still writing its body reads the 413 instead of a reset connection. The other request limits (prompt tokens,
max_tokens, stop strings, ...) are serve.validate's, the same for every entry point; docs/serving.md has the table.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from dspark_trt.errors import DsparkError
from dspark_trt.serve.openai.config import DEFAULT_MAX_BODY_BYTES
from dspark_trt.serve.openai.protocol import OpenAIError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "REQUEST_TOO_LARGE", "BodyLimitMiddleware", "RequestTooLargeError"]

REQUEST_TOO_LARGE = "request_too_large"  # the 413's code
DRAIN_FACTOR = 16  # read (and drop) at most this many times the limit of an oversized body before answering


class RequestTooLargeError(OpenAIError, DsparkError):
    """A request body over the limit: HTTP 413 `request_too_large`; the message names the size, the limit and the
    fix."""

    def __init__(self, size: int, limit: int, declared: bool) -> None:
        what = f"{size} bytes (Content-Length)" if declared else f"more than {limit} bytes"
        super().__init__(413, f"Request body too large: {what}; this server accepts at most {limit} bytes. Fix: "
                              "send a shorter prompt (or fewer messages), or start the server with a larger "
                              "--max-body-bytes.", None, REQUEST_TOO_LARGE)


def _content_length(scope: dict[str, Any]) -> int | None:
    raw = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
    try:
        return int(raw) if raw is not None else None
    except ValueError:  # the HTTP server rejects a malformed one before we see it
        return None


class BodyLimitMiddleware:
    """ASGI middleware: an HTTP request body of more than `max_bytes` bytes → 413 in OpenAI's shape; a smaller one
    is read here and handed to the app unchanged (later receive() calls, e.g. the disconnect watch of a streamed
    answer, go to the server as before)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send, RequestTooLargeError(declared, self.max_bytes, True), 0)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # the client went away while sending: nobody to answer
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                more = bool(message.get("more_body"))
                await self._reject(scope, receive, send, RequestTooLargeError(size, self.max_bytes, False),
                                   size if more else -1)
                return
            chunks.append(body)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict[str, Any], receive: Any, send: Any, err: RequestTooLargeError,
                      read: int) -> None:
        """Drain what is left of the body (read = bytes so far; -1: all of it was read), then answer 413."""
        while read >= 0 and read <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            read += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        client = scope.get("client") or ("?", 0)
        log.info("413 %s %s from %s: body over %d bytes", scope.get("method"), scope.get("path"), client[0],
                 self.max_bytes)
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
