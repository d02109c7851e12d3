"""Triton adapter for the `target` model of a DSpark GPU-host repository: the tapped target engine through
tensorrt_llm.bindings.executor; all logic lives in dspark_trt.serve.gpu_host.executor_model.ExecutorTargetModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.gpu_host.executor_model import ExecutorTargetModel


class TritonPythonModel(ExecutorTargetModel):
    pb = pb_utils
