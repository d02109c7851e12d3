"""Triton adapter for the `draft` model: all logic lives in dspark_trt.serve.triton.one_pass.DraftModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton.one_pass import DraftModel


class TritonPythonModel(DraftModel):
    pb = pb_utils
