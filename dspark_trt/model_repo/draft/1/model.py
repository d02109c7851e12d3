"""Triton adapter for the `draft` model: all logic lives in dspark_trt.serve.triton_models.DraftModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton_models import DraftModel


class TritonPythonModel(DraftModel):
    pb = pb_utils
