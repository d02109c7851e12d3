"""The wire protocol of the OpenAI-compatible frontend: request bodies of /v1/completions and
/v1/chat/completions (pydantic; unknown fields are ignored and logged, as vLLM and trtllm-serve do), the checks
OpenAI clients expect (n = 1, stop strings, unsupported options named), the DSpark extension fields, the
OpenAI error shape, and the incremental text of one choice (stop strings cut on the detokenized text).

Owns: CompletionRequest, ChatCompletionRequest, OpenAIError (+ error_body, `bad`: the 400 of a wire-format check;
the checks against the build are serve.validate's RequestError, mapped to the same 400 by serve.openai.app),
`finish_reason` (the `dspark` model's finish_reason output → OpenAI's), StreamText. Responses are the openai SDK's
own types (openai.types.Completion, ChatCompletion, ChatCompletionChunk, CompletionUsage), built in
dspark_trt.serve.openai.app.
"""
from __future__ import annotations

import logging
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from dspark_trt.serve.text import CONTEXT_TOKENS, delta_text

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share, plus the DSpark extensions (policy, min_k, max_k, return_stats)."""

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

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise bad("stop contains an empty string; remove it", "stop")
        return tuple(stops)

    def check_supported(self) -> None:
        """400 for options this server does not implement (rather than silently ignoring them)."""
        if self.n not in (None, 1):
            raise bad(f"n must be 1 (one choice per request), got {self.n}; send concurrent requests instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad(f"{name} is not supported by DSpark speculative decoding (lossless sampling only); "
                          "omit it or send 0", name)
        if self.logit_bias:
            raise bad("logit_bias is not supported; omit it", "logit_bias")
        extra = sorted(self.model_extra or {})
        if extra:
            log.warning("ignoring unknown request field(s): %s", ", ".join(extra))


class CompletionRequest(_Common):
    """POST /v1/completions: one prompt (a string, [string], token ids or [token ids])."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad("echo is not supported; omit it", "echo")
        if self.logprobs is not None:
            raise bad("logprobs is not supported; omit it", "logprobs")
        if self.best_of not in (None, 1):
            raise bad(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.suffix:
            raise bad("suffix is not supported; omit it", "suffix")

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
            return p
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
            raise bad("logprobs is not supported; omit it", "logprobs")
        if self.tools:
            raise bad("tools are not supported by this server; omit them", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad("response_format other than text is not supported", "response_format")
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
