"""Teacher signals from the target: tapped hidden states at target_layer_ids and top-k log-probs.

Owns: the teachers — `RuntimeTarget` (the reference runtime's batched prefill with taps: the default, fast on the
native kernels) and `HFTarget` (a Hugging Face causal LM with forward hooks so tap i = output of decoder layer i
before the final norm, the runtime's convention) — and `cache_features` which runs the target once over
token sequences and stores, per token, the concatenated features (bf16), the target's top-k token ids and
log-probs (the distribution used by the distillation loss) in a `FeatureStore` on disk (memory-mapped).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

log = logging.getLogger(__name__)


class HFTarget:
    """HF causal LM + hooks capturing decoder-layer outputs (runtime tap convention)."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]) -> None:
        self.model = model.eval()
        self.layer_ids = tuple(layer_ids)
        self._taps: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            model.model.layers[i].register_forward_hook(self._hook(i))

    @classmethod
    def load(cls, target_dir: Path, layer_ids: Sequence[int], dtype: torch.dtype = torch.bfloat16,
             device: str | torch.device = "cpu") -> "HFTarget":
        """device: where the teacher runs ("cuda" on a GPU host: cache_features then reduces its logits there)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device), layer_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _hook(self, i: int):  # noqa: ANN202
        def fn(_mod: torch.nn.Module, _inp: object, out: object) -> None:
            self._taps[i] = out[0] if isinstance(out, tuple) else out
        return fn

    @torch.no_grad()
    def run(self, ids: torch.Tensor, attn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] → (features [B, T, F] model dtype, logits [B, T, V] float32), on the model's device."""
        dev = self.device
        out = self.model(input_ids=ids.to(dev), attention_mask=None if attn is None else attn.to(dev), use_cache=False)
        feats = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        return feats, out.logits.float()


class RuntimeTarget:
    """The same teacher on the reference runtime (native kernels where the CPU has them): one batched, right-padded
    prefill per group of sequences with the taps read off the forward — the features the drafter sees at inference.
    Same `run` contract as HFTarget."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int], max_rows: int = 64,
                 max_len: int = 512) -> None:
        self.model = model
        self.layer_ids = tuple(layer_ids)
        self._cache = model.new_cache(max_rows, max_len)

    @classmethod
    def load(cls, target_dir: Path, layer_ids: Sequence[int], dtype: torch.dtype = torch.bfloat16,
             max_rows: int = 64, max_len: int = 512) -> "RuntimeTarget":
        from dspark_trt.runtime.hf_loader import load_hf_checkpoint

        return cls(load_hf_checkpoint(target_dir, dtype=dtype), layer_ids, max_rows=max_rows, max_len=max_len)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, attn: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] right-padded (attn [B, T] marks the real tokens) → (features [B, T, F], logits [B, T, V] fp32);
        padded positions hold whatever the padding computed (callers read only the real ones)."""
        B, T = ids.shape
        if B > self._cache.max_batch or T > self._cache.max_seq:
            self._cache = self.model.new_cache(max(B, self._cache.max_batch), max(T, self._cache.max_seq))
        slots = torch.arange(B)
        self._cache.reset(slots)
        out = self.model(ids, self._cache, slots, taps=self.layer_ids, logits="all")
        return out.hidden, out.logits  # [B, T, F], [B, T, V]


@dataclass
class FeatureStore:
    """Per-token arrays of many sequences, concatenated; seq i spans offsets[i]:offsets[i+1]."""

    tokens: np.ndarray  # [N] int32
    features: np.ndarray  # [N, F] uint16 (bf16 bits)
    topk_ids: np.ndarray  # [N, k] int32: target top-k next-token ids at each position
    topk_logp: np.ndarray  # [N, k] float16: their log-probs
    offsets: np.ndarray  # [S+1] int64
    start: np.ndarray  # [S] int64: first position worth anchoring at (answer start for chat)

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def seq(self, i: int) -> tuple[int, int]:
        return int(self.offsets[i]), int(self.offsets[i + 1])

    @classmethod
    def open(cls, directory: Path) -> "FeatureStore":
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        n, f, k = meta["num_tokens"], meta["feature_size"], meta["topk"]
        return cls(tokens=np.load(d / "tokens.npy"),
                   features=np.memmap(d / "features.bin", dtype=np.uint16, mode="r", shape=(n, f)),
                   topk_ids=np.load(d / "topk_ids.npy"), topk_logp=np.load(d / "topk_logp.npy"),
                   offsets=np.load(d / "offsets.npy"), start=np.load(d / "start.npy"))

    def feature_rows(self, a: int, b: int) -> torch.Tensor:
        """[b−a, F] bfloat16."""
        return torch.from_numpy(np.array(self.features[a:b]).view(np.int16)).view(torch.bfloat16)


def cache_features(target: HFTarget, sequences: Sequence[Sequence[int]], starts: Sequence[int], out: Path,
                   topk: int = 16, max_len: int = 512, batch_tokens: int = 2048,
                   max_minutes: float = 0.0, max_rows: int = 64) -> FeatureStore:
    """Run the target over sequences (cut to max_len) once; write a FeatureStore under out.
    With max_minutes > 0, stop when the budget is spent and keep the sequences done so far. The top-k reduction
    runs where the teacher's logits are (a CUDA teacher moves only features and top-k to the host)."""
    import time

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    seqs = [list(s[:max_len]) for s in sequences]
    keep = [i for i, s in enumerate(seqs) if len(s) >= 8]
    order = sorted(keep, key=lambda i: len(seqs[i]))
    N = sum(len(seqs[i]) for i in keep)
    F = None
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    for j, i in enumerate(order):
        offsets[j + 1] = offsets[j] + len(seqs[i])
    tokens = np.zeros(N, dtype=np.int32)
    tk_ids = np.zeros((N, topk), dtype=np.int32)
    tk_lp = np.zeros((N, topk), dtype=np.float16)
    feats = None
    bar = tqdm(total=N, desc="features", unit="tok")
    j = 0
    while j < len(order):
        if max_minutes and time.time() - t0 > max_minutes * 60:
            log.warning("feature budget of %.1f min spent: keeping %d of %d sequences", max_minutes, j, len(order))
            break
        group = [order[j]]
        width = len(seqs[order[j]])
        while j + len(group) < len(order) and len(group) < max_rows:
            w = max(width, len(seqs[order[j + len(group)]]))
            if w * (len(group) + 1) > batch_tokens:
                break
            group.append(order[j + len(group)])
            width = w
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, i in enumerate(group):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
            attn[r, :len(seqs[i])] = 1
        f, logits = target.run(ids, attn)  # [b, T, F], [b, T, V]
        if feats is None:
            F = f.shape[-1]
            feats = np.memmap(out / "features.bin", dtype=np.uint16, mode="w+", shape=(N, F))
        with torch.inference_mode():  # the runtime teacher's logits are inference tensors: updated in place here
            top = logits.topk(topk, dim=-1)  # [b, T, k]
            mx = top.values[..., :1]  # [b, T, 1] the maximum: logsumexp = mx + log Σ exp(x − mx), in place
            lse = mx + logits.sub_(mx).exp_().sum(-1, keepdim=True).log_()  # [b, T, 1] (2× torch.logsumexp here)
        top = torch.return_types.topk(((top.values - lse).cpu(), top.indices.cpu()))  # [b, T, k] each
        del logits
        f = f.cpu()  # [b, T, F]
        for r, i in enumerate(group):
            a, n = int(offsets[j + r]), len(seqs[i])
            tokens[a:a + n] = seqs[i]
            feats[a:a + n] = f[r, :n].to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
            tk_ids[a:a + n] = top.indices[r, :n].numpy()
            tk_lp[a:a + n] = top.values[r, :n].numpy().astype(np.float16)
        bar.update(sum(len(seqs[i]) for i in group))
        j += len(group)
    bar.close()
    feats.flush()
    n_done = int(offsets[j])
    np.save(out / "tokens.npy", tokens[:n_done])
    np.save(out / "topk_ids.npy", tk_ids[:n_done])
    np.save(out / "topk_logp.npy", tk_lp[:n_done])
    np.save(out / "offsets.npy", offsets[:j + 1])
    np.save(out / "start.npy", np.array([int(starts[i]) for i in order[:j]], dtype=np.int64))
    (out / "meta.json").write_text(json.dumps({"num_tokens": n_done, "feature_size": F, "topk": topk,
                                               "num_sequences": j, "layer_ids": list(target.layer_ids)}))
    return FeatureStore.open(out)
