"""The DSpark block drafter: trainable module (`DSparkModel`) and its slot-based runtime (`DSparkDrafter`).

Owns: ctx = RMSNorm(fc(concat of target-layer taps)); decoder layers attending to [Wk·ctx; Wk·h]
(context = positions < anchor position, bidirectional inside the block); block input
[anchor, MASK×(γ−1)] with a learned MASK embedding; the frozen target embeddings / lm_head (attached by
reference, never stored); an optional reduced draft vocabulary (d2t map); the low-rank Markov head
p_k = softmax(U_k + W2·W1[x_{k−1}]) sampled left to right; the confidence head
c_k = σ((w·[h_k; W1[x_{k−1}]] + b) / T_k). The runtime keeps per-slot context KV; block KV is never kept.
The γ Markov steps (token choice, q, c_k) run through runtime.dispatch.markov_block: the block_draft kernel on
CUDA, its torch reference on CPU, sampling with spec_decode.rng's STREAM_DRAFT keyed on (seed, position).
Training losses and data live in dspark_trt.train; this module knows nothing about them.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

from dspark_trt.errors import DrafterError
from dspark_trt.runtime import dispatch, native, ops
from dspark_trt.runtime.drafters.config import DSparkConfig
from dspark_trt.runtime.drafters.layers import DSparkLayer, RMSNorm, fused_weight, native_product
from dspark_trt.runtime.drafters.native_plan import DraftPlan
from dspark_trt.runtime.quant_linear import int8_rows
from dspark_trt.spec_decode.protocols import DraftBlock, SamplingParams

log = logging.getLogger(__name__)


class DSparkModel(nn.Module):
    """Trainable drafter weights. Call `attach_target(embed, lm_head)` before any forward."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, d, bias=False)
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(
            DSparkLayer(d, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.rms_norm_eps, cfg.rope_theta) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        r = cfg.markov_rank if cfg.has_markov else 0
        if r:
            self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
            self.markov_w2 = nn.Linear(r, cfg.head_vocab, bias=False)
            nn.init.normal_(self.markov_w1.weight, std=0.02)
            nn.init.zeros_(self.markov_w2.weight)  # start as "no Markov bias"
        if cfg.enable_confidence_head:
            self.confidence = nn.Linear(d + (r if cfg.confidence_head_with_markov else 0), 1)
        d2t = torch.arange(cfg.head_vocab, dtype=torch.long)
        self.register_buffer("d2t", d2t)  # [Vd] target id of each draft-vocab id (identity for the full vocab)
        temps = cfg.confidence_temperatures or (1.0,) * cfg.block_size
        self.register_buffer("conf_temperature", torch.tensor(temps, dtype=torch.float32), persistent=False)
        self._embed: torch.Tensor | None = None  # [V, d] target embeddings (frozen, shared)
        self._head: torch.Tensor | None = None  # [Vd, d] target lm_head rows of the draft vocab
        # Inference on the native CPU kernels reads the draft-vocab head as int8 rows with per-row scales (W8A16
        # limb products: half the bytes of the bf16 head). Drafts only steer acceptance; output stays lossless.
        self.int8_head = True
        self._head_q: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None  # key, int8 [Vd, d], scale [Vd]

    # -- target weights (frozen, shared by reference) --
    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """embed_weight, lm_head_weight [V, d]: the target's; never copied into the checkpoint."""
        V, d = self.cfg.vocab_size, self.cfg.hidden_size
        for name, w in (("embeddings", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (V, d):
                raise DrafterError(f"Target {name} have shape {tuple(w.shape)} but the drafter expects {(V, d)}. "
                                   "Fix: load the drafter with the target it was trained for.")
        self._embed = embed_weight.detach()
        full = self.cfg.draft_vocab_size in (0, V)
        head = lm_head_weight.detach()
        self._head = head if full else head.index_select(0, self.d2t.to(head.device))

    def set_temperatures(self, temps: Sequence[float]) -> None:
        self.cfg = self.cfg.replace(confidence_temperatures=tuple(float(t) for t in temps))
        self.conf_temperature = torch.tensor(self.cfg.confidence_temperatures, dtype=torch.float32,
                                             device=self.d2t.device)

    def _need_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._embed is None or self._head is None:
            raise DrafterError("DSpark drafter has no target weights attached. Fix: load it with "
                               "runtime.drafters.load_drafter(path, target, dtype) or call attach_target().")
        return self._embed, self._head

    @property
    def param_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # -- pieces --
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, F] → ctx [B, T, d]."""
        f = features.to(self.param_dtype)
        plain = type(self.fc) is nn.Linear and self.fc.bias is None  # a quantized / instrumented fc runs its forward
        y = native_product(f, self.fc.weight) if plain else None
        return self.ctx_norm(self.fc(f) if y is None else y)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [B, C, d], pos [B, C] → per layer (k, v) [B, Hkv, C, hd]."""
        rope = self.layers[0].rope(pos, ctx.dtype)  # every layer has the same head_dim and theta
        return [layer.context_kv(ctx, pos, rope) for layer in self.layers]

    def block_input(self, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
        """anchors [...] long → [..., γ, d] = [embed(anchor), MASK×(γ−1)]."""
        embed, _ = self._need_target()
        a = embed[anchors].to(self.param_dtype)[..., None, :]  # [..., 1, d]
        m = self.mask_embedding.expand(*anchors.shape, gamma - 1, -1)
        return torch.cat([a, m], dim=-2)

    def backbone(self, h: torch.Tensor, pos: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor | None, ctx_lens: Sequence[int] | None = None) -> torch.Tensor:
        """h [B, Q, d], pos [B, Q], kv per layer [B, Hkv, C, hd], mask [B, Q, C+Q] (None: all visible; or
        ctx_lens, each row's context length, see DSparkLayer.forward) → final-normed [B, Q, d]."""
        rope = self.layers[0].rope(pos, h.dtype)  # every layer has the same head_dim and theta
        for layer, (k, v) in zip(self.layers, kv):
            h = layer(h, pos, k, v, mask, rope, ctx_lens)
        return self.norm(h)

    def rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [≥ n, hd] in the param dtype: rope_cos_sin's values by position, built once (grown on demand)."""
        hit = self.__dict__.get("_rope_table")
        if hit is None or hit[0].shape[0] < n or hit[0].dtype != self.param_dtype:
            size = max(n, 2 * hit[0].shape[0] if hit is not None else 512)
            cos, sin = self.layers[0].rope(torch.arange(size, device=self.fc.weight.device)[None], self.param_dtype)
            hit = self.__dict__["_rope_table"] = (cos[0, 0].contiguous(), sin[0, 0].contiguous())  # [size, hd]
        return hit

    def backbone_native(self, anchors: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                        slots: torch.Tensor, lens: torch.Tensor, gamma: int) -> torch.Tensor:
        """Inference backbone on the native kernels (DSparkLayer.forward_native): anchors [B], per-layer context
        caches ks / vs [S, Hkv, max_seq, hd], slots / lens [B] (context lengths) → final-normed [B, γ, d]."""
        B = anchors.shape[0]
        pos = (lens[:, None] + torch.arange(gamma)).reshape(-1)  # [B·γ]
        cos, sin = self.rope_table(int(pos.max()) + 1)
        h = self.block_input(anchors, gamma).reshape(B * gamma, -1).contiguous()  # [B·γ, d]
        starts, counts = lens.long().contiguous(), torch.full((B,), gamma, dtype=torch.long)
        for layer, ck, cv in zip(self.layers, ks, vs):
            h = layer.forward_native(h, pos, ck, cv, slots, starts, counts, cos, sin)
        return self.norm(h).view(B, gamma, -1)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] → U [..., Vd] (float32)."""
        _, head = self._need_target()
        u = self._int8_head_logits(h, head)
        if u is None:
            u = native_product(h, head, out_f32=True)  # packed once per head
        return (h @ head.to(h.dtype).t()).float() if u is None else u

    def _int8_head_logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor | None:
        """U from the int8 copy of the head (round to nearest, scale = row absmax / 127), on the native W8A16 limb
        products; None unless int8_head is on and `ops.choose_kernel` puts an int8 product of these activations (bf16
        CPU inference) on the exact limb kind."""
        if not self.int8_head:
            return None
        kern = ops.choose_kernel(h, head, weight=torch.int8, autograd=True)
        if kern.kind != native.Pack.I8Q:
            return None
        key = (head.data_ptr(), head._version)
        if self._head_q is None or self._head_q[0] != key:
            self._head_q = (key, *int8_rows(head))  # int8 [Vd, d], scale [Vd]
        w8, scale = self._head_q[1], self._head_q[2]
        h2 = h.reshape(-1, h.shape[-1])  # [M, d]
        return native.linear(h2, w8, kern.kind, scale=scale, out_f32=True).view(*h.shape[:-1], -1)  # [..., Vd] f32

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor | None:
        """prev [...] target ids → W1[prev] [..., r] (None without a Markov head)."""
        return self.markov_w1(prev) if self.cfg.has_markov else None

    def markov_bias(self, w1x: torch.Tensor | None) -> torch.Tensor | float:
        """W1[x] [..., r] → W2·W1[x] [..., Vd] float32 (0.0 without a Markov head)."""
        return 0.0 if w1x is None else self.markov_w2(w1x).float()

    def confidence_logit(self, h: torch.Tensor, w1x: torch.Tensor | None) -> torch.Tensor | None:
        """h [..., d], W1[x] [..., r] → raw logit [...] float32 (None without a confidence head)."""
        if not self.cfg.enable_confidence_head:
            return None
        x = torch.cat([h, w1x.to(h.dtype)], dim=-1) if self.cfg.confidence_head_with_markov and w1x is not None else h
        return self.confidence(x).squeeze(-1).float()

    def confidence_parts(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The confidence head split for the Markov block: h [..., d] → (conf_bias [...] f32 = w_h·h + b,
        w_conf [r] f32 = the weight's W1 half, or None when the head takes no Markov input); None without a head.
        confidence_logit(h, W1[x]) = conf_bias + W1[x]·w_conf (in float32)."""
        if not self.cfg.enable_confidence_head:
            return None
        w, b = self.confidence.weight.float(), self.confidence.bias.float()  # [1, d (+ r)], [1]
        d = self.cfg.hidden_size
        bias = (h.float() * w[0, :d]).sum(-1) + b[0]  # [...]: per-row sums (F.linear's M = 1 / M > 1 paths round apart)
        with_markov = self.cfg.has_markov and self.cfg.confidence_head_with_markov
        return bias, (w[0, d:] if with_markov else None)

    # -- training forward (teacher-forced, many anchors per sequence) --
    def forward_train(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                      gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """features [B, L, F], tokens [B, L], anchors [B, A] (1 ≤ a ≤ L−γ) →
        (hidden [B, A, γ, d], logits [B, A, γ, Vd] float32 incl. Markov bias, conf_logit [B, A, γ] | None).
        Slot i of anchor a predicts token a+i+1; its Markov input is the teacher token x = tokens[a+i]."""
        hid, w1x, conf = self.forward_train_parts(features, tokens, anchors, gamma)
        return hid, self.base_logits(hid) + self.markov_bias(w1x), conf

    def forward_train_parts(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                            gamma: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """forward_train without the logits: (hidden [B, A, γ, d], W1[x] [B, A, γ, r] | None, conf_logit) — the
        trainer turns them into log-probs chunk by chunk (train.head_loss), never holding [B, A, γ, Vd]."""
        B, L, _ = features.shape
        A = anchors.shape[1]
        dev = features.device
        ctx = self.context(features)  # [B, L, d]
        cpos = torch.arange(L, device=dev).expand(B, L)
        kv = self.context_kv(ctx, cpos)
        offs = torch.arange(gamma, device=dev)
        bpos = (anchors[..., None] + offs).reshape(B, A * gamma)  # [B, Aγ]
        h = self.block_input(tokens.gather(1, anchors), gamma).reshape(B, A * gamma, -1)
        ctx_ok = cpos[:, None, :] < anchors.repeat_interleave(gamma, dim=1)[..., None]  # [B, Aγ, L]
        grp = torch.arange(A, device=dev).repeat_interleave(gamma)
        blk_ok = (grp[:, None] == grp[None, :]).expand(B, -1, -1)  # [B, Aγ, Aγ]
        mask = torch.cat([ctx_ok, blk_ok], dim=-1)
        hid = self.backbone(h, bpos, kv, mask).view(B, A, gamma, -1)
        prev = tokens.gather(1, bpos).view(B, A, gamma)  # x_{k-1}: anchor, then teacher tokens
        w1x = self.markov_embed(prev)
        return hid, w1x, self.confidence_logit(hid, w1x)


class DSparkDrafter:
    """spec_decode.protocols.Drafter over a DSparkModel with per-slot context KV caches."""

    def __init__(self, model: DSparkModel) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.gamma = model.cfg.block_size
        self.target_layer_ids = tuple(model.cfg.target_layer_ids)
        self.vocab_size = model.cfg.vocab_size
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._len = torch.zeros(0, dtype=torch.long)
        # slot → committed features not yet in the context KV: (first position, features [n, F]). extend_context only
        # queues them; the next propose for the slot projects them all in one pass (a 1-token extension costs about
        # as much as a 32-token one, and rounds that do not draft should cost the drafter nothing).
        self._pending: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._plan: tuple[tuple, DraftPlan | None] | None = None  # (DraftPlan.key, plan or None: unbound path)
        self.use_plan = True  # False: the unbound path (tests compare the two)

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def allocate(self, max_batch: int, max_seq: int) -> None:
        c = self.cfg
        shape = (max_batch, c.num_key_value_heads, max_seq, c.head_dim)
        dt = self.model.param_dtype
        self._k = [torch.zeros(shape, dtype=dt, device=self.device) for _ in range(c.num_hidden_layers)]
        self._v = [torch.zeros(shape, dtype=dt, device=self.device) for _ in range(c.num_hidden_layers)]
        self._len = torch.zeros(max_batch, dtype=torch.long)
        self._pending = {}
        self.max_seq = max_seq

    def _check_slots(self, slots: torch.Tensor) -> list[int]:
        if not self._k:
            raise DrafterError("DSpark drafter used before allocate(max_batch, max_seq). Fix: call allocate first.")
        s = [int(x) for x in slots.tolist()]
        if any(not 0 <= x < len(self._len) for x in s):
            raise DrafterError(f"Slot ids {s} outside 0..{len(self._len) - 1}. Fix: allocate more slots.")
        return s

    @torch.inference_mode()
    def extend_context(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                       features: torch.Tensor | None) -> None:
        s = self._check_slots(slots)
        if features is None:
            raise DrafterError("The DSpark drafter needs target features (taps of target_layer_ids) with every "
                               "committed token. Fix: run the target with taps=drafter.target_layer_ids.")
        if features.shape[-1] != self.cfg.feature_size:
            raise DrafterError(f"Features have width {features.shape[-1]} but the drafter expects "
                               f"{self.cfg.feature_size} = {len(self.target_layer_ids)} taps × {self.cfg.hidden_size}. "
                               "Fix: tap exactly drafter.target_layer_ids, in that order.")
        start = self._len[s]  # [B]
        if int((start + lengths.cpu()).max()) > self.max_seq:
            raise DrafterError(f"Drafter context would exceed max_seq={self.max_seq}. Fix: allocate a larger max_seq.")
        for r, slot in enumerate(s):
            n, p0 = int(lengths[r]), int(start[r])
            if n:
                self._pending.setdefault(slot, []).append((p0, features[r, :n].detach().clone()))  # [n, F]
            self._len[slot] = p0 + n

    def queued(self, slots: Sequence[int]) -> list[int]:
        """Committed tokens per slot whose features are not in the context KV yet: what its next propose projects
        first (the round loop's cost calibration prices that flush apart from the pass)."""
        return [sum(f.shape[0] for _, f in self._pending.get(int(slot), ())) for slot in slots]

    def _flush(self, slots: Sequence[int], plan: DraftPlan | None = None) -> None:
        """Project the queued features of these slots into their context KV: on the native kernels, all the slots'
        rows in one fc product and one k|v product of every layer (`_flush_native`), else one torch pass per slot."""
        queued = [(slot, self._pending.pop(slot)) for slot in slots if self._pending.get(slot)]
        if not queued:
            return
        span = max(c[-1][0] + c[-1][1].shape[0] for _, c in queued)
        plan = plan if span <= self.max_seq else None  # the caller's bound plan (propose binds it once a pass)
        if (plan is not None or self._native_ok(span)) and self._flush_native(queued, plan):
            return
        for slot, chunks in queued:
            p0 = chunks[0][0]
            feats = torch.cat([f for _, f in chunks]).to(self.device)[None]  # [1, n, F]
            n = feats.shape[1]
            pos = torch.arange(p0, p0 + n, device=self.device)[None]  # [1, n]
            kv = self.model.context_kv(self.model.context(feats), pos)
            for li, (k, v) in enumerate(kv):
                self._k[li][slot, :, p0:p0 + n] = k[0]
                self._v[li][slot, :, p0:p0 + n] = v[0]

    def draft_plan(self) -> DraftPlan | None:
        """The model's products bound once (native_plan.DraftPlan), rebound when a tensor, the head's precision or
        the engine changes; None where the unbound path runs (torch products, a model the plan does not take)."""
        m = self.model
        if not self.use_plan or not ops.choose_kernel(m.param_dtype).native:
            return None
        hit = self._plan
        if hit is None or (not hit[1].valid(m) if hit[1] is not None else hit[0] != DraftPlan.key(m)):
            hit = self._plan = (DraftPlan.key(m), DraftPlan.bind(m))
        return hit[1]

    def _flush_native(self, queued: list[tuple[int, list[tuple[int, torch.Tensor]]]], plan: DraftPlan | None) -> bool:
        """The torch flush's arithmetic on the native kernels, rows of every slot at once (each row's bits are its
        own: the products are row-invariant): ctx = fc(features), ctx_norm fused into one k|v product of all the layers
        ([N, L·2·Hkv·hd]: the native prologue's RMSNorm, whose sum of squares may round apart from torch's mean in
        fp32), then per slot and layer RoPE on k and the cache write (native.rope_kv, no q).
        False (nothing written) where the fc product is not a native one."""
        m = self.model
        feats = torch.cat([f for _, chunks in queued for _, f in chunks]).to(self.device, m.param_dtype)  # [N, F]
        if plan is not None:
            kv = plan.context_kv(feats)  # [N, L·2·Hkv·hd]
        else:
            ctx = native_product(feats, m.fc.weight) if type(m.fc) is nn.Linear and m.fc.bias is None else None
            if ctx is None:
                return False
            w = fused_weight(m, "ctx_kv", [t for layer in m.layers for t in (layer.k_proj.weight, layer.v_proj.weight)])
            kv = native.linear(ctx, w, norm=m.ctx_norm.weight, eps=m.ctx_norm.eps)  # [N, L·2·Hkv·hd]
        width = kv.shape[1] // len(m.layers)
        row = 0
        for slot, chunks in queued:
            p0 = chunks[0][0]
            n = sum(f.shape[0] for _, f in chunks)
            pos = torch.arange(p0, p0 + n)  # [n]
            cos, sin = m.rope_table(p0 + n)
            slot_t = torch.tensor([slot])
            for li in range(len(m.layers)):
                part = kv[row:row + n, li * width:(li + 1) * width].contiguous()  # [n, 2·Hkv·hd]
                native.rope_kv(part, cos, sin, pos, self._k[li], self._v[li], slot_t, 0, self.cfg.num_key_value_heads)
            row += n
        return True

    def _native_ok(self, span: int) -> bool:
        """Whether the backbone runs on the native kernels (DSparkModel.backbone_native): `ops.choose_kernel` says so
        for its products, every layer is one they take (DSparkLayer.native_ready), and there is room past the
        context for the block's scratch KV."""
        m = self.model
        w = m.layers[0].q_proj.weight
        return (span <= self.max_seq and all(layer.native_ready() for layer in m.layers)
                and ops.choose_kernel(w, m.fc.weight, weight=w).native)

    def _backbone_torch(self, s: list[int], lens: torch.Tensor, anchors: torch.Tensor, C: int) -> torch.Tensor:
        """The backbone on torch ops (DSparkLayer.forward) over the slots' context KV → [B, G, d]."""
        m, G, dev = self.model, self.gamma, self.device
        if len(s) == 1:  # a view of the slot's rows (the layers concatenate the block KV onto it anyway)
            kv = [(k[s[0]:s[0] + 1, :, :C], v[s[0]:s[0] + 1, :, :C]) for k, v in zip(self._k, self._v)]
        else:
            idx = torch.tensor(s, device=dev)
            kv = [(k[:, :, :C].index_select(0, idx), v[:, :, :C].index_select(0, idx)) for k, v in zip(self._k, self._v)]
        # Each row attends to exactly its own context and the block (no mask, no padding keys: a padded softmax
        # rounds differently), so a slot's draft has the same bits alone and in any batch.
        ctx_lens = None if bool((lens == C).all()) else [int(n) for n in lens.tolist()]
        pos = lens[:, None] + torch.arange(G, device=dev)  # [B, G]
        return m.backbone(m.block_input(anchors, G), pos, kv, None, ctx_lens)

    def context_length(self, slot: int) -> int:
        return int(self._len[slot])

    @torch.inference_mode()
    def propose(self, slots: torch.Tensor, anchors: torch.Tensor, gamma: int, sampling: Sequence[SamplingParams],
                positions: torch.Tensor | None = None) -> DraftBlock:
        """γ tokens after each anchor (the prefix of the full block, so different γ agree); positions [B] =
        absolute position of d_1, the sampling key (None → context length + 1)."""
        s = self._check_slots(slots)
        if not 1 <= gamma <= self.gamma:
            raise DrafterError(f"gamma={gamma} outside 1..{self.gamma} (the drafter's block_size). "
                               "Fix: ask for at most block_size tokens.")
        plan = self.draft_plan()
        self._flush(s, plan)
        m, G, dev = self.model, self.gamma, self.device
        lens = self._len[s].to(dev)  # [B] context length = position of the anchor
        pos_d1 = lens + 1 if positions is None else torch.as_tensor(positions).to(dev)  # [B]
        B, C = len(s), max(1, int(lens.max()))
        anchors = anchors.to(dev)
        if plan is not None and all(p.greedy for p in sampling) and int(lens.max()) + G <= self.max_seq:  # all-greedy rows, products bound once
            toks, conf = plan.propose_greedy(anchors, self._k, self._v, torch.tensor(s), lens, G, gamma,
                                             m.rope_table(int(lens.max()) + G), m.norm)
            return DraftBlock(tokens=toks.cpu(), q=None, conf=conf.float().cpu())
        if self._native_ok(int(lens.max()) + G):
            hid = m.backbone_native(anchors, self._k, self._v, torch.tensor(s), lens, G)  # [B, G, d]
        else:
            hid = self._backbone_torch(s, lens, anchors, C)  # [B, G, d]
        U = m.base_logits(hid)[:, :gamma]  # [B, γ, Vd]; the full block's shapes, so every γ gets the same bits
        conf_parts = m.confidence_parts(hid)  # ([B, G], [r] | None) | None
        conf_bias, w_conf = (conf_parts[0][:, :gamma], conf_parts[1]) if conf_parts is not None else (None, None)
        temps = m.conf_temperature[:gamma].to(dev)  # [γ]
        reduced = m.cfg.head_vocab != self.vocab_size
        if m.cfg.has_markov:
            blk = dispatch.markov_block(U, anchors, m.markov_w1.weight, m.markov_w2.weight, sampling, pos_d1,
                                        d2t=m.d2t if reduced else None,
                                        conf_bias=conf_bias if w_conf is not None else None, w_conf=w_conf,
                                        conf_temp=temps, need_q=any(not p.greedy for p in sampling))
            toks, conf = blk.tokens, blk.conf  # [B, γ] target ids, [B, γ] | None
        else:  # no Markov head: each position from U alone
            blk = dispatch.draft_tokens(U, sampling, pos_d1)
            toks, conf = (m.d2t[blk.tokens] if reduced else blk.tokens), None
        if conf is None and conf_bias is not None:  # the head does not read W1[x]: c_k = σ(conf_bias / T_k)
            conf = torch.sigmoid(conf_bias / temps)
        q = None
        if any(not p.greedy for p in sampling):
            q = blk.q if not reduced else torch.zeros(B, gamma, self.vocab_size, device=dev).scatter_(
                2, m.d2t.expand(B, gamma, -1), blk.q)  # [B, γ, V]: draft vocab → target ids
        return DraftBlock(tokens=toks.cpu(), q=None if q is None else q.float().cpu(),
                          conf=None if conf is None else conf.float().cpu())

    def release(self, slot: int) -> None:
        self._pending.pop(slot, None)
        if 0 <= slot < len(self._len):
            self._len[slot] = 0
