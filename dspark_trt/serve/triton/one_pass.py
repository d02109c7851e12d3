"""The explicit-batch `target` and `draft` models of the reference repository: one pass over the same build, for
scoring and debugging. On a GPU host these are the slots where the TensorRT-LLM engines sit (model_repo_trtllm/);
serve.worker says why the round loop itself executes the models in process instead of calling these.

Owns `OnePassModel` (input_ids [B, T] right-padded + input_lengths [B], each row checked by
serve.validate.check_prompt_tokens; the backend loads on the first request), `TargetModel` (next greedy token +
last logits) and `DraftModel` (anchor, one drafter block, its confidence).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dspark_trt.errors import RequestError
from dspark_trt.serve.build_loader import LoadedBackend, load_backend
from dspark_trt.serve.triton.stub import StubModel
from dspark_trt.serve.validate import check_prompt_tokens, single

__all__ = ["DraftModel", "OnePassModel", "TargetModel"]


class OnePassModel(StubModel):
    """Explicit-batch model over the backend: input_ids [B, T] right-padded + input_lengths [B].

    The models load on the first request: the `dspark` model already loads (and so checks) the same build at
    startup, and loading it three times at once roughly doubled server start time on a small CPU host."""

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        self.lock = threading.Lock()
        self._loaded: LoadedBackend | None = None

    @property
    def loaded(self) -> LoadedBackend:
        if self._loaded is None:
            self._loaded = load_backend(self.cfg)
        return self._loaded

    def _prompts(self, request: Any) -> list[list[int]]:
        ids = self._get(request, "input_ids")
        lens = self._get(request, "input_lengths")
        if ids is None or lens is None:
            raise RequestError("input_ids [B, T] and input_lengths [B] are required", "input_ids")
        ids, lens = np.asarray(ids), np.asarray(lens).reshape(-1)
        if not 1 <= len(lens) <= self.cfg.max_batch:
            raise RequestError(f"batch must have 1..{self.cfg.max_batch} rows (MAX_BATCH_SIZE), got {len(lens)} "
                               "input_lengths", "input_lengths")
        if ids.size == 0 or ids.size % len(lens):
            raise RequestError(f"input_ids must be [B, T] with one row per input_lengths entry: {ids.size} ids for "
                               f"{len(lens)} rows", "input_ids")
        ids = ids.reshape(len(lens), -1)  # [B, T]
        bad = [i for i, n in enumerate(lens) if not 1 <= int(n) <= ids.shape[1]]
        if bad:
            raise RequestError(f"input_lengths[{bad[0]}] = {int(lens[bad[0]])} must be in 1..{ids.shape[1]} (the "
                               "row's tokens in input_ids)", "input_lengths")
        prompts = [[int(t) for t in ids[i, : int(n)]] for i, n in enumerate(lens)]
        for i, p in enumerate(prompts):
            check_prompt_tokens(p, self.cfg.max_prompt_tokens, self.loaded.vocab_size, f"input_ids row {i}",
                                "input_ids")
        return prompts

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for r in requests:
            try:
                with self.lock:
                    prompts = self._prompts(r)
                    slots = list(range(len(prompts)))
                    try:
                        out.append(self._run(r, slots, prompts))
                    finally:
                        for s in slots:
                            self.loaded.backend.release(s)
            except Exception as exc:  # noqa: BLE001
                out.append(self.error_response(exc))
        return out

    def _run(self, request: Any, slots: list[int], prompts: list[list[int]]) -> Any:
        raise NotImplementedError


class TargetModel(OnePassModel):
    """One target forward per row: the next greedy token and the last-position logits."""

    def _run(self, request: Any, slots: list[int], prompts: list[list[int]]) -> Any:
        logits = self.loaded.backend.prefill(slots, prompts).float()  # [B, V]
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("next_token_ids", logits.argmax(-1).numpy().astype(np.int32)),  # [B]
            self.pb.Tensor("last_logits", logits.numpy().astype(np.float32))])  # [B, V]


class DraftModel(OnePassModel):
    """One drafter block per row after the target's greedy next token: draft_ids [B, γ], confidence [B, γ]."""

    def _run(self, request: Any, slots: list[int], prompts: list[list[int]]) -> Any:
        import torch  # noqa: PLC0415

        from dspark_trt.spec_decode.protocols import SamplingParams  # noqa: PLC0415

        g = single({"gamma": self._get(request, "gamma")}, "gamma")
        gamma = self.cfg.gamma if g is None else int(g)
        if not 1 <= gamma <= self.cfg.gamma:
            raise RequestError(f"gamma must be in 1..{self.cfg.gamma} (the build's γ), got {gamma}", "gamma")
        anchors = self.loaded.backend.prefill(slots, prompts).float().argmax(-1)  # [B]
        block = self.loaded.backend.draft(slots, anchors.long(), gamma, [SamplingParams()] * len(slots))
        conf = block.conf if block.conf is not None else torch.full(block.tokens.shape, float("nan"))
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("anchor_ids", anchors.numpy().astype(np.int32)),  # [B]
            self.pb.Tensor("draft_ids", block.tokens.numpy().astype(np.int32)),  # [B, γ]
            self.pb.Tensor("confidence", conf.float().numpy().astype(np.float32))])  # [B, γ]
