"""Triton adapter for the `preprocessing` model: all logic lives in dspark_trt.serve.triton.preprocessing.PreprocessingModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton.preprocessing import PreprocessingModel


class TritonPythonModel(PreprocessingModel):
    pb = pb_utils
