"""The `preprocessing` model of both ensembles: text_input (+ apply_chat_template, stop_words) → input_ids,
stop_words_ids.

Owns the model's tensor plumbing only: the request checks are serve.validate's (unknown request parameters,
UTF-8, one value per input, the stop words' count and length: check_stop_strings), the tokenizing serve.text's
(encode_prompt → validate.check_prompt_tokens: empty or over-long prompts; stop words packed in
tensorrtllm_backend's [2, N] layout). Loads only the build's tokenizer.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dspark_trt.serve.build_loader import load_tokenizer_for
from dspark_trt.serve.text import encode_prompt, encode_stop_words, pack_stop_words
from dspark_trt.serve.triton.stub import StubModel
from dspark_trt.serve.validate import check_request_parameters, check_stop_strings, decode_text, single

__all__ = ["PreprocessingModel"]


class PreprocessingModel(StubModel):
    """Tokenize the prompt (optionally through the chat template) and the stop words."""

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        self.tokenizer = load_tokenizer_for(self.cfg)

    def _one(self, request: Any) -> Any:
        check_request_parameters(request.parameters())
        text = decode_text(single({"text_input": self._get(request, "text_input")}, "text_input"), "text_input")
        chat = single({"apply_chat_template": self._get(request, "apply_chat_template")}, "apply_chat_template")
        ids = encode_prompt(self.tokenizer, text, bool(chat) if chat is not None else False,
                            self.cfg.max_prompt_tokens)
        words = self._get(request, "stop_words")
        stops: list[list[int]] = []
        if words is not None:
            texts = check_stop_strings([decode_text(w, "stop_words") for w in np.asarray(words).reshape(-1)])
            stops = encode_stop_words(self.tokenizer, texts)
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1)),  # [1, T]
            self.pb.Tensor("stop_words_ids", pack_stop_words(stops)[None]),  # [1, 2, N]
        ])

    def execute(self, requests: list[Any]) -> list[Any]:
        out = []
        for r in requests:
            try:
                out.append(self._one(r))
            except Exception as exc:  # noqa: BLE001 - answered as an error response
                out.append(self.error_response(exc))
        return out
