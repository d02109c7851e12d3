"""Triton adapter for the `postprocessing` model: all logic lives in dspark_trt.serve.triton_models.PostprocessingModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton_models import PostprocessingModel


class TritonPythonModel(PostprocessingModel):
    pb = pb_utils
