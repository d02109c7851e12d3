"""Serving: start/stop a real Triton server on a built model repository, call it, and the in-flight
batching worker that the `dspark` Triton model runs (dspark_trt/model_repo/*/1/model.py are thin adapters over this).

Modules: server (lifecycle), client (generate_remote / stop_remote over HTTP and gRPC), worker (the central
round loop), validate (request checks → RequestError), text (tokenize, stop words, incremental detokenization),
metrics (Triton metric families), pipeline (what the models load from a build), triton_models (the logic of
dspark_trt/model_repo/*/1/model.py, over pb_utils passed in).
"""
