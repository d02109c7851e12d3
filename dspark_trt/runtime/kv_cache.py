"""Slot-based, preallocated key/value cache of the runtime decoder.

Owns: the K/V storage (one preallocated tensor each, [layers, slots, kv_heads, seq_alloc, head_dim], seq_alloc =
max_seq rounded up to SEQ_ALIGN so the torch path's aligned attention spans never get clipped by a small cache),
the per-slot committed lengths, rollback (`truncate`) and `reset`. One slot = one request. Writing
happens in `model.CausalLM.forward`; this module never runs a model. Rolling back only moves the
length: stale entries past it are masked out and later overwritten, so rollback costs nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark_trt.errors import InvalidArgumentError

SEQ_ALIGN = 64  # = runtime.ops.SPAN_ALIGN: storage per slot is a whole number of attention spans


class KVCache:
    """K/V for `max_batch` slots of up to `max_seq` tokens each."""

    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if max_batch < 1 or max_seq < 1:
            raise InvalidArgumentError(f"KVCache needs max_batch ≥ 1 and max_seq ≥ 1 (got {max_batch}, {max_seq}).")
        seq_alloc = -(-max_seq // SEQ_ALIGN) * SEQ_ALIGN
        shape = (num_layers, max_batch, num_kv_heads, seq_alloc, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, seq_alloc, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, seq_alloc, D]
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)  # [S] committed tokens per slot
        self.num_layers, self.max_batch, self.max_seq = num_layers, max_batch, max_seq
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def layer_views(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per-layer views (k[i], v[i]) [S, Hkv, seq_alloc, D], made once per storage tensor."""
        views = self.__dict__.get("_views")
        if views is None or views[0] is not self.k or views[1] is not self.v:
            views = self.__dict__["_views"] = (self.k, self.v, self.k.unbind(0), self.v.unbind(0))
        return views[2], views[3]

    def _slots(self, slots: torch.Tensor | Sequence[int] | int) -> torch.Tensor:
        s = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device).reshape(-1)  # [B]
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.max_batch):
            raise InvalidArgumentError(f"Slot ids {s.tolist()} out of range 0..{self.max_batch - 1}; "
                                       f"allocate the cache with a larger max_batch.")
        return s

    def truncate(self, slots: torch.Tensor | Sequence[int], lengths: torch.Tensor | Sequence[int]) -> None:
        """Roll slots back to `lengths` tokens (must not exceed their current length)."""
        s = self._slots(slots)
        n = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device).reshape(-1)  # [B]
        if n.shape != s.shape:
            raise InvalidArgumentError(f"truncate: {s.numel()} slots but {n.numel()} lengths.")
        cur = self.lengths[s]
        if bool((n < 0).any()) or bool((n > cur).any()):
            raise InvalidArgumentError(f"truncate can only shrink: slots {s.tolist()} have lengths {cur.tolist()}, "
                                       f"asked for {n.tolist()}.")
        self.lengths[s] = n

    def reset(self, slot: int | Sequence[int] | torch.Tensor) -> None:
        """Forget a slot (length 0); its storage is reused by the next request."""
        self.lengths[self._slots(slot)] = 0

    def advance(self, slots: torch.Tensor, n: int) -> None:
        """Grow the given slots by n tokens (called by the model after writing them)."""
        self.lengths[slots] += n

    def check_room(self, slots: torch.Tensor, n: int) -> torch.Tensor:
        """Current lengths [B] of slots, after checking n more tokens fit."""
        cur = self.lengths[slots]  # [B]
        if int(cur.max()) + n > self.max_seq:
            raise InvalidArgumentError(f"KV cache full: slot lengths {cur.tolist()} + {n} new tokens exceed "
                                       f"max_seq={self.max_seq}; allocate a larger cache or shorten the request.")
        return cur
