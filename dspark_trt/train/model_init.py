"""Creating a fresh DSpark drafter for a target: config from the target's HF config, weights initialised
from the target's own top layers (attention/MLP/norms copied, then trained), d2t map from token counts; and growing a
trained drafter by decoder layers that start as the identity (`grow_layers`, for --init-from --num-layers N), by
Markov rank (`grow_markov_rank`) and by target taps that start silent (`grow_taps`, for --init-from --layers); and
shrinking a trained drafter's draft vocabulary to its most frequent tokens (`prune_draft_vocab`, no training).

Owns nothing at inference time; dspark_trt.runtime.drafters owns the module and its checkpoint format.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from dspark_trt.errors import DrafterError
from dspark_trt.runtime.drafters.config import DSparkConfig, rope_theta_of
from dspark_trt.runtime.drafters.dspark import DSparkModel
from dspark_trt.runtime.drafters.vocab import target_fingerprint, vocab_info
from dspark_trt.train.loss import make_t2d

log = logging.getLogger(__name__)


def default_layer_ids(num_target_layers: int, n: int = 5) -> tuple[int, ...]:
    """n taps spread from layer 1 to the second-to-last layer (DeepSpec: Qwen3-4B 36 layers → 1,9,17,25,33)."""
    if num_target_layers <= n:
        return tuple(range(num_target_layers))
    last = num_target_layers - 2
    return tuple(sorted({round(1 + i * (last - 1) / (n - 1)) for i in range(n)}))


def new_config(target_dir: Path, layer_ids: Sequence[int] | None, num_layers: int, gamma: int, markov_rank: int,
               draft_vocab_size: int, embed_weight: torch.Tensor | None = None) -> DSparkConfig:
    hf: dict[str, Any] = json.loads((Path(target_dir) / "config.json").read_text())
    L = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    vi = vocab_info(target_dir)
    mask_id = vi.special.get("mask_token_id") or hf.get("mask_token_id")
    if mask_id is None:  # no MASK token: nominal id (the drafter uses its learned mask embedding)
        mask_id = vi.special.get("unk_token_id") or 0
    return DSparkConfig(
        hidden_size=int(hf["hidden_size"]), intermediate_size=int(hf["intermediate_size"]),
        num_attention_heads=heads, num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads), vocab_size=int(hf["vocab_size"]),
        target_layer_ids=tuple(layer_ids) if layer_ids else default_layer_ids(L), num_target_layers=L,
        mask_token_id=int(mask_id), num_hidden_layers=num_layers, block_size=gamma,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=rope_theta_of(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        markov_rank=markov_rank, markov_head_type="vanilla" if markov_rank > 0 else "none",
        draft_vocab_size=draft_vocab_size if draft_vocab_size < int(hf["vocab_size"]) else 0,
        target_fingerprint=target_fingerprint(embed_weight) if embed_weight is not None else "",
        target_vocab=vi.to_dict())


def grow_layers(model: DSparkModel, n: int) -> DSparkModel:
    """A drafter of n decoder layers computing what `model` computes: its weights, then n − len(model.layers) new
    layers before the final norm, each a copy of the last one with o_proj and down_proj zeroed — a residual branch that
    adds nothing until trained (the zeroed projections get the first gradients, the rest follow). n ≤ the current
    count returns `model` itself."""
    old = len(model.layers)
    if n <= old:
        return model
    grown = DSparkModel(model.cfg.replace(num_hidden_layers=n))
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any(not k.startswith("layers.") for k in missing):
        raise ValueError(f"grow_layers: state dicts differ beyond the new layers ({unexpected}, {missing})")
    with torch.no_grad():
        for i in range(old, n):
            grown.layers[i].load_state_dict(model.layers[old - 1].state_dict())
            grown.layers[i].o_proj.weight.zero_()
            grown.layers[i].down_proj.weight.zero_()
    log.info("drafter grown from %d to %d decoder layers (new layers start as the identity)", old, n)
    return _grown_like(model, grown)


def grow_markov_rank(model: DSparkModel, r: int) -> DSparkModel:
    """A drafter whose Markov head has rank r computing what `model` computes: W1's first columns are the
    checkpoint's, the new ones drawn like a fresh head's (N(0, 0.02)); W2's new columns and the confidence head's
    weights on the new W1 features are zero, so the Markov bias and the confidences start unchanged (the zero W2
    columns get the first gradients through the new W1 features). r ≤ the current rank, or a drafter without a
    Markov head, returns `model` itself."""
    old = model.cfg.markov_rank if model.cfg.has_markov else 0
    if old == 0 or r <= old:
        return model
    grown = DSparkModel(model.cfg.replace(markov_rank=r))
    state = model.state_dict()
    d = model.cfg.hidden_size
    with torch.no_grad():
        w1 = grown.markov_w1.weight.detach().clone()  # [V, r] fresh draw
        w1[:, :old] = state.pop("markov_w1.weight").float()
        state["markov_w1.weight"] = w1
        w2 = torch.zeros_like(grown.markov_w2.weight)  # [Vd, r]
        w2[:, :old] = state.pop("markov_w2.weight").float()
        state["markov_w2.weight"] = w2
        if model.cfg.enable_confidence_head and model.cfg.confidence_head_with_markov:
            cw = torch.zeros_like(grown.confidence.weight)  # [1, d + r]: h, then W1[x]
            cw[:, :d + old] = state.pop("confidence.weight").float()
            state["confidence.weight"] = cw
    grown.load_state_dict(state)
    log.info("drafter Markov head grown from rank %d to %d (new components start silent)", old, r)
    return _grown_like(model, grown)


def init_from_target(model: DSparkModel, hf_target: torch.nn.Module) -> None:
    """Copy the target's last layers (HF Llama naming) into the drafter layers and its final norm."""
    layers = hf_target.model.layers
    n = len(model.layers)
    with torch.no_grad():
        for i, dl in enumerate(model.layers):
            src = layers[len(layers) - n + i]
            a, m = src.self_attn, src.mlp
            for name, w in (("q_proj", a.q_proj), ("k_proj", a.k_proj), ("v_proj", a.v_proj), ("o_proj", a.o_proj),
                            ("gate_proj", m.gate_proj), ("up_proj", m.up_proj), ("down_proj", m.down_proj)):
                getattr(dl, name).weight.copy_(w.weight.float())
            dl.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
            dl.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
        model.norm.weight.copy_(hf_target.model.norm.weight.float())
        model.mask_embedding.copy_(hf_target.get_input_embeddings().weight.float().mean(0))


def frequent_tokens(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """counts [V] → d2t [size] long: the `size` most frequent target ids (plus `always`), sorted by id.
    Ties (notably unseen tokens) go to lower ids: byte-level BPE ids follow merge order, a frequency prior."""
    V = counts.numel()
    c = counts.clone().double() + 0.5 * (V - torch.arange(V, dtype=torch.float64)) / V
    for t in always:
        c[t] = float("inf")
    top = torch.topk(c, size).indices
    return top.sort().values


def grow_taps(model: DSparkModel, layers: Sequence[int]) -> DSparkModel:
    """A drafter tapping the target layers `layers` (the checkpoint's taps and more, any order) computing what `model`
    computes: fc's columns for each kept tap are the checkpoint's, those for a new tap zero — its features enter the
    context with the first gradients. The same taps return `model` itself; dropping one of the checkpoint's taps
    (its trained columns would be lost) or repeating one is a DrafterError."""
    old, new = tuple(model.cfg.target_layer_ids), tuple(int(x) for x in layers)
    if new == old:
        return model
    if len(set(new)) != len(new) or not set(old) <= set(new):
        raise DrafterError(f"--layers {','.join(map(str, new))} must keep every target tap of the --init-from "
                           f"checkpoint ({','.join(map(str, old))}), each once. Fix: pass its taps plus the new ones, "
                           f"e.g. --layers {','.join(map(str, sorted(set(old) | set(new))))}.")
    grown = DSparkModel(model.cfg.replace(target_layer_ids=new))
    state = model.state_dict()
    d = model.cfg.hidden_size
    with torch.no_grad():
        w_old = state.pop("fc.weight").float()  # [d, len(old)·d]
        w = torch.zeros(d, len(new) * d)  # [d, len(new)·d]
        for i, layer in enumerate(old):
            j = new.index(layer)
            w[:, j * d:(j + 1) * d] = w_old[:, i * d:(i + 1) * d]
        state["fc.weight"] = w
    grown.load_state_dict(state)
    log.info("drafter taps grown from %s to %s (new taps start silent)", list(old), list(new))
    return _grown_like(model, grown)


def prune_draft_vocab(model: DSparkModel, counts: torch.Tensor, size: int,
                      always: Sequence[int] | None = None) -> DSparkModel:
    """A drafter whose draft vocabulary keeps the `size` most frequent (counts [V], target ids; `frequent_tokens`'
    rule) of `model`'s d2t, plus `always` (default: the target's special tokens, as training keeps them) where d2t has
    them: the head rows (gathered from the target's lm_head through d2t) and Markov W2 rows of the others dropped,
    everything else `model`'s. Its logits are `model`'s at the kept ids, so its greedy draft is `model`'s wherever that
    one's argmax is kept; what is lost is the drafts of dropped tokens, and what is gained is the head's and W2's
    products (Vd rows each, every drafter pass). A DrafterError unless 0 < size < Vd."""
    vd = model.cfg.head_vocab
    if not 0 < size < vd:
        raise DrafterError(f"draft vocabulary {size} must be in 1..{vd - 1} (the drafter's is {vd}). Fix: pass a "
                           "smaller size.")
    d2t = model.d2t.cpu()  # [Vd] target ids
    if always is None:
        always = [i for i in model.cfg.target_vocab.get("special", {}).values() if isinstance(i, int)]
    inside = torch.full((counts.numel(),), -1.0, dtype=torch.float64)  # ids outside d2t: below every id inside
    inside[d2t] = counts.double()[d2t]
    kept_ids = frequent_tokens(inside, size, [t for t in always if t in set(d2t.tolist())])  # [size] sorted
    keep = make_t2d(d2t, counts.numel())[kept_ids]  # [size] their draft ids
    pruned = DSparkModel(model.cfg.replace(draft_vocab_size=size))
    state = model.state_dict()
    state["d2t"] = kept_ids.clone()
    state["markov_w2.weight"] = state["markov_w2.weight"][keep.to(state["markov_w2.weight"].device)].clone()
    pruned.load_state_dict(state)
    pruned = pruned.to(next(model.parameters()).dtype)
    if model._embed is not None and model._head is not None:  # by reference, the head's kept rows gathered
        pruned._embed, pruned._head = model._embed, model._head.index_select(0, keep.to(model._head.device))
    log.info("draft vocabulary pruned from %d to %d tokens", vd, size)
    return pruned


def _grown_like(model: DSparkModel, grown: DSparkModel) -> DSparkModel:
    """`grown` with `model`'s attached target weights (by reference) and parameter dtype."""
    if model._embed is not None and model._head is not None:
        grown._embed, grown._head = model._embed, model._head
    return grown.to(next(model.parameters()).dtype)
