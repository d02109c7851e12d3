"""OpenAI-compatible HTTP frontend in front of a running tritonserver: /v1/models, /v1/completions and
/v1/chat/completions (JSON or `stream: true` as SSE `data: {...}` chunks ending with `data: [DONE]`), /health.

Owns: ModelInfo + load_model (the build behind the server: served name, serve.config.ServeConfig, tokenizer),
Frontend (the request logic) and `create_app` / `app_for` (the FastAPI app). Settings are
serve.openai.config.OpenAIConfig; hosting with uvicorn (OpenAIServer, serve_forever) is serve.openai.server's.

How a request runs: the frontend checks the OpenAI wire format (serve.openai.protocol), tokenizes with the build's
tokenizer (the chat template for chat; this is also what `usage.prompt_tokens` counts), validates the request at
this edge with the served checks (serve.validate.check_prompt / check_generation: 400 before anything reaches
Triton, the same messages the Triton models give), streams token ids from the decoupled `dspark` model over gRPC
(serve.clients.aio_client), detokenizes incrementally and cuts stop strings on the text (protocol.StreamText); the
finish reason is the model's `finish_reason` output. A client that disconnects, or a stop string, closes the
backend stream: the gRPC call is cancelled and a `stop` request is sent; either ends the request in the `dspark`
stub's one cancellation path and frees its KV slot. Errors keep OpenAI's shape: 404 unknown model, 400 bad
parameter / empty or over-long prompt (a RequestError: its param and code), 503 Triton unreachable; with
OpenAIConfig.api_key set, 401 `invalid_api_key` for a /v1 request without it (serve.openai.auth's middleware).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from openai.types import Completion, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from dspark_trt.errors import DsparkError, RequestError, ServeError
from dspark_trt.serve.clients.aio_client import DsparkAioClient, TritonUnavailableError
from dspark_trt.serve.clients.client import GenerationRequest
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.openai.auth import APIKeyMiddleware
from dspark_trt.serve.openai.config import OpenAIConfig
from dspark_trt.serve.openai.limits import BodyLimitMiddleware
from dspark_trt.serve.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, StreamText,
                                              bad, finish_reason, http_error, validation_error)
from dspark_trt.serve.validate import OPENAI_NAMES, check_generation, check_prompt, proposers_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend knows of the build behind the server."""

    name: str
    serve: ServeConfig  # with vocab_size = the tokenizer's (what token-id prompts are checked against)
    tokenizer_dir: Path


def _config_from_pbtxt(path: Path) -> dict[str, Any]:
    from google.protobuf import json_format, text_format  # noqa: PLC0415
    from tritonclient.grpc import model_config_pb2  # noqa: PLC0415

    if not path.is_file():
        raise ServeError(f"{path} is missing: pass the model repository written by `dspark-trt build` "
                         "(build/NAME/model_repo)")
    msg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _triton_model_config(config: OpenAIConfig) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient  # noqa: PLC0415
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

    client = grpcclient.InferenceServerClient(config.triton_url)
    try:
        out = client.get_model_config(config.triton_model, as_json=True, client_timeout=10.0)
    except InferenceServerException as exc:
        raise TritonUnavailableError(f"cannot read the {config.triton_model!r} model config from Triton at "
                                     f"{config.triton_url} ({exc.message()}); start `dspark-trt serve` first, or "
                                     "pass --repo (and --tokenizer) to start without it") from exc
    finally:
        client.close()
    return dict(out.get("config", out))


def load_model(config: OpenAIConfig) -> tuple[ModelInfo, Any]:
    """(ModelInfo, tokenizer): the build's config from the repository on disk (config.repo) or from the running
    server's `dspark` model config; the tokenizer from config.tokenizer_dir or BUILD_DIR/tokenizer."""
    from dspark_trt.runtime.hf_loader import load_tokenizer  # noqa: PLC0415

    if config.repo is not None:
        raw = _config_from_pbtxt(Path(config.repo) / config.triton_model / "config.pbtxt")
    else:
        raw = _triton_model_config(config)
    serve = ServeConfig.from_model_config(raw)
    tok = Path(config.tokenizer_dir) if config.tokenizer_dir is not None else serve.build / "tokenizer"
    if not tok.is_dir():
        raise ServeError(f"tokenizer directory {tok} not found (the build's BUILD_DIR is not on this machine?); "
                         "pass --tokenizer DIR (the build's tokenizer/ directory)")
    tokenizer = load_tokenizer(tok)
    return ModelInfo(config.model_name or serve.build.name, serve.with_vocab(len(tokenizer)), tok), tokenizer


def _render(model: Any) -> str:
    return model.model_dump_json(exclude_unset=True) if hasattr(model, "model_dump_json") else json.dumps(model)


def _json(body: Any, status: int = 200) -> Any:
    return Response(_render(body), status_code=status, media_type="application/json")


def _oai_error(exc: BaseException) -> OpenAIError:
    """Any failure of a request → the OpenAI error to answer."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, TritonUnavailableError):
        return OpenAIError(503, str(exc), code="triton_unavailable")
    if isinstance(exc, RequestError):  # the served request checks (serve.validate), or what `dspark` rejected
        return OpenAIError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, DsparkError):
        return OpenAIError(500, str(exc))
    log.error("unexpected error in the OpenAI frontend", exc_info=exc)
    return OpenAIError(500, f"internal error ({type(exc).__name__}: {exc}); see the frontend's log")


@dataclass
class _Job:
    """One request, prepared: prompt ids, the backend request, stop strings and what to return."""

    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    gen: GenerationRequest
    stops: tuple[str, ...]
    include_usage: bool
    return_stats: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Piece:
    text: str
    tokens: int  # completion tokens so far
    finish: str | None = None
    stats: dict[str, Any] | None = None


class Frontend:
    """The request logic behind the routes (one per app, created at startup)."""

    def __init__(self, config: OpenAIConfig, client: DsparkAioClient, info: ModelInfo, tokenizer: Any) -> None:
        self.config, self.client, self.info, self.tokenizer = config, client, info, tokenizer

    # ---- preparing ----------------------------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.info.name:
            raise OpenAIError(404, f"The model `{name}` does not exist; this server serves `{self.info.name}` "
                              "(GET /v1/models)", "model", "model_not_found")

    def _encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad("this model's tokenizer has no chat template; use /v1/completions with a formatted prompt",
                      "messages")
        msgs = [m.as_template_message() for m in body.messages]
        try:
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except (TemplateError, ValueError) as exc:  # the template's own raise_exception (roles must alternate, ...)
            raise bad(f"the model's chat template rejected these messages ({exc}); send the roles it accepts, or "
                      "use /v1/completions with a formatted prompt", "messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _encode_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.one_prompt()
        if isinstance(prompt, list):  # token ids: check_prompt checks them against the vocabulary
            return prompt
        return [int(t) for t in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> _Job:
        """The OpenAI body → the backend request, validated here (the edge of this process): the wire format by
        protocol, the prompt and generation parameters against the build by serve.validate (RequestError → 400)."""
        self._check_model(body.model)
        body.check_supported()
        chat = isinstance(body, ChatCompletionRequest)
        ids = self._encode_chat(body) if chat else self._encode_prompt(body)  # type: ignore[arg-type]
        cfg = self.info.serve
        check_prompt(ids, cfg, "the prompt", "messages" if chat else "prompt")
        asked = body.requested_max_tokens() if chat else body.max_tokens  # type: ignore[union-attr]
        left = cfg.room - len(ids)
        max_tokens = asked if asked is not None else (left if chat else min(self.config.default_max_tokens, left))
        temperature = self.config.default_temperature if body.temperature is None else body.temperature
        params = check_generation(len(ids), cfg, max_tokens=max_tokens, temperature=temperature, top_p=body.top_p,
                                  seed=body.seed, policy=body.policy, min_k=body.min_k, max_k=body.max_k,
                                  proposers=body.proposers, names=OPENAI_NAMES)
        stops = body.stop_strings()
        # stop strings are matched on the text as it arrives, so the backend streams to let them cut early
        gen = GenerationRequest(prompt="", max_tokens=max_tokens, stream=body.stream or bool(stops),
                                temperature=temperature, top_p=body.top_p, random_seed=body.seed, policy=body.policy,
                                min_k=body.min_k, max_k=body.max_k, return_stats=body.return_stats,
                                proposers=proposers_text(params.proposers))
        return _Job("chat" if chat else "completion", ids, gen, stops,
                    bool(body.stream_options and body.stream_options.include_usage), body.return_stats)

    # ---- generating ---------------------------------------------------------------------------------------
    async def pieces(self, job: _Job) -> AsyncIterator[_Piece]:
        """Text pieces as the backend commits tokens; the last one carries finish_reason (and stats)."""
        text = StreamText(self.tokenizer, job.stops)
        backend = self.client.stream(job.prompt_ids, job.gen, f"oai-{job.id}")
        async with contextlib.aclosing(backend):
            async for chunk in backend:
                out = text.feed(chunk.ids, chunk.final)
                if text.stopped:  # closing the backend stream (aclosing) stops the request in Triton
                    yield _Piece(out, len(text.ids), "stop", chunk.stats)
                    return
                if chunk.final:
                    yield _Piece(out, len(text.ids), finish_reason(chunk.finish_reason), chunk.stats)
                    return
                if out:
                    yield _Piece(out, len(text.ids))

    def _usage(self, job: _Job, completion_tokens: int) -> Any:
        return CompletionUsage(prompt_tokens=len(job.prompt_ids), completion_tokens=completion_tokens,
                               total_tokens=len(job.prompt_ids) + completion_tokens)

    def _extras(self, job: _Job, last: _Piece) -> dict[str, Any]:
        return {"dspark_stats": last.stats} if job.return_stats and last.stats is not None else {}

    async def complete(self, job: _Job) -> Any:
        """The whole answer as one openai.types.Completion / ChatCompletion."""
        parts: list[str] = []
        last = _Piece("", 0, "stop")
        async for p in self.pieces(job):
            parts.append(p.text)
            last = p
        text, usage, extras = "".join(parts), self._usage(job, last.tokens), self._extras(job, last)
        name = self.info.name
        if job.kind == "chat":
            return ChatCompletion(id=f"chatcmpl-{job.id}", object="chat.completion", created=job.created, model=name,
                                  choices=[{"index": 0, "finish_reason": last.finish or "stop",
                                            "message": {"role": "assistant", "content": text}}],
                                  usage=usage, **extras)
        return Completion(id=f"cmpl-{job.id}", object="text_completion", created=job.created, model=name,
                          choices=[{"index": 0, "text": text, "finish_reason": last.finish or "stop"}],
                          usage=usage, **extras)

    def _chunk(self, job: _Job, text: str | None, finish: str | None, role: bool = False,
               extras: dict[str, Any] | None = None) -> str:
        base = {"created": job.created, "model": self.info.name, **(extras or {})}
        if job.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return _render(ChatCompletionChunk(id=f"chatcmpl-{job.id}", object="chat.completion.chunk",
                                               choices=[{"index": 0, "delta": delta, "finish_reason": finish}], **base))
        # openai.types.CompletionChoice requires a finish_reason, which streamed chunks leave null: plain JSON
        return json.dumps({"id": f"cmpl-{job.id}", "object": "text_completion", **base,
                           "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]})

    async def sse(self, job: _Job, first: _Piece | None, rest: AsyncIterator[_Piece]) -> AsyncIterator[str]:
        """`data: {...}` events; `first` was awaited before the response started (so early errors get a status)."""
        def event(payload: str) -> str:
            return f"data: {payload}\n\n"

        try:
            if job.kind == "chat":
                yield event(self._chunk(job, "", None, role=True))
            last = piece = first
            while piece is not None:
                if piece.text:
                    yield event(self._chunk(job, piece.text, None))
                last = piece
                if piece.finish is not None:
                    break
                piece = await anext(rest, None)
            if last is not None:
                yield event(self._chunk(job, None, last.finish, extras=self._extras(job, last)))
                if job.include_usage:
                    yield event(self._usage_chunk(job, last))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - after the status line: OpenAI's in-stream error event
            yield event(json.dumps(_oai_error(exc).body()))
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    def _usage_chunk(self, job: _Job, last: _Piece) -> str:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        chat = job.kind == "chat"
        return json.dumps({"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id}",
                           "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": job.created, "model": self.info.name, "choices": [],
                           "usage": self._usage(job, last.tokens).model_dump(exclude_none=True)})


async def _until_disconnected(receive: Callable[[], Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def app_for(config: OpenAIConfig, model: tuple[ModelInfo, Any] | None = None) -> Any:
    """The FastAPI application for `config` (model: load_model(config), loaded now when not given); the Triton
    gRPC client is created at startup, inside the server's event loop."""
    info, tokenizer = model if model is not None else load_model(config)
    state: dict[str, Frontend] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = DsparkAioClient(config.triton_url, config.triton_model, config.request_timeout_s)
        state["fe"] = Frontend(config, client, info, tokenizer)
        log.info("OpenAI frontend for model %r (Triton %s, tokenizer %s, %s)", info.name, config.triton_url,
                 info.tokenizer_dir, "API key required" if config.api_key is not None else "no API key")
        yield
        await client.close()

    app = FastAPI(title="dspark_trt OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)  # 413 before the JSON is parsed
    if config.api_key is not None:  # /v1/... needs `Authorization: Bearer <key>`; /health stays open
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)  # added last = outermost: 401 first

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> Any:
        return _json(exc.body(), exc.status)

    @app.exception_handler(Exception)
    async def on_any_error(request: Request, exc: Exception) -> Any:  # the last resort: still OpenAI's shape
        err = _oai_error(exc)
        return _json(err.body(), err.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Any:
        return _json(validation_error(exc.errors()).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Any:  # 404 / 405 / unparsable body
        err = http_error(exc.status_code, str(exc.detail), request.method, request.url.path)
        return _json(err.body(), err.status)

    @app.get("/health")
    async def health() -> Any:
        ok = await state["fe"].client.is_ready()
        return _json({"status": "ok" if ok else "triton unavailable"}, 200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> Any:
        return _json({"object": "list", "data": [_model_card(state["fe"].info).model_dump(exclude_unset=True)]})

    @app.get("/v1/models/{model}")
    async def model(model: str) -> Any:
        fe = state["fe"]
        fe._check_model(model)
        return _json(_model_card(fe.info))

    async def run(body: CompletionRequest | ChatCompletionRequest, request: Request) -> Any:
        fe = state["fe"]
        try:
            job = fe.prepare(body)
            if not body.stream:
                return _json(await _unless_disconnected(fe.complete(job), request))
            rest = fe.pieces(job)
            try:  # the first piece before the status line: errors up to the first token get their status
                first = await _unless_disconnected(anext(rest, None), request)
            except BaseException:
                await rest.aclose()
                raise
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure leaves in OpenAI's error shape
            raise _oai_error(exc) from exc
        return _SSE(fe.sse(job, first, rest), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _unless_disconnected(coro: Any, request: Request) -> Any:
        """Await coro; if the client goes away first, cancel it (which stops the request in Triton)."""
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(_until_disconnected(request.receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            log.info("client disconnected; request cancelled")
            raise OpenAIError(499, "client disconnected")
        return work.result()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await run(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await run(body, request)

    class _SSE(StreamingResponse):
        """StreamingResponse that notices a disconnect while waiting for tokens (not only at the next write) and
        always closes its generator, so the backend request is stopped right away."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            stream = asyncio.ensure_future(self._stream(send))
            watch = asyncio.ensure_future(_until_disconnected(receive))
            try:
                await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not stream.done():
                    log.info("client disconnected mid-stream; stopping its request")
                    stream.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stream

        async def _stream(self, send: Any) -> None:
            try:
                await self.stream_response(send)
            except OSError:  # the client went away while we wrote (uvicorn's ClientDisconnected)
                log.info("client disconnected mid-stream; stopping its request")
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

    return app


def _model_card(info: ModelInfo) -> Any:
    return Model(id=info.name, object="model", created=0, owned_by="dspark_trt")


def create_app(triton_url: str, model_name: str | None = None, tokenizer_dir: Path | None = None,
               **fields: Any) -> Any:
    """FastAPI app talking to Triton's gRPC endpoint `triton_url`; other OpenAIConfig fields by keyword."""
    return app_for(OpenAIConfig(triton_url=triton_url, model_name=model_name, tokenizer_dir=tokenizer_dir, **fields))
