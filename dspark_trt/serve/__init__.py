"""Serving DSpark with Triton, by the process each part runs in.

Sub-packages:
- triton/ — inside the python-backend stubs of the reference repository (dspark_trt/model_repo/*/1/model.py are
  two-line adapters over it): stub (StubModel: stub setup, errors), preprocessing, dspark (the decoupled scheduler
  model), responder (its responder thread and response sink), one_pass (target / draft), bls_sync (dspark_sync).
- gpu_host/ — inside the `dspark` stub of the GPU-host repository (model_repo_trtllm/): rounds (the RoundScheduler
  over TensorRT-LLM engine requests), bls (those requests over pb_utils BLS), dspark (TrtllmDsparkModel).
- openai/ — the OpenAI-compatible frontend process: config, protocol, app, server.
- clients/ — in the caller's process: client (generate_remote / stop_remote), aio_client (DsparkAioClient).
Shared modules: config (ServeConfig, the one limits type), validate (the request checks → RequestError), text
(tokenize, stop words, incremental detokenization), worker (the in-flight batching round loop and its one
cancellation path), metrics (Triton metric families), build_loader (what a `dspark` stub loads from a build),
tuning (the stub's torch threads), server (the tritonserver process: start, readiness, stop, leak check).
docs/ARCHITECTURE.md walks one request through them.
"""
