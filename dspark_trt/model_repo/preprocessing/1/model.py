"""Triton adapter for the `preprocessing` model: all logic lives in dspark_trt.serve.triton_models.PreprocessingModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton_models import PreprocessingModel


class TritonPythonModel(PreprocessingModel):
    pb = pb_utils
