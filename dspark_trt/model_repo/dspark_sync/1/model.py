"""Triton adapter for the `dspark_sync` model: all logic lives in dspark_trt.serve.triton.bls_sync.DsparkSyncModel."""
import triton_python_backend_utils as pb_utils

from dspark_trt.serve.triton.bls_sync import DsparkSyncModel


class TritonPythonModel(DsparkSyncModel):
    pb = pb_utils
