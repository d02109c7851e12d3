"""The runtime's Llama-family causal decoder, with weights held in TensorRT-LLM checkpoint layout.

Owns: `CausalLM` (embedding → N × [RMSNorm → fused-qkv attention with RoPE → RMSNorm → fused
gate|up SwiGLU MLP] → final norm → lm_head), ragged batched forward over a slot `KVCache` (the torch path's layer
loop here; the native one in runtime.native_forward, with the `NativePlan` this model builds, holds and drops),
hidden-state taps, and loading/exporting TensorRT-LLM named state dicts. Must not know about files
(see hf_loader / build.trtllm_checkpoint), drafters or the speculative loop.

Parameter names mirror TensorRT-LLM's llama checkpoint (tensorrt_llm/models/llama/convert.py):
  transformer.vocab_embedding.weight                [V, d]
  transformer.layers.N.input_layernorm.weight       [d]
  transformer.layers.N.attention.qkv.{weight,bias}  [(H + 2·Hkv)·D, d]  rows = q | k | v
  transformer.layers.N.attention.dense.weight       [d, H·D]
  transformer.layers.N.post_layernorm.weight        [d]
  transformer.layers.N.mlp.fused_fc.weight          [2·I, d]  rows = gate (HF up_proj) | fc (HF gate_proj)
  transformer.layers.N.mlp.proj.weight              [d, I]    (HF down_proj)
  transformer.ln_f.weight, lm_head.weight           [d], [V, d]
TRT-LLM checkpoints store the MLP unfused as mlp.fc (= HF gate_proj, the SiLU input) and mlp.gate
(= HF up_proj); `load_trtllm_state_dict` fuses them exactly like TRT-LLM's fuse_gate_mlp
(concat [gate, fc]; SwiGLU applies SiLU to the second half) and `trtllm_state_dict` splits them back.
"""
from __future__ import annotations

from typing import Iterable, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.errors import CheckpointError, InvalidArgumentError
from dspark_trt.runtime import ops
from dspark_trt.runtime.config import ModelConfig
from dspark_trt.runtime.kv_cache import KVCache
from dspark_trt.runtime.layers import FastLinear, LinearFactory, ModelOutput, RMSNorm, rms_norm
from dspark_trt.runtime.native_forward import Geometry, LayerParts, NativePlan, forward_native


def default_linear_factory(dtype: torch.dtype) -> LinearFactory:
    """FastLinear (an nn.Linear) in `dtype`, uninitialised: weights are loaded right after."""

    def make(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.utils.skip_init(FastLinear, in_features, out_features, bias=bias, dtype=dtype)

    return make


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, factory: LinearFactory) -> None:
        super().__init__()
        qkv_out = cfg.q_size + 2 * cfg.kv_size
        self.qkv = factory(prefix + ".qkv", cfg.hidden_size, qkv_out, cfg.attention_bias)
        self.dense = factory(prefix + ".dense", cfg.q_size, cfg.hidden_size, cfg.dense_bias)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, factory: LinearFactory) -> None:
        super().__init__()
        self.fused_fc = factory(prefix + ".fused_fc", cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.proj = factory(prefix + ".proj", cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, factory: LinearFactory, dtype: torch.dtype) -> None:
        super().__init__()
        prefix = f"transformer.layers.{i}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attention = Attention(cfg, prefix + ".attention", factory)
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(cfg, prefix + ".mlp", factory)


class _Step:
    """Per-forward precomputation shared by every layer (positions, rope rows, cache plan, real row lengths)."""

    def __init__(self, model: "CausalLM", cache: KVCache, slots: torch.Tensor, T: int, lengths: list[int]) -> None:
        B = slots.numel()
        start = cache.check_room(slots, T)  # [B] long
        self.B, self.T = B, T
        self.start = start
        self.starts: list[int] = start.tolist()
        self.slot_list: list[int] = slots.tolist()
        self.lengths = lengths  # real tokens per row (≤ T); attention outputs of padding are zeros
        self.window = model.config.sliding_window
        pos = start[:, None] + torch.arange(T)  # [B, T]
        self.pos = pos
        cos, sin = model.rope_tables(max(self.starts) + T)
        if B == 1:
            p0 = self.starts[0]
            self.cos = cos[p0:p0 + T].view(1, T, 1, -1)  # [B, T, 1, D]
            self.sin = sin[p0:p0 + T].view(1, T, 1, -1)  # [B, T, 1, D]
        else:
            self.cos = cos[pos].unsqueeze(2)  # [B, T, 1, D]
            self.sin = sin[pos].unsqueeze(2)  # [B, T, 1, D]
        self.cache = cache
        s0 = self.slot_list[0]
        self.contiguous = self.slot_list == list(range(s0, s0 + B))
        self.s0 = s0
        self.slots = slots
        self.single = B == 1
        self.p0 = self.starts[0]
        self.write_idx = None if self.single else (slots[:, None].expand(B, T), pos)  # ([B, T], [B, T])

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, Hkv, D] into the cache; return the layer's cache k, v [S, Hkv, max_seq, D]."""
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # [S, Hkv, seq_alloc, D]
        if self.single:
            p0, s = self.p0, self.s0
            ck[s, :, p0:p0 + self.T].copy_(k[0].transpose(0, 1))
            cv[s, :, p0:p0 + self.T].copy_(v[0].transpose(0, 1))
        else:
            ck.permute(0, 2, 1, 3).index_put_(self.write_idx, k)
            cv.permute(0, 2, 1, 3).index_put_(self.write_idx, v)
        return ck, cv


class CausalLM(nn.Module):
    """Llama / SmolLM2 / Mistral / Qwen2 decoder over a slot KV cache (see module docstring for names)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 linear_factory: LinearFactory | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        factory = linear_factory or default_linear_factory(dtype)
        c = config
        self.transformer = nn.Module()
        self.transformer.vocab_embedding = nn.utils.skip_init(nn.Embedding, c.vocab_size, c.hidden_size, dtype=dtype)
        self.transformer.vocab_embedding.weight.requires_grad_(False)
        self.transformer.layers = nn.ModuleList(DecoderLayer(c, i, factory, dtype) for i in range(c.num_layers))
        self.transformer.ln_f = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = factory("lm_head", c.hidden_size, c.vocab_size, False)
        if c.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.transformer.vocab_embedding.weight
        for p in self.parameters():
            p.requires_grad_(False)
        inv_freq, self._rope_scale = c.rope_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] float32
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._H, self._Hkv, self._D = c.num_heads, c.num_kv_heads, c.head_dim
        self._scale = c.head_dim ** -0.5
        self._native_plan: NativePlan | None = None  # built on the first native forward, dropped when tensors change

    # ----------------------------------------------------------------- accessors for drafters
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.transformer.vocab_embedding

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight  # [V, d]

    @property
    def layers(self) -> nn.ModuleList:
        return self.transformer.layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] long → [B, T, d] model dtype."""
        return F.embedding(ids, self.transformer.vocab_embedding.weight)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] → [..., d]: the final RMSNorm (ln_f) applied before lm_head."""
        return rms_norm(h, self.transformer.ln_f.weight, self.config.rms_norm_eps)

    def new_cache(self, max_batch: int, max_seq: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, max_batch, c.num_kv_heads, max_seq, c.head_dim, dtype or self.dtype,
                       self.transformer.vocab_embedding.weight.device)

    def rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [≥n, D] in the model dtype (HF numerics: angles and cos/sin in fp32, then cast)."""
        if self._rope is None or self._rope[0].shape[0] < n or self._rope[0].dtype != self.dtype:
            size = max(n, min(self.config.max_position_embeddings, 8192), 1024)
            t = torch.arange(size, dtype=torch.int64).float()
            freqs = t[:, None] * self.inv_freq.float()[None, :]  # [size, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [size, D]
            self._rope = ((emb.cos() * self._rope_scale).to(self.dtype), (emb.sin() * self._rope_scale).to(self.dtype))
        return self._rope

    # ----------------------------------------------------------------- forward
    @torch.no_grad()  # not inference_mode: drafter training may feed taps into autograd
    def forward(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor | Sequence[int],
                taps: Sequence[int] = (), logits: Literal["all", "last", "none"] = "all",
                last_index: torch.Tensor | None = None, row_lengths: torch.Tensor | None = None) -> ModelOutput:
        """input_ids [B, T] long (right-padded rows), slots [B] long → ModelOutput.

        Row b's tokens go to positions cache.lengths[slots[b]] + t; every slot advances by T (callers
        roll padding back with cache.truncate). logits="last" returns [B, 1, V] at column T-1, or at
        last_index [B] (per-row index of the last valid token) when given; "none" skips the lm_head.
        row_lengths [B] (logits "all": a verify of rows with different K): real tokens per row; on the native path
        the padding after them is not computed (its logits and taps are zeros, its cache entries unwritten).
        """
        if input_ids.dim() != 2:
            raise InvalidArgumentError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}.")
        slots = torch.as_tensor(slots, dtype=torch.long).reshape(-1)  # [B]
        B, T = input_ids.shape
        if slots.numel() != B:
            raise InvalidArgumentError(f"forward: {B} rows but {slots.numel()} slots.")
        L = self.config.num_layers
        tapset = set(taps)
        if any(t < 0 or t >= L for t in tapset):
            raise InvalidArgumentError(f"taps {list(taps)} out of range 0..{L - 1}.")
        if last_index is not None:
            last_index = torch.as_tensor(last_index, dtype=torch.long).reshape(B)
            lengths = (last_index + 1).clamp(1, T).tolist()
        else:
            lengths = [T] * B
        native_lengths = lengths
        if row_lengths is not None and last_index is None:
            native_lengths = torch.as_tensor(row_lengths, dtype=torch.long).reshape(B).clamp(1, T).tolist()
        if logits not in ("all", "last", "none"):
            raise InvalidArgumentError(f"logits must be 'all', 'last' or 'none', got {logits!r}.")
        if self._native_ok(cache):
            start = cache.check_room(slots, T)  # [B]
            x = F.embedding(input_ids.reshape(-1), self.transformer.vocab_embedding.weight)  # [B·T, d]
            return forward_native(self._plan(), x, cache, slots, start, self.rope_tables(int(start.max()) + T), taps,
                                  logits, last_index, native_lengths)
        with ops.ragged_rows(T, lengths):
            return self._forward_torch(input_ids, cache, slots, taps, logits, last_index, lengths)

    def _forward_torch(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor, taps: Sequence[int],
                       logits: str, last_index: torch.Tensor | None, lengths: list[int]) -> ModelOutput:
        B, T = input_ids.shape
        tapset = set(taps)
        step = _Step(self, cache, slots, T, lengths)
        H, Hkv, D = self._H, self._Hkv, self._D
        qk_size = (H + Hkv) * D
        half = D // 2
        eps = self.config.rms_norm_eps
        inter = self.config.intermediate_size
        cos, sin = step.cos, step.sin
        tapped: dict[int, torch.Tensor] = {}

        x = F.embedding(input_ids, self.transformer.vocab_embedding.weight)  # [B, T, d]
        for i, layer in enumerate(self.transformer.layers):
            h = rms_norm(x, layer.input_layernorm.weight, eps)
            qkv = layer.attention.qkv(h)  # [B, T, (H + 2Hkv) D]
            qk = qkv[..., :qk_size].view(B, T, H + Hkv, D)
            v = qkv[..., qk_size:].view(B, T, Hkv, D)
            rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)  # rotate_half
            qk = qk * cos + rot * sin  # [B, T, H + Hkv, D]
            ck, cv = step.write_kv(i, qk[:, :, H:], v)  # [S, Hkv, seq_alloc, D]
            o = ops.attend_torch(qk[:, :, :H], ck, cv, step.slot_list, step.starts, step.lengths, step.window,
                                 self._scale)  # [B, T, H * D]
            x = x + layer.attention.dense(o)
            h = rms_norm(x, layer.post_layernorm.weight, eps)
            gu = layer.mlp.fused_fc(h)  # [B, T, 2I]: gate (up) | fc (SiLU input)
            x = x + layer.mlp.proj(gu[..., :inter] * F.silu(gu[..., inter:]))
            if i in tapset:
                tapped[i] = x
        if step.contiguous:
            cache.lengths[step.s0:step.s0 + B] += T
        else:
            cache.advance(slots, T)

        hidden = torch.cat([tapped[t] for t in taps], dim=-1) if taps else None  # [B, T, len(taps) d]
        if logits == "none":
            return ModelOutput(None, hidden)
        if logits == "last":
            if last_index is None:
                x = x[:, -1:]
            else:
                idx = last_index.reshape(B, 1, 1).expand(B, 1, x.shape[-1])
                x = x.gather(1, idx)  # [B, 1, d]
        out = self.lm_head(self.final_norm(x)).float()  # [B, T | 1, V]
        return ModelOutput(out, hidden)

    # ----------------------------------------------------------------- native path (runtime.native_forward)
    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module signature
        self._native_plan = None  # tensors are replaced: rebind the native plan
        return super()._apply(fn, recurse)

    def _native_ok(self, cache: KVCache) -> bool:
        """The forward runs on the native kernels: `ops.choose_kernel` says so for the cache, which holds the model
        dtype, and the attention kernels take the head size (multiples of 16) and the hidden size (even)."""
        return (ops.choose_kernel(cache.k).native and cache.k.dtype == self.dtype and self._D % 16 == 0
                and self.config.hidden_size % 2 == 0)

    def _plan(self) -> NativePlan:
        """This model's native plan, (re)built when missing or when one of its tensors has changed in place."""
        plan = self._native_plan
        if plan is None or not plan.valid():
            c = self.config
            layers = [LayerParts(layer.input_layernorm.weight, layer.attention.qkv, layer.attention.dense,
                                 layer.post_layernorm.weight, layer.mlp.fused_fc, layer.mlp.proj)
                      for layer in self.transformer.layers]
            geometry = Geometry(c.num_heads, c.num_kv_heads, self._scale, int(c.sliding_window or 0), c.rms_norm_eps)
            plan = self._native_plan = NativePlan(layers, self.transformer.ln_f.weight, self.lm_head, geometry,
                                                  self.dtype, [*self.parameters(), *self.buffers()])
        return plan

    # ----------------------------------------------------------------- TRT-LLM state dicts
    def load_trtllm_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True,
                               source: str = "state dict") -> None:
        """Load TRT-LLM-named tensors (mlp.fc + mlp.gate unfused, or mlp.fused_fc); copies into place.

        Quantized modules from a custom factory receive their extra tensors (scales) by name; a module
        may define `load_fused_parts(parts: list[dict[str, Tensor]])` to fuse [gate, fc] itself.
        """
        state = dict(state)
        handled: set[str] = set()  # loaded by a module's own load_fused_parts
        for i, layer in enumerate(self.transformer.layers):
            p = f"transformer.layers.{i}.mlp."
            if p + "fc.weight" in state or p + "gate.weight" in state:
                parts = [{k[len(p) + len(n) + 1:]: state.pop(k) for k in list(state) if k.startswith(p + n + ".")}
                         for n in ("gate", "fc")]
                fused = _fuse(layer.mlp.fused_fc, parts, p + "fused_fc", source)
                if fused is None:
                    handled.update(p + "fused_fc." + k for k in layer.mlp.fused_fc.state_dict())
                else:
                    state.update({p + "fused_fc." + k: t for k, t in fused.items()})
        own = self.state_dict()
        if self.config.tie_word_embeddings and "lm_head.weight" not in state and "lm_head.weight" in own:
            emb = state.get("transformer.vocab_embedding.weight")
            if emb is not None:
                state["lm_head.weight"] = emb
        missing = [k for k in own if k not in state and k not in handled]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise CheckpointError(f"The {source} does not match a {self.config.architecture} with this config: "
                                  f"missing {missing[:6]}{'…' if len(missing) > 6 else ''}, unexpected "
                                  f"{unexpected[:6]}{'…' if len(unexpected) > 6 else ''}; re-export the checkpoint "
                                  f"with dspark-trt build (or a HF save_pretrained) and make config.json match it.")
        with torch.no_grad():
            for k, t in state.items():
                if k not in own:
                    continue
                dst = own[k]
                if dst.shape != t.shape:
                    raise CheckpointError(f"Tensor {k} in the {source} has shape {tuple(t.shape)}, the config "
                                          f"implies {tuple(dst.shape)}; fix config.json or re-export the checkpoint.")
                dst.copy_(t.to(dst.dtype) if dst.dtype.is_floating_point and t.dtype != dst.dtype else t)

    def trtllm_state_dict(self, fuse_mlp: bool = False) -> dict[str, torch.Tensor]:
        """TRT-LLM-named tensors; by default the MLP is split back into mlp.gate (up) and mlp.fc (gate)."""
        out = dict(self.state_dict())
        if fuse_mlp:
            return out
        inter = self.config.intermediate_size
        for k in [k for k in out if ".mlp.fused_fc." in k]:
            t = out.pop(k)
            name = k.split(".mlp.fused_fc.")[1]
            base = k.split(".mlp.fused_fc.")[0] + ".mlp."
            if t.dim() >= 1 and t.shape[0] == 2 * inter:
                out[base + "gate." + name], out[base + "fc." + name] = t[:inter].clone(), t[inter:].clone()
            else:  # per-tensor quantities (scales) apply to both halves
                out[base + "gate." + name], out[base + "fc." + name] = t.clone(), t.clone()
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def _fuse(module: nn.Module, parts: list[dict[str, torch.Tensor]], name: str,
          source: str) -> dict[str, torch.Tensor] | None:
    """Concatenate [gate, fc] tensors (rows) for `module` (fused_fc); None when the module loaded them itself."""
    if hasattr(module, "load_fused_parts"):
        module.load_fused_parts(parts)  # type: ignore[operator]
        return None
    gate, fc = parts
    if set(gate) != set(fc):
        raise CheckpointError(f"{name}: mlp.gate has {sorted(gate)} but mlp.fc has {sorted(fc)} in the {source}; "
                              f"re-export the checkpoint.")
    own = module.state_dict()
    fused: dict[str, torch.Tensor] = {}
    for key in gate:
        if key not in own:
            raise CheckpointError(f"Unexpected tensor {name}.{key} in the {source} for a {type(module).__name__} "
                                  f"module; the checkpoint's quantization does not match the model's linear layers.")
        a, b = gate[key], fc[key]
        if a.dim() >= 1 and a.shape[0] * 2 == own[key].shape[0]:
            fused[key] = torch.cat((a, b), dim=0)
        elif torch.equal(a, b):
            fused[key] = a
        else:
            raise CheckpointError(f"Cannot fuse {name}.{key}: per-tensor values differ between mlp.gate and mlp.fc "
                                  f"in the {source}; use a linear module that defines load_fused_parts.")
    return fused


def iter_linears(model: CausalLM) -> Iterable[tuple[str, nn.Module]]:
    """(name, module) of every projection built by the linear factory."""
    for i, layer in enumerate(model.transformer.layers):
        p = f"transformer.layers.{i}."
        yield p + "attention.qkv", layer.attention.qkv
        yield p + "attention.dense", layer.attention.dense
        yield p + "mlp.fused_fc", layer.mlp.fused_fc
        yield p + "mlp.proj", layer.mlp.proj
    yield "lm_head", model.lm_head


def greedy_decode(model: CausalLM, prompt: Sequence[int], max_new_tokens: int, cache: KVCache | None = None,
                  slot: int = 0, stop_at_eos: bool = False) -> list[int]:
    """Plain greedy decoding of one prompt (reference for tests and benchmarks); returns the new tokens."""
    if not prompt:
        raise InvalidArgumentError("greedy_decode needs a non-empty prompt.")
    cache = cache or model.new_cache(slot + 1, len(prompt) + max_new_tokens)
    cache.reset(slot)
    slots = torch.tensor([slot])
    ids = torch.tensor([list(prompt)], dtype=torch.long)  # [1, P]
    nxt = int(model(ids, cache, slots, logits="last").logits[0, -1].argmax())
    out: list[int] = []
    buf = torch.empty(1, 1, dtype=torch.long)  # [1, 1] reused each step
    eos = set(model.config.eos_token_ids)
    while True:
        out.append(nxt)
        if len(out) >= max_new_tokens or (stop_at_eos and nxt in eos):
            return out
        buf.fill_(nxt)
        nxt = int(model(buf, cache, slots, logits="last").logits[0, -1].argmax())
