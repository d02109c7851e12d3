"""The python-backend stand-in for a `tensorrtllm` model (testing only): the TensorRT-LLM 1.2.x tensor interface
of triton_backend/all_models/inflight_batcher_llm/tensorrt_llm, answered by trtllm_standin.engine.StandinEngine.

Owns StandinModel (the TritonPythonModel base that install_standin's 1/model.py subclasses): reads a request's
tensorrtllm inputs (input_ids [1, T], input_lengths, request_output_len, draft_input_ids [1, K], temperature,
runtime_top_p, seed, return_generation_logits, return_context_logits (the tapped target only),
exclude_input_in_output (falling back to the config parameter), streaming, stop), runs every request of one execute()
as one batch, and answers output_ids [1, 1, n] INT32 (input + new tokens unless exclude_input_in_output),
sequence_length [1, 1] INT32 and, when asked, generation_logits [1, 1, n, V] FP32, context_logits [1, m, V] FP32 and
the tapped target's declared dspark_tap_<layer> outputs [1, m, H] FP32 (m: the computed input rows). Decoupled when the config says so (streaming: one response per engine step).
What it cannot do (beam search, context logits, draft logits, LoRA, multimodal...) is answered with an error
naming the input. Never part of a shipped repository.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dspark_trt.serve.gpu_host.rounds import EngineCall

log = logging.getLogger("dspark_trt.testing.trtllm_standin")

UNSUPPORTED = ("draft_logits", "encoder_input_features", "decoder_input_ids", "prompt_embedding_table",
               "lora_task_id", "lora_weights", "lora_config", "context_phase_params", "guided_decoding_guide")


def _truthy(v: str | None) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes", "t")


class StandinModel:
    pb: Any = None  # triton_python_backend_utils, set by 1/model.py

    def initialize(self, args: dict[str, str]) -> None:
        if not logging.getLogger("dspark_trt").handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger("dspark_trt").addHandler(h)
            logging.getLogger("dspark_trt").setLevel(logging.INFO)
        import torch  # noqa: PLC0415

        from dspark_trt.builder.artifacts import read_manifest  # noqa: PLC0415
        from dspark_trt.builder.options import BuildOptions  # noqa: PLC0415
        from dspark_trt.runtime.trtllm_checkpoint import STR_DTYPES, load_trtllm_checkpoint  # noqa: PLC0415
        from dspark_trt.testing.trtllm_standin.engine import StandinEngine  # noqa: PLC0415

        torch.set_num_threads(1)
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        self.name = cfg.get("name", "?")
        self.role = params["STANDIN_ROLE"]
        build = Path(params["STANDIN_BUILD_DIR"])
        self.exclude_default = _truthy(params.get("exclude_input_in_output", "false"))
        self.decoupled = bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))
        opts = BuildOptions.from_dict(read_manifest(build).get("options") or {})
        model = load_trtllm_checkpoint(build / self.role / "checkpoint", dtype=STR_DTYPES[opts.dtype])
        self.max_draft = opts.gamma if self.role == "target" else 0  # the engine's --max_draft_len
        self.taps = tuple(o["name"] for o in cfg.get("output", []) if o["name"].startswith("dspark_tap_"))
        self.engine = StandinEngine(model, max_batch=max(1, int(cfg.get("max_batch_size", 1))),
                                    max_seq=opts.max_seq_len + opts.gamma + 2,
                                    reuse_block=int(params.get("STANDIN_REUSE_BLOCK", "0") or 0))
        log.info("STAND-IN %s: tensorrtllm interface over the reference runtime (%s/checkpoint), max_draft_len %d, "
                 "decoupled %s; no engine runs here", self.name, self.role, self.max_draft, self.decoupled)

    def _get(self, request: Any, name: str) -> np.ndarray | None:
        t = self.pb.get_input_tensor_by_name(request, name)
        return None if t is None else np.asarray(t.as_numpy())

    def _scalar(self, request: Any, name: str, default: Any) -> Any:
        v = self._get(request, name)
        return default if v is None or v.size == 0 else v.reshape(-1)[0].item()

    def _parse(self, request: Any) -> tuple[EngineCall | None, bool, bool, str | None]:
        """→ (call, exclude_input_in_output, streaming, error); call None for a stop request or an error."""
        if bool(self._scalar(request, "stop", False)):
            return None, True, False, None
        for name in UNSUPPORTED:
            if self._get(request, name) is not None:
                return None, True, False, f"input {name} is not supported by the stand-in"
        if int(self._scalar(request, "beam_width", 1)) != 1 or int(self._scalar(request, "num_return_sequences", 1)) != 1:
            return None, True, False, "beam_width / num_return_sequences other than 1 are not supported (max_beam_width 1)"
        ctx = bool(self._scalar(request, "return_context_logits", False))
        if ctx and not self.taps:
            return None, True, False, "return_context_logits is not supported (the engine gathers generation logits only)"
        ids = self._get(request, "input_ids")
        if ids is None:
            return None, True, False, "input_ids is required"
        n = int(self._scalar(request, "input_lengths", ids.size))
        ids = ids.reshape(-1)[:n]
        draft = self._get(request, "draft_input_ids")
        draft = () if draft is None else tuple(int(t) for t in draft.reshape(-1))
        if len(draft) > self.max_draft:
            return None, True, False, (f"draft_input_ids has {len(draft)} tokens; the engine was built with "
                                       f"max_draft_len {self.max_draft}")
        seed = self._get(request, "seed")
        call = EngineCall(tuple(int(t) for t in ids), int(self._scalar(request, "request_output_len", 0)), draft,
                          float(self._scalar(request, "temperature", 0.0)), float(self._scalar(request, "runtime_top_p", 1.0)),
                          None if seed is None else int(seed.reshape(-1)[0]),
                          bool(self._scalar(request, "return_generation_logits", False)), request.request_id(),
                          ctx, self._requested_taps(request))
        exclude = bool(self._scalar(request, "exclude_input_in_output", self.exclude_default))
        return call, exclude, bool(self._scalar(request, "streaming", False)), None

    def _requested_taps(self, request: Any) -> tuple[str, ...]:
        """The tap outputs this request asked for (all declared ones when the stub cannot tell)."""
        try:
            asked = set(request.requested_output_names())
        except Exception:  # noqa: BLE001 - older python backends
            return self.taps
        return tuple(n for n in self.taps if n in asked)

    def _response(self, call: EngineCall | None, tokens: list[int], logits: np.ndarray | None, exclude: bool,
                  rep: Any = None) -> Any:
        pb = self.pb
        ids = list(tokens) if exclude or call is None else list(call.input_ids) + list(tokens)
        out = [pb.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)),  # [1, beam, n]
               pb.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32))]  # [1, beam]
        if logits is not None:
            out.append(pb.Tensor("generation_logits", np.asarray(logits, dtype=np.float32)[None, None]))  # [1,1,n,V]
        if rep is not None and rep.context_logits is not None:
            out.append(pb.Tensor("context_logits", np.asarray(rep.context_logits, dtype=np.float32)[None]))  # [1,m,V]
        for name, rows in ((rep.taps or {}) if rep is not None else {}).items():
            out.append(pb.Tensor(name, np.ascontiguousarray(rows, dtype=np.float32)[None]))  # [1, m, H]
        return pb.InferenceResponse(output_tensors=out)

    def _error(self, message: str) -> Any:
        return self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(f"{self.name}: {message}"))

    def execute(self, requests: list[Any]) -> list[Any] | None:
        parsed = [self._parse(r) for r in requests]
        calls = [p[0] for p in parsed if p[0] is not None]
        replies = iter(self.engine.run(calls)) if calls else iter(())
        answers: list[list[Any]] = []
        for call, exclude, streaming, err in parsed:
            if err is not None:
                answers.append([self._error(err)])
                continue
            if call is None:  # stop: nothing in flight between calls in this stand-in
                answers.append([self._response(None, [], None, True)])
                continue
            rep = next(replies)
            if rep.error:
                answers.append([self._error(rep.error)])
            elif streaming and self.decoupled:
                resp, at = [], 0
                for n in rep.steps:
                    lg = None if rep.logits is None else rep.logits[at:at + n]
                    resp.append(self._response(call, rep.tokens[at:at + n], lg, True))
                    at += n
                answers.append(resp)
            else:
                answers.append([self._response(call, rep.tokens, rep.logits, exclude, rep)])
        log.debug("%s: executed %d request(s) as one batch", self.name, len(calls))
        if not self.decoupled:
            return [a[0] for a in answers]
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for r, resp in zip(requests, answers):
            sender = r.get_response_sender()
            for j, x in enumerate(resp):
                sender.send(x, flags=final if j == len(resp) - 1 else 0)
        return None

    def finalize(self) -> None:
        log.info("STAND-IN %s unloaded", getattr(self, "name", "?"))
