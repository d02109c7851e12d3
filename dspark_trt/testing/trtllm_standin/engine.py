"""What a `tensorrtllm` model does with a batch of requests, executed by the reference runtime (testing only).

Owns StandinEngine: the documented TensorRT-LLM 1.2.x semantics of the requests serve.gpu_host.rounds sends, for a
runtime CausalLM (the build's target or LM draft checkpoint), batched over every request of one execute():
- no draft tokens: generate request_output_len tokens autoregressively (greedy argmax, ties to the lowest id; or
  a sample when temperature > 0), as the in-flight batcher does for a plain request;
- K draft tokens (external draft tokens, the target built with --speculative_decoding_mode
  draft_tokens_external): ONE step over input + d_1..d_K; accept the longest draft prefix equal to the target's
  choices and return it plus one target token (the recovered token at the first mismatch, or the bonus after
  K), truncated to request_output_len (tensorrtllm_backend's BLS asks for K + 1; examples/ngram/run_dtm_ngram.py:
  "Normally target should return 1 more token");
- no end_id: the request returns exactly the tokens asked for (the round loop applies every stop condition);
- the tapped target (DSpark builds): return_context_logits and the tap outputs ("dspark_tap_<layer>", the residual
  after that layer) for the input rows the engine computed. With reuse_block > 0 it keeps TensorRT-LLM's KV-cache
  reuse contract: full blocks of reuse_block tokens whose whole prefix an earlier request computed are not
  recomputed (the last input token always is), so context outputs cover only the input's computed suffix.
Every request is computed from scratch (the tokens and logits are the same as with a reused prefix).
Nothing here is an engine or runs TensorRT.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dspark_trt.serve.gpu_host.rounds import EngineCall, EngineReply
from dspark_trt.spec_decode import accept as spec_accept

__all__ = ["StandinEngine", "StandinReply"]


@dataclass
class StandinReply(EngineReply):
    steps: list[int] = field(default_factory=list)  # tokens produced per engine step (streaming boundaries)


class StandinEngine:
    """Runs EngineCalls on a runtime CausalLM; `max_batch` requests per forward, `max_seq` tokens per request."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq: int, reuse_block: int = 0) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_seq = max_seq
        self.cache = model.new_cache(max_batch, max_seq)
        self.batches: list[int] = []  # requests per run() (the tests read it to see batching)
        self.reuse_block = reuse_block
        self._blocks: set[tuple[int, ...]] = set()  # token prefixes of the full blocks computed so far
        self.reused: list[int] = []  # reused input tokens per request (the tests read it)

    def _reuse(self, seq: Sequence[int]) -> int:
        """Input tokens whose KV the engine would reuse: the longest run of full blocks an earlier request
        computed with the same prefix, never the last token; then every full block of seq counts as computed."""
        b = self.reuse_block
        if b <= 0:
            return 0
        m = 0
        while m + b <= len(seq) - 1 and tuple(seq[:m + b]) in self._blocks:
            m += b
        self._blocks.update(tuple(seq[:j]) for j in range(b, len(seq) + 1, b))
        return m

    @staticmethod
    def _tap_layers(calls: Sequence[EngineCall]) -> tuple[int, ...]:
        names = sorted({n for c in calls for n in c.taps})
        return tuple(sorted(int(n.rsplit("_", 1)[1]) for n in names))

    def _choose(self, logits: torch.Tensor, call: EngineCall, position: int) -> int:
        """logits [V] at absolute position `position` → the engine's token (greedy or sampled)."""
        if call.temperature <= 0:
            return int(logits.argmax())
        p = spec_accept.target_probs(logits.float()[None], torch.tensor([call.temperature]),
                                     torch.tensor([call.top_p]))  # [1, V]
        seed = torch.tensor([int(call.seed or 0)], dtype=torch.int64)
        return int(spec_accept.exponential_race(p, seed, torch.tensor([position], dtype=torch.int64))[0])

    def _check(self, call: EngineCall) -> str | None:
        if not call.input_ids:
            return "input_ids is empty"
        if call.output_len < 1:
            return f"request_output_len must be ≥ 1, got {call.output_len}"
        need = len(call.input_ids) + max(call.output_len, len(call.draft_ids) + 1) + 1
        if need > self.max_seq:
            return f"input ({len(call.input_ids)}) + output exceeds the engine's max_seq_len {self.max_seq}"
        vocab = int(self.model.config.vocab_size)
        if any(not 0 <= t < vocab for t in call.input_ids + call.draft_ids):
            return f"token ids must lie in [0, {vocab})"
        return None

    @torch.inference_mode()
    def run(self, calls: Sequence[EngineCall]) -> list[StandinReply]:
        """One reply per call, in order; calls over max_batch run in chunks."""
        out: list[StandinReply] = []
        for start in range(0, len(calls), self.max_batch):
            out.extend(self._run_batch(list(calls[start:start + self.max_batch])))
        return out

    def _run_batch(self, calls: list[EngineCall]) -> list[StandinReply]:
        replies: list[StandinReply | None] = [None] * len(calls)
        rows: list[int] = []
        for i, c in enumerate(calls):
            err = self._check(c)
            if err:
                replies[i] = StandinReply([], error=f"stand-in tensorrtllm model: {err}")
            else:
                rows.append(i)
        self.batches.append(len(rows))
        if not rows:
            return [r for r in replies if r is not None]
        slots = torch.arange(len(rows))
        self.cache.reset(slots.tolist())
        seqs = [list(calls[i].input_ids) + list(calls[i].draft_ids) for i in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # [R, W] right-padded
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
        layers = self._tap_layers([calls[i] for i in rows])
        fwd = self.model(ids, self.cache, slots, taps=layers, logits="all")
        logits = fwd.logits  # [R, W, V]
        H = int(self.model.config.hidden_size)
        hidden = fwd.hidden  # [R, W, len(layers) H] | None
        tokens: list[list[int]] = []
        kept: list[list[torch.Tensor]] = []
        lengths: list[int] = []
        for r, i in enumerate(rows):
            c = calls[i]
            t0 = len(c.input_ids) - 1  # the position predicting the first new token
            new: list[int] = []
            for j in range(len(c.draft_ids) + 1):  # one step: accepted drafts + one target token
                tok = self._choose(logits[r, t0 + j], c, t0 + j + 1)
                new.append(tok)
                if j == len(c.draft_ids) or tok != c.draft_ids[j]:
                    break
            new = new[: c.output_len]
            tokens.append(new)
            kept.append([logits[r, t0 + j] for j in range(len(new))])
            lengths.append(len(c.input_ids) + len(new) - 1)  # KV kept: input + accepted (the last token is fed next)
        self.cache.truncate(slots, torch.tensor(lengths))
        steps = [[len(t)] for t in tokens]
        while True:  # plain requests go on to request_output_len; a verify request was one step
            todo = [r for r, i in enumerate(rows) if not calls[i].draft_ids and len(tokens[r]) < calls[i].output_len]
            if not todo:
                break
            feed = torch.tensor([[tokens[r][-1]] for r in todo], dtype=torch.long)  # [n, 1]
            step = self.model(feed, self.cache, slots[todo], logits="last").logits[:, -1]  # [n, V]
            for n, r in enumerate(todo):
                c = calls[rows[r]]
                tokens[r].append(self._choose(step[n], c, len(c.input_ids) + len(tokens[r])))
                kept[r].append(step[n])
                steps[r].append(1)
        for r, i in enumerate(rows):
            c = calls[i]
            lg = torch.stack(kept[r]).float().numpy() if c.return_logits else None  # [n, V]
            rep = StandinReply(tokens[r], lg, steps=steps[r])
            if c.context_logits or c.taps:
                L = len(c.input_ids)
                m = self._reuse(c.input_ids)
                self.reused.append(m)
                if c.context_logits:
                    rep.context_logits = logits[r, m:L].float().numpy()  # [L − m, V]
                if c.taps:
                    rep.taps = {f"dspark_tap_{t}": hidden[r, m:L, j * H:(j + 1) * H].float().numpy()  # [L − m, H]
                                for j, t in enumerate(layers) if f"dspark_tap_{t}" in c.taps}
            replies[i] = rep
        return [r for r in replies if r is not None]
