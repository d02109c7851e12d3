"""Clients of a running tritonserver (tritonclient-based; they run in the caller's process).

Modules: client (`generate_remote` / `stop_remote` over HTTP or gRPC through the ensembles; GenerationRequest, the
request encoding every client shares), aio_client (DsparkAioClient: asyncio gRPC streams of token ids to the
decoupled `dspark` model, for the OpenAI frontend). `generate_remote` and `stop_remote` are re-exported here (light:
tritonclient loads on the first call).
"""
from dspark_trt.serve.clients.client import generate_remote, stop_remote

__all__ = ["generate_remote", "stop_remote"]
