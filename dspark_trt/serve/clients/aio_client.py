"""Asyncio gRPC client of the decoupled `dspark` model (token ids in, token ids out) for frontends that run an
event loop (the OpenAI-compatible server, dspark_trt.serve.openai.app).

Owns: `DsparkAioClient` — one shared channel, one bidirectional `ModelStreamInfer` stream per request (asking for
output_ids, final and finish_reason, and stats only when the request has return_stats), the stream's cancel and
tensorrtllm_backend's `stop` request (the two entry points of the `dspark` stub's one cancellation path, see
serve.worker; either frees the request's KV slot), the readiness check —
and the mapping of gRPC failures onto the project's errors: `TritonUnavailableError` (server down, model not
loaded), RequestError (the model rejected the input), ServeError (anything else).
The request encoding (tensor names, dtypes, optional inputs) is serve.clients.client's `GenerationRequest`; this module
only adds `input_ids` (the `dspark` model takes ids, so the caller owns tokenization and detokenization).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from dspark_trt.errors import RequestError, ServeError
from dspark_trt.serve.clients.client import SERVER_FAULTS, GenerationRequest, infer_inputs

log = logging.getLogger(__name__)

DSPARK_MODEL = "dspark"
IDS_OUTPUTS = ("output_ids", "final", "finish_reason")  # not text_output: the model then skips detokenizing


class TritonUnavailableError(ServeError):
    """Triton is not reachable, not ready, or the model is not loaded (HTTP 503 for a frontend)."""


@dataclass(frozen=True)
class IdsChunk:
    """One response of the `dspark` model: the newly committed ids; finish_reason ("eos" | "length" | "stop" |
    "stopped") and stats (when asked for) only on the final one."""

    ids: tuple[int, ...]
    final: bool
    stats: dict[str, Any] | None = None
    finish_reason: str | None = None


def _status_error(exc: Exception, url: str) -> Exception:
    """A grpc.aio.AioRpcError (or anything else raised by the channel) → TritonUnavailableError / ServeError."""
    import grpc  # noqa: PLC0415

    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
        return TritonUnavailableError(f"Triton at {url} is unavailable ({code.name}: {details}); start it with "
                                      "`dspark-trt serve` or check --triton-url")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RequestError(str(details))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ServeError(f"Triton at {url} did not finish the request in time ({details})")
    return ServeError(f"gRPC call to {url} failed ({getattr(code, 'name', type(exc).__name__)}: {details})")


def _model_error(message: str) -> Exception:
    """An error response of the model → RequestError (bad input) or ServeError (server side)."""
    if any(m in message for m in SERVER_FAULTS):
        return ServeError(f"server error: {message}")
    return RequestError(message)


class DsparkAioClient:
    """Async client of the `dspark` model at `url` (HOST:GRPC_PORT). Create and use it inside one event loop."""

    def __init__(self, url: str, model: str = DSPARK_MODEL, timeout: float = 600.0) -> None:
        import tritonclient.grpc.aio as aiogrpc  # noqa: PLC0415

        self.url, self.model, self.timeout = url, model, timeout
        self._grpc = aiogrpc
        self._client = aiogrpc.InferenceServerClient(url)
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await self._client.close()

    async def is_ready(self) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=5.0))
        except Exception:  # noqa: BLE001 - unreachable counts as not ready
            return False

    def _inputs(self, prompt_ids: list[int] | None, req: GenerationRequest) -> list[Any]:
        fields = {k: v for k, v in req.fields().items() if k != "text_input"}
        ids = np.asarray([prompt_ids or [0]], dtype=np.int32)  # [1, T]
        t = self._grpc.InferInput("input_ids", list(ids.shape), "INT32")
        t.set_data_from_numpy(ids)
        return [t, *infer_inputs(self._grpc, fields)]

    async def stream(self, prompt_ids: list[int], req: GenerationRequest, request_id: str) -> AsyncIterator[IdsChunk]:
        """Generate from prompt ids; yields each response until the final one. `req.prompt` is ignored.

        Closing the generator early (a client that went away, a stop string) cancels the gRPC stream, which the
        decoupled `dspark` model sees as a cancelled request, and also sends a `stop` request for `request_id`
        (tensorrtllm_backend's mechanism, seen before the next round); whichever arrives first ends the request in
        the stub's one cancellation path (serve.worker.InflightBatcher._cancel), the other finds nothing left."""
        inputs = self._inputs(prompt_ids, req)
        names = IDS_OUTPUTS + (("stats",) if req.return_stats else ())
        outputs = [self._grpc.InferRequestedOutput(n) for n in names]  # ids only: we detokenize
        done = asyncio.Event()
        finished = False

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs, "outputs": outputs, "request_id": request_id}
            await done.wait()  # keep our side of the stream open until the final response

        call = self._client.stream_infer(requests(), stream_timeout=self.timeout)
        try:
            while True:
                try:
                    result, error = await call.__anext__()
                except StopAsyncIteration as exc:
                    raise ServeError(f"Triton at {self.url} closed the stream before the final response") from exc
                except Exception as exc:  # noqa: BLE001 - grpc.aio.AioRpcError and channel failures
                    raise _status_error(exc, self.url) from exc
                if error is not None:
                    finished = True
                    raise _model_error(error.message() if hasattr(error, "message") else str(error))
                chunk = self._chunk(result)
                finished = chunk.final
                yield chunk
                if chunk.final:
                    return
        finally:
            done.set()
            if not finished:
                call.cancel()
                self._spawn(self.stop(request_id))

    @staticmethod
    def _chunk(result: Any) -> IdsChunk:
        ids = result.as_numpy("output_ids")
        final = result.as_numpy("final")
        stats = result.as_numpy("stats")
        raw = stats.reshape(-1)[0] if stats is not None and stats.size else b""
        reason = result.as_numpy("finish_reason")
        why = reason.reshape(-1)[0] if reason is not None and reason.size else b""
        return IdsChunk(ids=tuple(int(t) for t in ids.reshape(-1)) if ids is not None else (),
                        final=bool(final.reshape(-1)[0]) if final is not None else True,
                        stats=json.loads(raw) if raw else None,
                        finish_reason=(why.decode() if isinstance(why, bytes) else str(why)) or None)

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no running loop (interpreter shutdown): the stream cancel alone has to do
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, request_id: str) -> bool:
        """Send `stop=true` for `request_id`; True if a running request was stopped, False if none was left."""
        inputs = self._inputs(None, GenerationRequest(prompt="", max_tokens=1, stop=True, return_stats=False))
        done = asyncio.Event()

        async def one() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}
            await done.wait()

        call = self._client.stream_infer(one())
        try:
            _, error = await asyncio.wait_for(call.__anext__(), 30.0)
        except Exception as exc:  # noqa: BLE001 - best effort: the stream cancel is the other half
            log.debug("stop %s failed: %s", request_id, exc)
            return False
        finally:
            done.set()
            call.cancel()
        if error is not None:
            log.debug("stop %s: %s", request_id, error)
            return False
        return True
