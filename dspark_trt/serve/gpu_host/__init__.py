"""The GPU-host repository (dspark_trt/model_repo_trtllm/): DSpark's rounds over TensorRT-LLM engines served by
Triton's in-flight batcher (the `target` / `draft` models, backend "tensorrtllm").

Modules: rounds (TrtllmExecutor / TrtllmRoundScheduler: the spec_decode RoundScheduler over engine requests;
EngineCall / EngineReply / EngineClient — free of pb_utils), bls (the tensorrtllm request / reply tensors and
PbEngineClient, the pb_utils BLS side), dspark (TrtllmDsparkModel: model_repo_trtllm/dspark/1/model.py's class, the
reference `dspark` model with its rounds driven over the engines), taps (TapExecutor: DSpark rounds over the tapped
target) and executor_model (the DSpark pairs' `target`: the tapped engine through tensorrt_llm.bindings.executor,
a Python-backend model, because the stock tensorrtllm backend drops additional engine outputs).
"""
