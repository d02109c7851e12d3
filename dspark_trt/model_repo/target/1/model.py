"""Triton adapter for the `target` model: all logic lives in dspark_trt.serve.triton.one_pass.TargetModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton.one_pass import TargetModel


class TritonPythonModel(TargetModel):
    pb = pb_utils
