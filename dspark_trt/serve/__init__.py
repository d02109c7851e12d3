"""Serving: start/stop a real Triton server on a built model repository, call it, and the in-flight
batching worker that the `dspark` Triton model runs (model_repo/*/1/model.py are thin adapters over this).

Modules: server (lifecycle), client (tritonclient wrappers, generate_remote), worker (central round loop),
validate (request checks → RequestError), detok (incremental detokenization), metrics (Triton metric
families), tensors (pb_utils-free helpers shared by the adapters).
"""
