"""Stub setup shared by every python-backend model of the repositories: what a Triton python-backend stub process
needs before any model code runs, and the tensor / error plumbing all models share.

Owns `StubModel`, the base of every TritonPythonModel class here (dspark_trt/model_repo*/*/1/model.py subclass a
model of this package and set `pb = triton_python_backend_utils`, which is importable only inside the stub, hence
passed in): initialize() sets up logging, the UTF-8 locale, the fast-exit hook and the parent watch (the stub exits
when its tritonserver is gone), and parses the model's config.pbtxt parameters into serve.config.ServeConfig; `_get`
reads an optional input; `error_response` turns an exception into an error response (a RequestError → INVALID_ARG,
another DsparkError → INTERNAL with its message, anything else is logged and answered as an internal error — never
a crashed stub); `bytes_tensor` builds a BYTES output. No model logic here.
"""
from __future__ import annotations

import atexit
import json
import locale
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dspark_trt.errors import DsparkError, RequestError
from dspark_trt.serve.config import ServeConfig

log = logging.getLogger("dspark_trt.serve")

__all__ = ["SERVER_SIDE_MARKERS", "StubModel", "bytes_tensor", "is_server_side"]


def _setup_logging() -> None:
    root = logging.getLogger("dspark_trt")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
        root.setLevel(logging.INFO)


def _utf8_locale() -> None:
    """The stub embeds Python in isolated mode, which never sets LC_CTYPE: the locale stays "C" and every
    open()/read_text() without an encoding decodes ASCII (it broke loading the runtime's native kernels in the
    stub, halving served speed). Take LC_CTYPE from the environment as a normal interpreter does, else C.UTF-8."""
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("", "C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            return
    log.warning("no UTF-8 locale in the python-backend stub (preferred encoding %s); text files without an explicit "
                "encoding may fail to load", locale.getpreferredencoding(False))


def _fast_exit() -> None:
    """Last atexit hook of the stub: skip CPython's module teardown, which takes seconds with torch loaded
    (measured 2–9 s per stub here) and made every server stop run into --exit-timeout-secs. It runs after
    the stub has finalized the model and answered the server, so nothing is lost; shm belongs to the server."""
    _fast_exit_code(0)


_EXIT_HOOKED: list[bool] = []
PARENT_POLL_S = 0.5


def _watch_parent() -> None:
    """Exit this stub at once when its tritonserver is gone (SIGKILL, a crash, the OOM killer). The stub's own check
    (every 300 ms) then calls exit(1), which tears the stub down under the interpreter and never returned in the
    `dspark` stub while its round thread ran (measured on 2.51: the stub stayed, holding the model's memory, until
    something killed it). Only inside a stub: the parent must be a tritonserver."""
    parent = os.getppid()
    try:
        argv0 = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return
    if not argv0.endswith(b"tritonserver"):
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.error("tritonserver (pid %d) is gone; this python stub exits", parent)
        _fast_exit_code(1)

    threading.Thread(target=watch, name="dspark-parent-watch", daemon=True).start()


def _fast_exit_code(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What the `dspark` model's error messages for a failure on the server's side contain (StubModel.error_response:
# "internal error in ..."; serve.worker: shutting down, unloaded, a failed round); any other error it answers is
# the request's. Triton 2.51 hands a BLS caller every error as INTERNAL, so dspark_sync sorts them by this.
SERVER_SIDE_MARKERS = ("internal error", "shutting down", "unloaded", "generation failed")


def is_server_side(message: str) -> bool:
    """True when an error message of our models reports a server-side failure (not a bad request)."""
    return any(m in message for m in SERVER_SIDE_MARKERS)


def bytes_tensor(pb: Any, name: str, values: Sequence[bytes], shape: tuple[int, ...]) -> Any:
    """A BYTES (TYPE_STRING) output tensor of `values`, reshaped to `shape`."""
    return pb.Tensor(name, np.array(list(values), dtype=np.object_).reshape(shape))


class StubModel:
    """Base of the python-backend models: stub setup, config, input reading, error responses."""

    pb: Any = None  # triton_python_backend_utils, set by model.py
    name: str = "?"

    def initialize(self, args: dict[str, str]) -> None:
        _setup_logging()
        _utf8_locale()
        if not _EXIT_HOOKED:
            atexit.register(_fast_exit)  # registered after torch's hooks → runs first
            _EXIT_HOOKED.append(True)
            _watch_parent()
        self.model_config = json.loads(args["model_config"])
        self.cfg = ServeConfig.from_model_config(self.model_config)
        self.name = self.model_config.get("name", "?")

    def _get(self, request: Any, name: str) -> np.ndarray | None:
        t = self.pb.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def error_response(self, exc: BaseException) -> Any:
        """An InferenceResponse carrying `exc` as Triton's error (RequestError → INVALID_ARG: the client's 400)."""
        if isinstance(exc, DsparkError):
            msg = str(exc)
        else:
            log.exception("%s: unexpected error", self.name)
            msg = f"internal error in {self.name} ({type(exc).__name__}: {exc}); see the server log"
        try:
            err = self.pb.TritonError(msg, self.pb.TritonError.INVALID_ARG if isinstance(exc, RequestError)
                                      else self.pb.TritonError.INTERNAL)
        except (AttributeError, TypeError):
            err = self.pb.TritonError(msg)
        return self.pb.InferenceResponse(output_tensors=[], error=err)

    def finalize(self) -> None:
        log.info("%s unloaded", getattr(self, "name", "?"))
