"""Triton adapter for the `dspark` model of the GPU-host repository: all logic lives in
dspark_trt.serve.trtllm_bls.TrtllmDsparkModel (the round loop driving the `target` / `draft` tensorrtllm models)."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.trtllm_bls import TrtllmDsparkModel


class TritonPythonModel(TrtllmDsparkModel):
    pb = pb_utils
