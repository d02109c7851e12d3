"""Tiny real Hugging Face checkpoints for fast tests: a target, drafts, and a shared tokenizer.

Owns: building a byte-level BPE tokenizer from local text (the Python standard library's sources)
and saving small randomly initialised Llama / Qwen2 checkpoints with it. Drafts are noisy copies of
the target, so greedy agreement is partial: both the accept and the reject paths get exercised.
Everything is deterministic for a given seed and cached under a directory the caller picks.
"""
from __future__ import annotations

import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TINY_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyPair:
    """Paths of a tiny target and its drafts (all share one tokenizer)."""

    target: Path  # Llama, 2 layers
    draft: Path  # noisy copy of the target (same architecture): partial agreement
    draft_small: Path  # 1-layer Llama with the target's embeddings: low agreement
    qwen2: Path  # Qwen2-style target (qkv bias) with the same tokenizer
    tokenizer: Path


def corpus_files(limit: int = 40) -> list[Path]:
    """Local text to train tokenizers on: the standard library's own .py files (always present)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 4000)
    return files[:limit]


def build_tokenizer(out: Path, vocab_size: int = TINY_VOCAB) -> Path:
    """Train a byte-level BPE tokenizer on stdlib sources and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in corpus_files()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def _llama_config(vocab: int, layers: int, eos: int, mask: int, **kw: object):  # noqa: ANN202
    from transformers import LlamaConfig

    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    cfg.update(kw)
    c = LlamaConfig(**cfg)
    c.mask_token_id = mask
    return c


def _init_peaky(model: torch.nn.Module, seed: int) -> None:
    """Random init with a larger output scale so greedy tokens are decisive (not near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
            else:
                std = 0.5 if ("embed" in name or "lm_head" in name) else 0.08
                p.normal_(0.0, std, generator=g)


def _save(model: torch.nn.Module, tok_dir: Path, out: Path) -> Path:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
    gen = {"eos_token_id": model.config.eos_token_id, "pad_token_id": model.config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def make_tiny_pair(root: Path, seed: int = 0, draft_noise: float = 0.12) -> TinyPair:
    """Create (or reuse, if complete) the tiny checkpoints under root."""
    from transformers import AutoTokenizer, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root = Path(root)
    done = root / ".complete"
    pair = TinyPair(root / "target", root / "draft", root / "draft_small", root / "qwen2", root / "tokenizer")
    if done.exists():
        return pair
    torch.manual_seed(seed)
    build_tokenizer(pair.tokenizer)
    tok = AutoTokenizer.from_pretrained(pair.tokenizer)
    vocab, eos, mask = len(tok), tok.eos_token_id, tok.mask_token_id

    target = LlamaForCausalLM(_llama_config(vocab, 2, eos, mask))
    _init_peaky(target, seed)
    _save(target, pair.tokenizer, pair.target)

    draft = LlamaForCausalLM(_llama_config(vocab, 2, eos, mask))
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * draft_noise)
    _save(draft, pair.tokenizer, pair.draft)

    small = LlamaForCausalLM(_llama_config(vocab, 1, eos, mask))
    _init_peaky(small, seed + 2)
    with torch.no_grad():
        small.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        small.lm_head.weight.copy_(target.lm_head.weight)
    _save(small, pair.tokenizer, pair.draft_small)

    qcfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    qwen = Qwen2ForCausalLM(qcfg)
    _init_peaky(qwen, seed + 3)
    _save(qwen, pair.tokenizer, pair.qwen2)
    done.write_text("ok")
    log.info("tiny checkpoints written under %s", root)
    return pair


def default_tiny_root() -> Path:
    """Where tests cache the tiny checkpoints (DSPARK_CACHE or ~/.cache/dspark_trt)."""
    base = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark_trt"))
    return base / "tiny-v1"


def tiny_dspark_drafter(target: torch.nn.Module, gamma: int = 4, draft_vocab: int = 0, markov: bool = True,
                        seed: int = 0):  # noqa: ANN201 - a runtime.drafters.DSparkDrafter (imported lazily)
    """A random-init DSpark drafter for a runtime CausalLM `target` (1 layer, taps (0, 1)), deterministic for a
    seed in any process: non-trivial Markov head and mask embedding, optional reduced draft vocabulary (d2t =
    every ⌊V / draft_vocab⌋-th target id), float32."""
    from dspark_trt.runtime.drafters import DSparkConfig, DSparkDrafter, DSparkModel

    c = target.config
    cfg = DSparkConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=c.hidden_size // 4, vocab_size=c.vocab_size,
                       target_layer_ids=(0, 1), num_target_layers=c.num_layers, mask_token_id=3,
                       num_hidden_layers=1, block_size=gamma, markov_rank=8 if markov else 0,
                       markov_head_type="vanilla" if markov else "none", draft_vocab_size=draft_vocab)
    g = torch.Generator().manual_seed(seed)
    model = DSparkModel(cfg).float()
    with torch.no_grad():
        for p in model.parameters():  # fixed values, independent of the global RNG
            r = torch.randn(p.shape, generator=g)
            p.copy_(r / p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0 + 0.1 * r)
        if draft_vocab:
            model.d2t.copy_(torch.arange(0, c.vocab_size, c.vocab_size // draft_vocab)[:draft_vocab])
    model.attach_target(target.embed_tokens.weight, target.lm_head_weight)
    return DSparkDrafter(model)
