"""The OpenAI frontend's protocol pieces without a server: request checks (OpenAI error statuses and params),
stop strings cut on the streamed text (also when split across responses), and finish reasons."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from dspark_trt.errors import RequestError
from dspark_trt.serve.openai.protocol import (UNSUPPORTED, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                              StreamText, finish_reason, http_error, validation_error)


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


@pytest.mark.parametrize("fields,param,code", [
    ({"n": 2}, "n", "unsupported_value"), ({"best_of": 2}, "best_of", "unsupported_value"),
    ({"frequency_penalty": -1}, "frequency_penalty", "unsupported_parameter"),
    ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", "unsupported_value"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_value"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_value"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter")])
def test_known_unsupported_parameters_name_themselves(fields: dict, param: str, code: str) -> None:
    with pytest.raises(OpenAIError) as info:
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **fields).check_supported()
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_neutral_values_and_unknown_fields_are_accepted() -> None:
    neutral = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "top_logprobs": 0, "echo": False, "suffix": "", "tools": [], "functions": [], "tool_choice": "none",
               "function_call": "auto", "response_format": {"type": "text"}, "audio": None, "modalities": ["text"],
               "reasoning_effort": None, "logprobs": None}
    assert set(neutral) == set(UNSUPPORTED) | {"logprobs"}  # every known-unsupported parameter is covered here
    extras = {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "no_such_field": [1]}
    CompletionRequest(model="m", prompt="x", **neutral, **extras).check_supported()
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **{**neutral, "logprobs": False},
                          **extras).check_supported()


def test_lone_surrogates_in_texts_are_400() -> None:
    with pytest.raises(RequestError, match="lone surrogate") as info:
        CompletionRequest(model="m", prompt="a\ud800").one_prompt()
    assert info.value.param == "prompt"
    with pytest.raises(RequestError, match="lone surrogate") as info:
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]
                              ).check_supported()
    assert info.value.param == "messages"


def test_framework_errors_in_openai_shape() -> None:
    err = validation_error([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
                             "ctx": {"error": "Expecting value"}}])
    assert err.status == 400 and err.param is None and "Expecting value at character 7" in err.message
    err = validation_error([{"type": "int_parsing", "loc": ("body", "max_tokens"), "msg": "Input should be an int"}])
    assert err.param == "max_tokens" and "max_tokens: Input should be an int" in err.message
    assert http_error(404, "Not Found", "GET", "/v1/nope").message.startswith("Invalid URL (GET /v1/nope)")
    assert http_error(405, "Method Not Allowed", "PUT", "/v1/models").status == 405
    assert "Fix:" in http_error(400, "There was an error parsing the body", "POST", "/v1/completions").message
    assert http_error(404, "x", "GET", "/" + "a" * 5000).message.count("a") < 300


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
    with pytest.raises(RequestError) as info:  # serve.validate.check_stop_strings: the app answers it as a 400
        CompletionRequest(model="m", prompt="x", stop=["a", ""]).stop_strings()
    assert info.value.param == "stop"
    with pytest.raises(RequestError, match="at most 4 strings"):
        CompletionRequest(model="m", prompt="x", stop=["a", "b", "c", "d", "e"]).stop_strings()


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
