"""Triton adapter for the `dspark` model: all logic lives in dspark_trt.serve.triton.dspark.DsparkModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton.dspark import DsparkModel


class TritonPythonModel(DsparkModel):
    pb = pb_utils
