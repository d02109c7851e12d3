"""The OpenAI frontend's protocol pieces without a server: request checks (OpenAI error statuses and params),
stop strings cut on the streamed text (also when split across responses), and finish reasons."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from dspark_trt.serve.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, StreamText,
                                              finish_reason)


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair.tokenizer)


def test_one_prompt_forms() -> None:
    assert CompletionRequest(model="m", prompt="hi").one_prompt() == "hi"
    assert CompletionRequest(model="m", prompt=["hi"]).one_prompt() == "hi"
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).one_prompt() == [1, 2, 3]
    assert CompletionRequest(model="m", prompt=[[4, 5]]).one_prompt() == [4, 5]
    for bad in (["a", "b"], "", "  ", []):
        with pytest.raises(OpenAIError) as info:
            CompletionRequest(model="m", prompt=bad).one_prompt()
        assert info.value.status == 400 and info.value.param == "prompt"


@pytest.mark.parametrize("fields,param", [({"n": 2}, "n"), ({"presence_penalty": 0.5}, "presence_penalty"),
                                          ({"logit_bias": {"1": 2.0}}, "logit_bias"), ({"echo": True}, "echo"),
                                          ({"logprobs": 1}, "logprobs"), ({"best_of": 3}, "best_of")])
def test_unsupported_options_are_400(fields: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(model="m", prompt="x", **fields).check_supported()
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_request_checks() -> None:
    ok = ChatCompletionRequest(model="m", messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                      {"type": "text", "text": "b"}]},
                                                    {"role": "user", "content": "q"}], max_completion_tokens=5)
    ok.check_supported()
    assert ok.messages[0].as_template_message() == {"role": "system", "content": "ab"}
    assert ok.requested_max_tokens() == 5
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], temperature=3)
    for fields in ({"tools": [{"type": "function"}]}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(OpenAIError):
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **fields).check_supported()
    with pytest.raises(OpenAIError, match="image"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}]
                              ).check_supported()


def test_stop_strings_parsing() -> None:
    assert CompletionRequest(model="m", prompt="x", stop="ab").stop_strings() == ("ab",)
    assert CompletionRequest(model="m", prompt="x", stop=["a", "b"]).stop_strings() == ("a", "b")
    assert CompletionRequest(model="m", prompt="x").stop_strings() == ()
    with pytest.raises(OpenAIError):
        CompletionRequest(model="m", prompt="x", stop=["a", ""]).stop_strings()


def _feed_all(tokenizer, ids: list[int], stops: tuple[str, ...], step: int) -> tuple[str, StreamText]:  # noqa: ANN001
    st = StreamText(tokenizer, stops)
    out = []
    for i in range(0, len(ids), step):
        out.append(st.feed(ids[i:i + step], final=i + step >= len(ids)))
        if st.stopped:
            break
    return "".join(out), st


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_stream_text_stop_split_across_pieces(tokenizer, step: int) -> None:  # noqa: ANN001
    text = "def main(argv):\n    return argv[0] + 1\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    full, _ = _feed_all(tokenizer, ids, (), step)
    assert full == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for stop in ("return", "argv[0]", "\n", "+ 1\n"):
        got, st = _feed_all(tokenizer, ids, (stop, "never-there"), step)
        assert got == full[:full.find(stop)] and st.stopped
    got, st = _feed_all(tokenizer, ids, ("never-there",), step)
    assert got == full and not st.stopped


def test_finish_reason_mapping() -> None:
    assert finish_reason("length") == "length"
    assert [finish_reason(r) for r in ("eos", "stop", "stopped", None)] == ["stop"] * 4
