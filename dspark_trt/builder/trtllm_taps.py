"""The tapped target engine for DSpark pairs: a TensorRT-LLM 1.2.x Llama-family model class whose network also
returns the residual stream after each of the drafter's `target_layer_ids` as named engine outputs.

Owns: the tap output names (`tap_output_names`: "dspark_tap_<layer>", one [num_tokens, hidden] tensor per tapped
layer, the model dtype, the tokens of every request of the step packed as remove_input_padding lays them out),
`tapped_model_class` (the subclass of tensorrt_llm.models.LLaMAForCausalLM / QWenForCausalLM, built lazily so this
module imports without TensorRT-LLM) and `mark_taps` (wraps the forward of each tapped decoder layer so its output is
marked with Tensor.mark_output(name, dtype) while the network is traced; parameter names are untouched, so the
exported checkpoint loads as for the stock class).

Why this mechanism (TensorRT-LLM 1.2.x sources, tests/builder/trtllm_1_2_1_names.json "taps"):
- Eagle / Medusa build their extra heads into the target network and mark extra outputs from the model class; the
  executor then returns any marked engine output by name: ExecutorConfig.additional_model_outputs +
  OutputConfig.additional_model_outputs = [AdditionalModelOutput(name, gather_context)] (docs: "Obtaining
  Arbitrary Output Tensors"; batch_manager/utils copyAdditionalOutputs).
- copyAdditionalOutputs slices getContextChunkSize() rows per context request and ONE row per generation beam, and
  checks the rows add up to the tensor's first dimension. A marked per-token tensor therefore matches only batches
  without draft tokens (a context request with external draft tokens feeds chunk + K tokens). So the tapped target
  is built WITHOUT speculative_decoding_mode: the scheduler verifies a block as a context request over
  sequence + d_1..d_K (context logits gathered, --gather_context_logits) and accepts on those logits itself.
- With KV-cache reuse the engine computes only the non-reused suffix of the input: the executor returns context
  outputs as [prompt_len, ·] tensors whose reused rows are never written; the GPU-host `target` model
  (serve/gpu_host/executor_model.py) trims them to the computed suffix, which serve/gpu_host/taps.py maps onto the
  input's last positions.
The only other module importing tensorrt_llm is builder/trtllm.py; here the import is inside functions.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from dspark_trt.errors import BuildError

log = logging.getLogger(__name__)

__all__ = ["TAP_OUTPUT_PREFIX", "TAPPED_BASES", "mark_taps", "tap_output_names", "tapped_model_class"]

TAP_OUTPUT_PREFIX = "dspark_tap_"
# checkpoint architecture → the tensorrt_llm.models class the tapped target derives from
TAPPED_BASES: dict[str, str] = {"LlamaForCausalLM": "LLaMAForCausalLM", "LLaMAForCausalLM": "LLaMAForCausalLM",
                                "MistralForCausalLM": "LLaMAForCausalLM", "Qwen2ForCausalLM": "QWenForCausalLM"}


def tap_output_names(taps: Sequence[int]) -> tuple[str, ...]:
    """Engine output names of the tapped layers, in the drafter's order (its features are their concatenation)."""
    if not taps:
        raise BuildError("a tapped target needs at least one tap layer; the DSpark drafter's config lists them in "
                         "target_layer_ids. Fix: check the drafter checkpoint.")
    if len(set(taps)) != len(taps) or any(int(t) < 0 for t in taps):
        raise BuildError(f"tap layers {list(taps)} must be distinct and ≥ 0; fix the drafter's target_layer_ids.")
    return tuple(f"{TAP_OUTPUT_PREFIX}{int(t)}" for t in taps)


def mark_taps(model: Any, taps: Sequence[int], dtype: Any) -> list[str]:
    """Wrap model.transformer.layers[i].forward for i in taps: its hidden output [num_tokens, hidden] is marked as
    engine output "dspark_tap_<i>" (dtype: the model's trt dtype). Returns the names marked on this rank."""
    names = dict(zip((int(t) for t in taps), tap_output_names(taps)))
    layers = list(model.transformer.layers)
    n_layers = int(model.config.num_hidden_layers)
    if max(names) >= n_layers:
        raise BuildError(f"tap layer {max(names)} does not exist: the target has {n_layers} layers. Fix: pair the "
                         "drafter with the target it was trained on.")
    marked: list[str] = []
    for layer in layers:
        idx = int(getattr(layer, "layer_idx", -1))
        if idx not in names:
            continue
        object.__setattr__(layer, "forward", _tapped_forward(layer.forward, names[idx], dtype))
        marked.append(names[idx])
    return marked


def _tapped_forward(inner: Callable[..., Any], name: str, dtype: Any) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out  # use_cache: (hidden_states, presents)
        hidden.mark_output(name, dtype)  # [num_tokens, hidden] residual stream after this layer
        return out
    return forward


def tapped_model_class(architecture: str) -> type:
    """The tapped subclass of the stock TensorRT-LLM class for `architecture` (imports tensorrt_llm)."""
    base_name = TAPPED_BASES.get(architecture)
    if base_name is None:
        raise BuildError(f"no tapped target for architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(TAPPED_BASES))}. Fix: serve this pair with --serving reference.")
    import tensorrt_llm.models as trt_models  # noqa: PLC0415 - lazy: GPU hosts only

    base = getattr(trt_models, base_name)

    class DSparkTappedTarget(base):  # type: ignore[misc, valid-type]
        """`base` with the drafter's tap layers marked as engine outputs (taps from config.dspark_tap_layers)."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            taps = tuple(getattr(config, "dspark_tap_layers", ()) or ())
            pc = getattr(config, "plugin_config", None)
            if pc is not None and getattr(pc, "reduce_fusion", False):
                raise BuildError("reduce_fusion returns the residual separately from the layer output; build the "
                                 "tapped target with reduce_fusion disabled (the default).")
            self.dspark_tap_outputs = mark_taps(self, taps, _trt_dtype(self.config.dtype))
            log.info("tapped target: layers %s marked as %s", list(taps), self.dspark_tap_outputs)

    DSparkTappedTarget.__name__ = DSparkTappedTarget.__qualname__ = f"DSparkTapped{base_name}"
    return DSparkTappedTarget


def _trt_dtype(dtype: Any) -> Any:
    """A checkpoint dtype string ("bfloat16") → tensorrt DataType (tensorrt_llm._utils.str_dtype_to_trt)."""
    if not isinstance(dtype, str):
        return dtype
    from tensorrt_llm._utils import str_dtype_to_trt  # noqa: PLC0415

    return str_dtype_to_trt(dtype)
