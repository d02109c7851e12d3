"""The python-backend models of the reference repository (dspark_trt/model_repo/): what runs inside the Triton
stub processes. Each dspark_trt/model_repo/*/1/model.py is a two-line adapter subclassing one class here.

Modules: stub (StubModel: stub setup, config, input reading, error responses — the base of every model),
preprocessing (PreprocessingModel: tokenize), dspark (DsparkModel: the decoupled scheduler model: validation →
serve.worker), responder (the responder thread and TritonSink, the dspark model's response side), one_pass
(TargetModel / DraftModel: explicit-batch single passes), bls_sync (DsparkSyncModel: the non-decoupled BLS step of
`ensemble`). Nothing here is imported outside a stub except by tests; pb_utils is passed in by the adapters.
"""
