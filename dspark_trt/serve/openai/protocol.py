"""The wire protocol of the OpenAI-compatible frontend: request bodies of /v1/completions and
/v1/chat/completions (pydantic; unknown fields are ignored and logged, as vLLM and trtllm-serve do), the checks
OpenAI clients expect (n = 1, unsupported options named), the DSpark extension fields, the OpenAI error shape,
and the incremental text of one choice (stop strings cut on the detokenized text).

Known OpenAI parameters this server does not implement (UNSUPPORTED: penalties, logit_bias, logprobs, tools, ...)
are answered as OpenAI answers a parameter a model does not support: HTTP 400 naming the parameter, code
`unsupported_parameter` (or `unsupported_value` where only some values are: n, best_of, response_format, ...), when
the value would change the output; their neutral value (0, null, empty, false, "text") is accepted. Parameters that
cannot change the output (user, metadata, store, service_tier, parallel_tool_calls, prediction) and unknown fields
are ignored (unknown ones logged). Texts (prompt, message contents, stop strings) must be valid Unicode
(serve.validate.check_text: no lone surrogates); stop strings follow serve.validate.check_stop_strings.

Owns: CompletionRequest, ChatCompletionRequest, OpenAIError (+ error_body, `bad`: the 400 of a wire-format check;
the checks against the build are serve.validate's RequestError, mapped to the same 400 by serve.openai.app),
`finish_reason` (the `dspark` model's finish_reason output → OpenAI's), StreamText. Responses are the openai SDK's
own types (openai.types.Completion, ChatCompletion, ChatCompletionChunk, CompletionUsage), built in
dspark_trt.serve.openai.app.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from dspark_trt.serve.text import CONTEXT_TOKENS, delta_text
from dspark_trt.serve.validate import check_stop_strings, check_text

log = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # OpenAI's code: the parameter is not supported at all
UNSUPPORTED_VALUE = "unsupported_value"  # OpenAI's code: the parameter is, but not this value


def _empty(v: Any) -> bool:
    return not v


# Known OpenAI parameters without an implementation here: name → (is the value neutral?, code, what to do). A
# non-neutral value is a 400; the neutral one is accepted (clients that always send defaults keep working).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "n": (lambda v: v in (None, 1), UNSUPPORTED_VALUE,
          "n must be 1 (one choice per request); send concurrent requests instead (they are batched in flight)"),
    "best_of": (lambda v: v in (None, 1), UNSUPPORTED_VALUE, "best_of must be 1; omit it"),
    "presence_penalty": (_empty, UNSUPPORTED_PARAMETER,
                         "presence_penalty is not supported by DSpark speculative decoding (lossless sampling "
                         "only); omit it or send 0"),
    "frequency_penalty": (_empty, UNSUPPORTED_PARAMETER,
                          "frequency_penalty is not supported by DSpark speculative decoding (lossless sampling "
                          "only); omit it or send 0"),
    "logit_bias": (_empty, UNSUPPORTED_PARAMETER, "logit_bias is not supported; omit it"),
    "top_logprobs": (_empty, UNSUPPORTED_PARAMETER, "top_logprobs is not supported; omit it"),
    "echo": (_empty, UNSUPPORTED_PARAMETER, "echo is not supported; omit it"),
    "suffix": (_empty, UNSUPPORTED_PARAMETER, "suffix is not supported; omit it"),
    "tools": (_empty, UNSUPPORTED_PARAMETER, "tools are not supported by this server; omit them"),
    "functions": (_empty, UNSUPPORTED_PARAMETER, "functions are not supported by this server; omit them"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), UNSUPPORTED_VALUE,
                    "tool_choice other than \"none\" / \"auto\" is not supported (no tools); omit it"),
    "function_call": (lambda v: v in (None, "none", "auto"), UNSUPPORTED_VALUE,
                      "function_call other than \"none\" / \"auto\" is not supported (no functions); omit it"),
    "response_format": (lambda v: v is None or (isinstance(v, dict) and v.get("type", "text") == "text"),
                        UNSUPPORTED_VALUE, "response_format other than {\"type\": \"text\"} is not supported; "
                        "omit it"),
    "audio": (lambda v: v is None, UNSUPPORTED_PARAMETER, "audio output is not supported; omit it"),
    "modalities": (lambda v: v in (None, ["text"]), UNSUPPORTED_VALUE, "modalities other than [\"text\"] are not "
                   "supported; omit it"),
    "reasoning_effort": (lambda v: v is None, UNSUPPORTED_PARAMETER,
                         "reasoning_effort is not supported with this model; omit it"),
}
# Known OpenAI parameters accepted and ignored: none of them changes the generated text.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction")


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 naming the offending parameter."""
    return OpenAIError(400, message, param, code)


_JSON_FIX = "Fix: send one JSON object, UTF-8 encoded, with Content-Type: application/json"
ROUTES = "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health"


def validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """FastAPI's RequestValidationError.errors() → the 400: a body that is not JSON, or the first fields that do not
    fit the request model (param: the first one's top-level field)."""
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        loc, ctx = bad_json.get("loc", ()), bad_json.get("ctx") or {}
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return bad(f"We could not parse the JSON body of your request ({ctx.get('error', 'JSON decode error')}"
                   f"{where}). {_JSON_FIX}.")
    loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x != "body"]
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return bad(f"invalid request: {_short(msg, 2000)}", loc[0] if loc else None)


def http_error(status: int, detail: str, method: str, path: str) -> OpenAIError:
    """Starlette's own HTTP errors in OpenAI's shape: an unknown URL (404), a wrong method (405), a body FastAPI
    could not read (400: not UTF-8 JSON)."""
    where = f"{method} {path if len(path) <= 200 else path[:200] + '…'}"
    if status == 404:
        return OpenAIError(404, f"Invalid URL ({where}); this server answers {ROUTES}")
    if status == 405:
        return OpenAIError(405, f"Method not allowed ({where}); this server answers {ROUTES}")
    if status == 400:
        return bad(f"We could not parse the JSON body of your request (not UTF-8 JSON: {detail}). {_JSON_FIX}.")
    return OpenAIError(status, f"{detail} ({where})")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share, plus the DSpark extensions (policy, min_k, max_k, return_stats, proposers)."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # DSpark extensions (the openai SDK sends them with extra_body={...})
    policy: str | None = None
    min_k: int | None = Field(None, ge=0)
    max_k: int | None = Field(None, ge=0)
    return_stats: bool = False
    # who proposes the drafts: "dspark" | "suffix" | "dspark,suffix" | "none" (or a list of names); absent: the
    # server's. Checked by serve.validate.check_proposers in Frontend.prepare (the one validator).
    proposers: str | list[str] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple, checked by serve.validate.check_stop_strings (a RequestError: 400 naming `stop`)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return check_stop_strings(stops, "stop")

    def _value(self, name: str) -> Any:
        return getattr(self, name) if name in type(self).model_fields else (self.model_extra or {}).get(name)

    def check_supported(self) -> None:
        """400 for a known OpenAI parameter this server does not implement, unless its value is the neutral one
        (UNSUPPORTED); unknown fields are logged and ignored."""
        for name, (neutral, code, message) in UNSUPPORTED.items():
            value = self._value(name)
            if not neutral(value):
                raise bad(f"{message} (got {_short(value)})", name, code)
        extra = sorted(k for k in (self.model_extra or {}) if k not in UNSUPPORTED and k not in IGNORED)
        if extra:
            log.warning("ignoring unknown request field(s): %s", ", ".join(_short(k) for k in extra[:10]))


def _short(value: Any, limit: int = 60) -> str:
    """A value for a message or a log line: repr, cut to `limit` characters (bodies may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt (a string, [string], token ids or [token ids])."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise bad(f"logprobs is not supported; omit it (got {self.logprobs})", "logprobs", UNSUPPORTED_PARAMETER)

    def one_prompt(self) -> str | list[int]:
        """The single prompt as text or token ids (400 for a batch of prompts)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad(f"send one prompt per request, got {len(p)}; concurrent requests are batched in flight",
                          "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p.strip():
                raise bad("prompt is empty; send a non-empty prompt", "prompt")
            return check_text(p, "prompt")
        if not p:
            raise bad("prompt is empty; send a non-empty prompt", "prompt")
        return [int(t) for t in p]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"} for the tokenizer's chat template (text parts joined; "developer" → "system")."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise bad(f"message content part of type {part.type!r} is not supported; send text parts",
                              "messages")
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = self.content or ""
        check_text(content, "message content", "messages")
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions: messages through the build tokenizer's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise bad("logprobs is not supported; omit it or send false", "logprobs", UNSUPPORTED_PARAMETER)
        if not any((m.as_template_message()["content"]).strip() for m in self.messages):
            raise bad("every message is empty; send a non-empty prompt", "messages")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def finish_reason(backend_reason: str | None) -> str:
    """The `dspark` model's finish_reason ("eos", "length", "stop", "stopped", ...) → OpenAI's "length" or
    "stop"."""
    return "length" if backend_reason == "length" else "stop"


class StreamText:
    """The text of one choice, built from streamed token ids: incremental detokenization (serve.text.delta_text,
    as the `dspark` model does for the ensembles) and stop strings matched on the text. While streaming, the last
    len(longest stop) − 1 characters are held back so a stop string split across responses is still cut before
    anything of it was sent; the stop string itself is not part of the output (OpenAI's rule)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.pending = ""  # decoded but held back
        self.stopped = False  # a stop string was hit

    def feed(self, new_ids: Sequence[int], final: bool) -> str:
        """The text to emit now for new_ids (all the rest when final)."""
        if self.stopped:
            return ""
        delta = delta_text(self.tokenizer, self.ids[-CONTEXT_TOKENS:], list(new_ids), final)
        self.ids.extend(int(t) for t in new_ids)
        buf = self.pending + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = buf[:min(hits)], "", True
        else:
            cut = len(buf) if final else max(0, len(buf) - self.hold)
            out, self.pending = buf[:cut], buf[cut:]
        self.text += out
        return out
