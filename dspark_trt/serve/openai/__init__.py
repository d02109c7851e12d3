"""The OpenAI-compatible HTTP frontend: its own process (or a thread of `dspark-trt serve --openai-port`) in front
of a running tritonserver, talking to the decoupled `dspark` model over gRPC.

Modules: config (OpenAIConfig: the frontend's settings, the CLI defaults), protocol (the OpenAI wire format:
request bodies, their checks, OpenAIError, StreamText), app (ModelInfo / load_model, Frontend — the request logic —
and the FastAPI app), auth (the API key: 401 on /v1 without it, the warning for an open non-loopback bind), server
(hosting with uvicorn: OpenAIServer in a thread, serve_forever). The request checks
against the build are serve.validate's; the gRPC client serve.clients.aio_client's. Light to import: FastAPI,
uvicorn and the openai types load with `app`.
"""
