"""Text ↔ token ids for the served pipeline: prompt encoding (optional chat template), stop words packed in
tensorrtllm_backend's [2, N] layout, and stateless incremental detokenization for streaming.

Owns the tokenizing logic of the `preprocessing` model and the detokenizing of the `dspark` model's responses
(`delta_text`, also the OpenAI frontend's); the Triton adapters only move tensors.
Incremental detokenization without per-request state: each streamed response carries the newly committed ids
and up to CONTEXT_TOKENS ids committed before them; the delta text is printable(context + new) minus
printable(context), where printable drops a trailing incomplete UTF-8 character (U+FFFD) until a final
response flushes it. Concatenating the streamed deltas gives the non-streamed text.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dspark_trt.errors import RequestError
from dspark_trt.serve.validate import check_prompt_tokens, decode_text

CONTEXT_TOKENS = 8  # ids of left context sent with each streamed delta
REPLACEMENT = "\ufffd"


def encode_prompt(tokenizer: Any, text: str, chat: bool, max_tokens: int) -> list[int]:
    """Prompt text → ids; empty or over-long prompts (more than max_tokens ids: the build's max_prompt_tokens) raise
    RequestError."""
    if not text.strip():
        raise RequestError("text_input is empty; send a non-empty prompt", "text_input")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("apply_chat_template=true but this model's tokenizer has no chat template; send "
                               "the formatted prompt with apply_chat_template=false", "apply_chat_template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    ids = [int(t) for t in ids]
    check_prompt_tokens(ids, max_tokens, None, "text_input")  # no tokens, or more than the build accepts
    return ids


def encode_stop_words(tokenizer: Any, words: Sequence[object]) -> list[list[int]]:
    """Stop strings → token-id sequences (no special tokens)."""
    out = []
    for raw in words:
        w = decode_text(raw, "stop_words")
        if not w:
            raise RequestError("stop_words contains an empty string; remove it", "stop_words")
        ids = [int(t) for t in tokenizer(w, add_special_tokens=False)["input_ids"]]
        if ids:
            out.append(ids)
    return out


def pack_stop_words(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    """[[ids...], ...] → int32 [2, N]: row 0 concatenated ids, row 1 cumulative end offsets padded with −1."""
    flat = [t for s in seqs for t in s]
    n = max(1, len(flat))
    out = np.full((2, n), -1, dtype=np.int32)  # [2, N]
    out[0, : len(flat)] = flat
    ends = np.cumsum([len(s) for s in seqs]) if seqs else []
    out[1, : len(ends)] = ends
    return out


def unpack_stop_words(packed: np.ndarray | None) -> tuple[tuple[int, ...], ...]:
    """Inverse of pack_stop_words (a leading batch dim of 1 is allowed)."""
    if packed is None:
        return ()
    arr = np.asarray(packed).reshape(2, -1)  # [2, N]
    ends = [int(e) for e in arr[1] if e >= 0]
    seqs, start = [], 0
    for end in ends:
        seqs.append(tuple(int(t) for t in arr[0, start:end]))
        start = end
    return tuple(s for s in seqs if s)


def _printable(tokenizer: Any, ids: Sequence[int], final: bool) -> str:
    text = tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not final:
        text = text.rstrip(REPLACEMENT)
    return text


def delta_text(tokenizer: Any, context: Sequence[int], new: Sequence[int], final: bool) -> str:
    """Text the new ids add after context (context = ids already streamed, or its last few)."""
    if not context:
        return _printable(tokenizer, new, final)
    before = _printable(tokenizer, context, False)
    after = _printable(tokenizer, list(context) + list(new), final)
    if after.startswith(before):
        return after[len(before):]
    # a tokenizer whose decode is not prefix-stable: fall back to the new ids alone
    return _printable(tokenizer, new, final)
