"""Triton adapter for the `dspark` model: all logic lives in dspark_trt.serve.triton_models.DsparkModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton_models import DsparkModel


class TritonPythonModel(DsparkModel):
    pb = pb_utils
