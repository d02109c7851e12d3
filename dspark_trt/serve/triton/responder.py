"""The response side of the decoupled `dspark` stub: the responder thread and the ResponseSink over a python-backend
response sender.

Owns `Responder` (one thread that sends the round loop's responses, in order, off the round's critical path) and
`TritonSink` (serve.worker.ResponseSink over pb_utils' response sender: thread-safe, at most one final response;
the worker's calls only queue; the responder detokenizes `text_output` when the request asked for text and sends).
The response tensors: output_ids, context_ids, final on every response; on the final one also `finish_reason`
(TYPE_STRING: "eos" | "length" | "stop" | "stopped") and `stats` (the JSON, when return_stats; empty otherwise).
`is_cancelled` is how Triton's request cancellation reaches the worker's one cancellation path
(serve.worker.InflightBatcher._cancel).
"""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from dspark_trt.errors import RequestError
from dspark_trt.serve.text import delta_text
from dspark_trt.serve.triton.stub import bytes_tensor

log = logging.getLogger("dspark_trt.serve")

__all__ = ["Responder", "SinkHost", "TritonSink"]


class Responder:
    """One thread that sends the round loop's responses, in order: detokenizing and the blocking round trip of
    `sender.send` to the server (≈ 1 ms per response measured here, paid per streaming request per round) then
    overlap the next round instead of delaying it."""

    def __init__(self) -> None:
        self._q: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dspark-responses", daemon=True)
        self._thread.start()

    def put(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._q.append(fn)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._stop:
                    self._cond.wait()
                if not self._q:
                    return
                fn = self._q.popleft()
            try:
                fn()
            except Exception:  # noqa: BLE001 - one client's failed send must not stop the others'
                log.exception("sending a response failed")

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)


class SinkHost(Protocol):
    """What a TritonSink needs of its model (serve.triton.dspark.DsparkModel)."""

    pb: Any
    name: str

    @property
    def tokenizer(self) -> Any: ...

    @property
    def responder(self) -> Responder: ...

    def error_response(self, exc: BaseException) -> Any: ...


class TritonSink:
    """serve.worker.ResponseSink over a python-backend response sender (thread-safe, at most one final response).
    The worker's calls only queue the response; the model's Responder builds the text and sends it, in order."""

    def __init__(self, model: SinkHost, sender: Any, text: bool = False) -> None:
        self.m, self.sender, self.text = model, sender, text
        self.closed = False
        self.broken = False  # a send failed: the worker drops the request at its next cancellation check
        self.lock = threading.Lock()

    def send(self, new_ids: Sequence[int], context_ids: Sequence[int], final: bool,
             stats: dict[str, object] | None, finish_reason: str | None = None) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = final
        new, ctx = list(new_ids), list(context_ids)
        self.m.responder.put(lambda: self._send(new, ctx, final, stats, finish_reason))

    def _send(self, new_ids: list[int], context_ids: list[int], final: bool, stats: dict[str, object] | None,
              finish_reason: str | None) -> None:
        if self.broken:
            return
        try:
            self._send_now(new_ids, context_ids, final, stats, finish_reason)
        except Exception:  # noqa: BLE001 - one client's broken stream must not fail the others
            log.exception("%s: sending a response failed; the request will be dropped", self.m.name)
            self.broken = True

    def _send_now(self, new_ids: list[int], context_ids: list[int], final: bool,
                  stats: dict[str, object] | None, finish_reason: str | None) -> None:
        pb = self.m.pb
        tensors = [pb.Tensor("output_ids", np.asarray(new_ids, dtype=np.int32).reshape(1, -1)),  # [1, n]
                   pb.Tensor("context_ids", np.asarray(context_ids, dtype=np.int32).reshape(1, -1)),
                   pb.Tensor("final", np.array([[final]], dtype=np.bool_))]
        if self.text:  # the delta after context_ids; a trailing partial UTF-8 character waits for the next response
            piece = delta_text(self.m.tokenizer, context_ids, new_ids, final)
            tensors.append(bytes_tensor(pb, "text_output", [piece.encode("utf-8")], (1, 1)))
        if final:
            payload = json.dumps(stats).encode() if stats is not None else b""
            tensors.append(bytes_tensor(pb, "stats", [payload], (1, 1)))
            tensors.append(bytes_tensor(pb, "finish_reason", [(finish_reason or "").encode()], (1, 1)))
        self.sender.send(pb.InferenceResponse(output_tensors=tensors),
                         flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def error(self, message: str) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        pb = self.m.pb
        self.m.responder.put(lambda: self.sender.send(self.m.error_response(RequestError(message)),
                                                      flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def is_cancelled(self) -> bool:
        if self.broken:
            return True
        try:
            return bool(self.sender.is_cancelled())
        except Exception:  # noqa: BLE001 - a sender already closed counts as gone
            return self.closed
