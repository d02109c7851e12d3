"""Pure pieces of the served pipeline (no server): request validation (limits on stop strings and stop-word ids,
valid Unicode), stop-word packing, incremental detokenization (streamed deltas concatenate to the full text,
multi-byte characters included)."""
from __future__ import annotations

import numpy as np
import pytest

from dspark_trt.errors import RequestError
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.text import (CONTEXT_TOKENS, delta_text, encode_prompt, encode_stop_words, pack_stop_words,
                                   unpack_stop_words)
from dspark_trt.serve.validate import (MAX_STOP_CHARS, MAX_STOP_TOKENS, MAX_STOP_WORDS, check_request_parameters,
                                       check_stop_sequences, check_stop_strings, check_stop_words_ids, check_text,
                                       decode_text, parse_generation)

LIMITS = ServeConfig(max_seq_len=64, max_batch=4, gamma=4, vocab_size=512, policy="confidence", min_k=1, max_k=4,
                     max_queue=8)


@pytest.fixture(scope="module")
def tok(tiny_pair):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair.tokenizer)


def _inp(**kw: object) -> dict[str, np.ndarray]:
    return {k: np.array([[v]], dtype=object if isinstance(v, (str, bytes)) else None) for k, v in kw.items()}


def test_parse_defaults_and_overrides() -> None:
    p = parse_generation(_inp(max_tokens=10), 5, LIMITS)
    assert (p.max_tokens, p.policy, p.min_k, p.max_k, p.temperature, p.stream) == (10, "confidence", 1, 4, 0.0, False)
    p = parse_generation(_inp(max_tokens=10, policy=b"FIXED", max_k=2, stream=True, return_stats=True), 5, LIMITS)
    assert (p.policy, p.max_k, p.stream, p.return_stats) == ("fixed", 2, True, True)


@pytest.mark.parametrize("kw,needle", [
    (dict(max_tokens=0), "max_tokens must be"), (dict(max_tokens=60), "lower max_tokens"),
    (dict(max_tokens=4, temperature=-0.5), "temperature"), (dict(max_tokens=4, temperature=float("nan")), "finite"),
    (dict(max_tokens=4, top_p=0.0), "top_p"), (dict(max_tokens=4, random_seed=-1), "random_seed"),
    (dict(max_tokens=4, end_id=512), "end_id"), (dict(max_tokens=4, policy=b"nope"), "policy"),
    (dict(max_tokens=4, min_k=3, max_k=2), "min_k"), (dict(max_tokens=4, max_k=5), "max_k"),
    (dict(max_tokens=4, min_k=0), "confidence policy"), (dict(max_tokens=4, policy=b"\xff"), "UTF-8"),
])
def test_parse_rejects(kw: dict, needle: str) -> None:
    with pytest.raises(RequestError, match=needle):
        parse_generation(_inp(**kw), 5, LIMITS)


def test_batch_of_two_rejected() -> None:
    with pytest.raises(RequestError, match="one value per request"):
        parse_generation({"max_tokens": np.array([[4], [4]])}, 5, LIMITS)


def test_unknown_parameters() -> None:
    check_request_parameters('{"triton_enable_empty_final_response": true}')
    with pytest.raises(RequestError, match="'top_k'"):
        check_request_parameters('{"top_k": 4}')


def test_decode_text() -> None:
    assert decode_text(b"caf\xc3\xa9") == "café"
    with pytest.raises(RequestError, match="byte 3"):
        decode_text(b"caf\xc3")


def test_stop_words_roundtrip(tok) -> None:  # noqa: ANN001
    seqs = encode_stop_words(tok, [b"return", "x = 1"])
    assert unpack_stop_words(pack_stop_words(seqs)[None]) == tuple(tuple(s) for s in seqs)
    assert unpack_stop_words(pack_stop_words([])) == ()
    with pytest.raises(RequestError, match="empty string"):
        encode_stop_words(tok, [b""])


def test_prompt_checks(tok) -> None:  # noqa: ANN001
    assert encode_prompt(tok, "def f", False, 10)
    with pytest.raises(RequestError, match="empty"):
        encode_prompt(tok, "  ", False, 10)
    with pytest.raises(RequestError, match="shorten"):
        encode_prompt(tok, "x = 1\n" * 50, False, 10)
    assert encode_prompt(tok, "hi", True, 100)[0] == tok.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize("text", ["plain ascii text, nothing special", "héllo wörld — ünïcode ✓ 日本語 🚀🚀 end"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_deltas_concatenate_to_full_text(tok, text: str, chunk: int) -> None:  # noqa: ANN001
    ids = tok(text, add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    pieces, sent = [], 0
    while sent < len(ids):
        new = ids[sent:sent + chunk]
        final = sent + chunk >= len(ids)
        pieces.append(delta_text(tok, ids[max(0, sent - CONTEXT_TOKENS):sent], new, final))
        sent += len(new)
    assert "".join(pieces) == full
    assert not any("\ufffd" in p for p in pieces[:-1]) or "\ufffd" in full


def test_seed_is_an_alias_of_the_confidence_policy() -> None:
    p = parse_generation(_inp(max_tokens=10, policy=b"Seed"), 5, LIMITS)
    assert p.policy == "confidence"
    old_build = ServeConfig(max_seq_len=64, max_batch=4, gamma=4, vocab_size=512, policy="seed", min_k=1, max_k=4)
    assert parse_generation(_inp(max_tokens=10), 5, old_build).policy == "confidence"  # POLICY "seed" in config.pbtxt
    with pytest.raises(RequestError, match="confidence policy"):
        parse_generation(_inp(max_tokens=4, policy=b"seed", min_k=0), 5, LIMITS)


def test_text_must_be_valid_unicode() -> None:
    assert check_text("héllo 🚀", "prompt") == "héllo 🚀"
    with pytest.raises(RequestError, match=r"lone surrogate \(U\+D800 at character 2\)") as info:
        check_text("ab\ud800c", "message content", "messages")
    assert info.value.param == "messages"
    with pytest.raises(RequestError, match="lone surrogate"):
        decode_text("x\udfff", "text_input")


def test_stop_string_limits() -> None:
    assert check_stop_strings(["a", "b" * MAX_STOP_CHARS], "stop") == ("a", "b" * MAX_STOP_CHARS)
    for stops, needle in ((["a"] * (MAX_STOP_WORDS + 1), f"at most {MAX_STOP_WORDS} strings"),
                          (["a", ""], "empty string"), (["x" * (MAX_STOP_CHARS + 1)], f"more than the {MAX_STOP_CHARS}"),
                          (["\ud83d"], "lone surrogate")):
        with pytest.raises(RequestError, match=needle) as info:
            check_stop_strings(stops, "stop")
        assert info.value.param == "stop"


def test_stop_words_ids_layout_and_limits() -> None:
    seqs = [[1, 2], [3]]
    packed = pack_stop_words(seqs)[None]  # [1, 2, N]
    check_stop_words_ids(packed)
    check_stop_words_ids(packed[0])  # [2, N]
    check_stop_words_ids(None)
    for bad in (np.zeros((3,), np.int32), np.zeros((2, 2, 3), np.int32), np.array([[1, 2], [2, 1]], np.int32),
                np.array([[1, 2], [5, -1]], np.int32)):
        with pytest.raises(RequestError, match="stop_words_ids") as info:
            check_stop_words_ids(bad)
        assert info.value.param == "stop_words_ids"
    assert check_stop_sequences(unpack_stop_words(packed), LIMITS) == ((1, 2), (3,))
    with pytest.raises(RequestError, match=f"more than the {MAX_STOP_WORDS}"):
        check_stop_sequences([[1]] * (MAX_STOP_WORDS + 1), LIMITS)
    with pytest.raises(RequestError, match=f"more than the {MAX_STOP_TOKENS}"):
        check_stop_sequences([[1] * (MAX_STOP_TOKENS + 1)], LIMITS)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        check_stop_sequences([[1, 512]], LIMITS)
    with pytest.raises(RequestError, match="outside the vocabulary"):  # the dspark model's own path
        parse_generation(_inp(max_tokens=4), 5, LIMITS, stop_sequences=((600,),))
