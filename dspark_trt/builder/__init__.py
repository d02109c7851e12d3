"""The build pipeline: validate → quantize (ModelOpt) → export TRT-LLM checkpoints → engines → model repo.

Owns everything under build/NAME/ (see docs/build.md and docs/CONTRACTS.md "Build"). Only
dspark_trt/builder/trtllm.py may import tensorrt_llm, and only lazily. Must not know about serving
internals (it only fills the Triton templates in dspark_trt/model_repo/) or the speculative loop.
"""
