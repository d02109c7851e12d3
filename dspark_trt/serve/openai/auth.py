"""API-key authentication of the OpenAI-compatible frontend.

Owns: APIKeyMiddleware (the ASGI layer, installed by serve.openai.app when OpenAIConfig.api_key is set, that answers
every /v1/... request without `Authorization: Bearer <key>` with HTTP 401 in OpenAI's error shape, code
`invalid_api_key`; /health and FastAPI's /docs, /openapi.json stay open), APIKeyError (that 401: an OpenAIError and
a DsparkError), check_authorization (the constant-time check of one header value) and the startup warning for a
frontend that listens beyond loopback without a key (is_loopback, exposure_warning, warn_if_exposed). Where the key
comes from (--api-key / DSPARK_API_KEY) is serve.openai.config's. The key is never logged, not even a prefix of it.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from typing import Any

from dspark_trt.errors import DsparkError
from dspark_trt.serve.openai.config import API_KEY_ENV, OpenAIConfig
from dspark_trt.serve.openai.protocol import OpenAIError

log = logging.getLogger(__name__)

__all__ = ["INVALID_API_KEY", "PROTECTED_PREFIX", "APIKeyError", "APIKeyMiddleware", "check_authorization",
           "exposure_warning", "is_loopback", "warn_if_exposed"]

INVALID_API_KEY = "invalid_api_key"  # OpenAI's error code of a 401
PROTECTED_PREFIX = "/v1"  # what needs the key; everything else (health) stays open
_FIX = (f"Fix: send the header 'Authorization: Bearer <key>' with the key the server was started with (--api-key / "
        f"{API_KEY_ENV}); with the openai SDK: openai.OpenAI(base_url=..., api_key=KEY).")


class APIKeyError(OpenAIError, DsparkError):
    """A /v1 request without the server's API key: 401 `invalid_api_key`; `reason` (what is wrong, short: what the
    log says) + the fix is the message."""

    def __init__(self, reason: str) -> None:
        super().__init__(401, f"{reason}. {_FIX}", None, INVALID_API_KEY)
        self.reason = reason


def check_authorization(header: bytes | None, key: bytes) -> APIKeyError | None:
    """None when `header` (the raw Authorization value) is `Bearer <key>`; else the 401 to answer. The token is
    compared with hmac.compare_digest (constant time in the content) and never appears in the message."""
    if header is None or not header.strip():
        return APIKeyError("Missing API key: this server requires one and the request has no Authorization header")
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return APIKeyError("Malformed Authorization header: expected 'Bearer <key>'")
    if not hmac.compare_digest(token.strip(), key):
        return APIKeyError("Incorrect API key provided")
    return None


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


class APIKeyMiddleware:
    """ASGI middleware: /v1/... needs `Authorization: Bearer <api_key>` (also for unknown /v1 paths, so a caller
    without the key learns nothing of the routes); other paths and non-HTTP scopes pass through."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("ascii")  # OpenAIConfig checked it is printable ASCII

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}(protects {PROTECTED_PREFIX}/...)"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        err = check_authorization(header, self._key)
        if err is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.info("401 %s %s from %s: %s", scope.get("method"), scope.get("path"), client[0], err.reason)
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="dspark_trt"')]})
        await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: localhost, 127.0.0.0/8, ::1 (brackets allowed)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:  # another host name, or "" (all interfaces)
        return False


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The warning to log when the frontend listens beyond loopback without an API key (None: nothing to warn)."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"the OpenAI frontend listens on {host}:{port}, beyond loopback, without an API key: anyone who can "
            f"reach this port can use the model. Set a key with --api-key KEY or the {API_KEY_ENV} environment "
            "variable (clients then send 'Authorization: Bearer KEY'), or listen on 127.0.0.1 (--host)")


def warn_if_exposed(config: OpenAIConfig) -> None:
    """Log exposure_warning for `config` (at startup, before binding); an info line that a key is required."""
    warning = exposure_warning(config.host, config.port, config.api_key)
    if warning is not None:
        log.warning("%s", warning)
    elif config.api_key is not None:
        log.info("OpenAI frontend: %s/... requires an API key (Authorization: Bearer)", PROTECTED_PREFIX)
