"""Triton adapter for the `dspark` model of the GPU-host repository: all logic lives in
dspark_trt.serve.gpu_host.dspark.TrtllmDsparkModel (the round loop driving the `target` / `draft` tensorrtllm models)."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.gpu_host.dspark import TrtllmDsparkModel


class TritonPythonModel(TrtllmDsparkModel):
    pb = pb_utils
