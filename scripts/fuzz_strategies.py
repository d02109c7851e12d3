"""The hypothesis strategies of scripts/fuzz_api.py: what a fuzzed request is. OpenAI request bodies for
/v1/completions and /v1/chat/completions (wrong types, out-of-range and huge numbers, unicode with lone surrogates,
invalid UTF-8 bytes, empty and megabyte values, nested junk, unparsable JSON), Triton gRPC input tensors (any dtype,
shapes of 0 to 3 dims, values across each dtype's range) and the HTTP generate / infer JSON bodies. Every optional
request field is drawn too, the per-request `proposers` among them (valid values, unknown names, empty strings,
lists, wrong types; as a Triton input also of the wrong dtype or shape). Sends nothing: fuzz_api.py runs them.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

POLICIES = ("plain", "fixed", "confidence", "survival", "seed", "bogus", " Fixed ", "")
# The per-request `proposers` field (serve.validate.check_proposers): values it takes (any order, case and spaces;
# an empty name between commas is skipped, a repeated one counts once), then values it answers with a 400 /
# INVALID_ARGUMENT (empty, unknown names, "none" with a name, another separator), and names for OpenAI's list form.
PROPOSERS_OK = ("dspark", "suffix", "dspark,suffix", "suffix,dspark", "none", " DSpark , SUFFIX ", "NONE", "suffix,",
                "dspark,dspark")
PROPOSERS_BAD = ("", " ", ",", "bogus", "dspark,bogus", "none,dspark", "none,none", "plain", "dspark;suffix",
                 "dspark suffix")
PROPOSER_NAMES = ("dspark", "suffix", "none", " Suffix ", "bogus", "", "dspark,suffix")


# ---- strategies -----------------------------------------------------------------------------------------------
surrogate = st.integers(0xD800, 0xDFFF).map(chr)
any_char = st.one_of(st.characters(exclude_categories=()), surrogate,
                     st.sampled_from(["\x00", "\u2028", "\ufeff", "\U0010ffff", "\ufffd", "\n", "é"]))
huge_text = st.builds(lambda c, n: c * n, st.sampled_from(["a", "é", "\U0001f600", " ", "def f(): pass\n"]),
                      st.sampled_from([300, 5000, 90_000, 1_100_000]))
texts = st.one_of(st.text(max_size=30), st.text(alphabet=any_char, max_size=30),
                  st.sampled_from(["", " ", "\n", "def main(", "<|im_start|>", "\x00", "null", "tiny"]))
prompts = st.one_of(texts, texts, texts, texts, huge_text)  # where a long text matters: prompts, contents, stops
numbers = st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70),
                    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30]),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e-300]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
junk = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                    st.dictionaries(texts, kids, max_size=4)), max_leaves=10)
small_tokens = st.integers(1, 4)
proposer_texts = st.one_of(st.sampled_from(PROPOSERS_OK), st.sampled_from(PROPOSERS_OK),
                           st.sampled_from(PROPOSERS_BAD), texts)
proposer_lists = st.lists(st.sampled_from(PROPOSER_NAMES), max_size=3)  # [] and lists with a bad name too


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly `valid`, sometimes junk of any type."""
    return st.one_of(valid, valid, valid, junk)


def _common(model: str) -> dict[str, st.SearchStrategy[Any]]:
    return {"model": st.one_of(st.just(model), st.just(model), st.just(model), texts, junk),
            "max_tokens": st.one_of(small_tokens, small_tokens, small_tokens, numbers, junk)}


def _optional() -> dict[str, st.SearchStrategy[Any]]:
    return {"temperature": _maybe(st.sampled_from([0, 0.0, 0.7, 2, 2.5, -0.1])), "top_p": _maybe(numbers),
            "seed": _maybe(numbers), "stream": _maybe(st.booleans()),
            "stream_options": _maybe(st.fixed_dictionaries({"include_usage": _maybe(st.booleans())})),
            "stop": _maybe(st.one_of(prompts, st.lists(prompts, max_size=6))), "n": _maybe(st.sampled_from([1, 2, 0])),
            "logit_bias": _maybe(st.dictionaries(st.text(max_size=3), numbers, max_size=2)),
            "presence_penalty": _maybe(numbers), "frequency_penalty": _maybe(numbers), "user": _maybe(texts),
            "policy": _maybe(st.sampled_from(POLICIES)), "min_k": _maybe(st.integers(-1, 6)),
            "max_k": _maybe(st.integers(-1, 6)), "return_stats": _maybe(st.booleans()),
            "proposers": _maybe(st.one_of(proposer_texts, proposer_texts, proposer_lists,
                                          st.lists(junk, min_size=1, max_size=2))),  # _maybe: any other type too
            "tools": _maybe(st.lists(junk, max_size=2)), "response_format": _maybe(junk), "echo": _maybe(st.booleans()),
            "logprobs": _maybe(st.one_of(st.booleans(), st.integers(0, 5))), "best_of": _maybe(st.integers(0, 3)),
            "suffix": _maybe(texts)}


def _with_extra(body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    extra = st.dictionaries(texts, junk, max_size=3)
    return st.one_of(body, body, body, st.builds(lambda b, e: {**e, **b}, body, extra), junk)


def completion_bodies(model: str) -> st.SearchStrategy[Any]:
    prompt = st.one_of(st.sampled_from(["def main(", "import os", "x"]), prompts,
                       st.lists(st.integers(-5, 600), max_size=8), st.lists(texts, max_size=3),
                       st.lists(st.lists(st.integers(0, 511), max_size=4), max_size=2), junk)
    return _with_extra(st.fixed_dictionaries({**_common(model), "prompt": prompt}, optional=_optional()))


def chat_bodies(model: str) -> st.SearchStrategy[Any]:
    role = st.one_of(st.sampled_from(["user", "user", "system", "assistant", "developer", "tool"]), texts)
    part = st.fixed_dictionaries({"type": st.one_of(st.just("text"), texts)}, optional={"text": _maybe(prompts)})
    content = st.one_of(st.sampled_from(["Hi!", "def main("]), prompts, st.lists(part, max_size=3), st.none(), junk)
    message = _maybe(st.fixed_dictionaries({"role": role, "content": content}, optional={"name": _maybe(texts)}))
    messages = st.one_of(st.lists(message, min_size=1, max_size=3), st.just([]), junk)
    optional = {**_optional(), "max_completion_tokens": _maybe(small_tokens)}
    return _with_extra(st.fixed_dictionaries({**_common(model), "messages": messages}, optional=optional))


def encoded(bodies: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """A body as bytes: JSON (ASCII-escaped, or raw UTF-8 with lone surrogates as invalid bytes), sometimes with
    random bytes spliced in, or no JSON at all (deep nesting, truncation, binary)."""
    def dump(obj: Any, ascii_only: bool) -> bytes:
        return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")

    def splice(raw: bytes, at: int, junk_bytes: bytes) -> bytes:
        at %= len(raw) + 1
        return raw[:at] + junk_bytes + raw[at:]

    plain = st.builds(dump, bodies, st.booleans())
    spliced = st.builds(splice, plain, st.integers(0, 2**16), st.binary(min_size=1, max_size=8))
    raw = st.one_of(st.binary(max_size=64), st.builds(lambda d: b"[" * d + b"]" * d, st.sampled_from([10, 10_000])),
                    plain.map(lambda b: b[: len(b) // 2]))
    return st.one_of(plain, plain, plain, plain, spliced, raw)


# Triton: gRPC tensors and HTTP JSON
DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32,
          "FP64": np.float64, "BYTES": np.object_}
VALID = {"text_input": ("BYTES", [[b"def main("]]), "max_tokens": ("INT32", [[3]]), "input_ids": ("INT32", [[5, 6, 7]]),
         "input_lengths": ("INT32", [3]), "gamma": ("INT32", [2])}
MODELS = {"ensemble": ("text_input", "max_tokens"), "ensemble_stream": ("text_input", "max_tokens"),
          "dspark": ("input_ids", "max_tokens"), "target": ("input_ids", "input_lengths"),
          "draft": ("input_ids", "input_lengths", "gamma")}
INPUT_NAMES = ("text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words", "end_id",
               "policy", "min_k", "max_k", "return_stats", "stop", "apply_chat_template", "proposers", "input_ids",
               "stop_words_ids", "input_lengths", "gamma")
byte_values = st.one_of(texts.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=12))
# BYTES inputs with values of their own besides any bytes: the names they take, and names they refuse.
NAMED_BYTES: dict[str, st.SearchStrategy[bytes]] = {
    "policy": st.sampled_from(POLICIES).map(str.encode),
    "proposers": st.sampled_from(PROPOSERS_OK + PROPOSERS_OK + PROPOSERS_BAD).map(str.encode)}


@st.composite
def tensor(draw: Callable[..., Any], name: str | None = None) -> tuple[str, str, np.ndarray]:
    """(name, datatype, array): any dtype, a shape of up to 3 dims (0 allowed), values across the dtype's range."""
    name = name if name is not None else draw(st.one_of(st.sampled_from(INPUT_NAMES), st.text("abcz_", max_size=6)))
    dt = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape)) if shape else 1
    if dt == "BYTES":
        arr = np.array(draw(st.lists(byte_values, min_size=n, max_size=n)), dtype=np.object_).reshape(shape)
    elif dt == "BOOL":
        arr = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_).reshape(shape)
    else:
        np_dt = np.dtype(DTYPES[dt])
        if np_dt.kind == "f":
            vals = draw(st.lists(st.floats(width=8 * np_dt.itemsize, allow_nan=True), min_size=n, max_size=n))
        else:
            info = np.iinfo(np_dt)
            vals = draw(st.lists(st.one_of(st.integers(-3, 600), st.integers(int(info.min), int(info.max))),
                                 min_size=n, max_size=n).map(lambda v: [min(max(x, info.min), info.max) for x in v]))
        arr = np.array(vals, dtype=np_dt).reshape(shape)
    return name, dt, arr


# The generation inputs of ensemble / ensemble_stream / dspark and their config dtypes.
GEN_TYPES = {"max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32", "random_seed": "UINT64",
             "end_id": "INT32", "policy": "BYTES", "min_k": "INT32", "max_k": "INT32", "return_stats": "BOOL",
             "stop": "BOOL", "proposers": "BYTES"}
TYPED = {"ensemble": {**GEN_TYPES, "stop_words": "BYTES", "apply_chat_template": "BOOL"},
         "dspark": {**GEN_TYPES, "stop_words_ids": "INT32"}, "target": {}, "draft": {"gamma": "INT32"}}
TYPED["ensemble_stream"] = TYPED["ensemble"]


@st.composite
def typed_tensor(draw: Callable[..., Any], name: str, dt: str) -> tuple[str, str, np.ndarray]:
    """An input of its config dtype and shape ([1, 1]; stop_words [1, n]; stop_words_ids [1, 2, n]), any value."""
    if dt == "BYTES":
        vals = draw(st.one_of(NAMED_BYTES[name], byte_values)) if name in NAMED_BYTES else draw(byte_values)
        n = draw(st.integers(0, 6)) if name == "stop_words" else 1
        return name, dt, np.array([[vals] * n], dtype=np.object_)
    if name == "stop_words_ids":
        n = draw(st.integers(0, 5))
        vals = draw(st.lists(st.integers(-2, 600), min_size=2 * n, max_size=2 * n))
        return name, dt, np.array(vals, dtype=np.int32).reshape(1, 2, n)
    np_dt = np.dtype(DTYPES[dt])
    if dt == "BOOL":
        v: Any = draw(st.booleans())
    elif np_dt.kind == "f":
        v = draw(st.one_of(st.floats(width=32, allow_nan=True), st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0])))
    else:
        info = np.iinfo(np_dt)
        v = draw(st.one_of(st.integers(-3, 300), st.integers(int(info.min), int(info.max))))
        v = min(max(v, int(info.min)), int(info.max))
    return name, dt, np.array([[v]], dtype=np_dt)


@st.composite
def triton_requests(draw: Callable[..., Any], models: tuple[str, ...] = tuple(MODELS)
                    ) -> tuple[str, list[tuple[str, str, np.ndarray]]]:
    """(model, inputs): the model's valid inputs, some of its other inputs of the right dtype with any value, some
    replaced by random tensors (any dtype / shape; `proposers` too), some dropped, some unknown ones added."""
    model = draw(st.sampled_from(sorted(models)))
    inputs = {}
    for name in MODELS[model]:
        dt, data = VALID[name]
        inputs[name] = (name, dt, np.array(data, dtype=DTYPES[dt]))
    typed = TYPED[model]
    for name in draw(st.lists(st.sampled_from(sorted(typed)), max_size=4, unique=True)) if typed else []:
        inputs[name] = draw(typed_tensor(name, typed[name]))
    how = draw(st.sampled_from(["as drawn", "as drawn", "as drawn", "named", "named", "any"])) if "proposers" in typed \
        else "as drawn"  # the per-request proposers: often a name (taken or refused), sometimes any dtype / shape
    if how != "as drawn":
        inputs["proposers"] = draw(typed_tensor("proposers", "BYTES") if how == "named" else tensor("proposers"))
    for name in draw(st.lists(st.sampled_from(MODELS[model]), max_size=2, unique=True)):
        if draw(st.booleans()):
            inputs[name] = draw(tensor(name))
        else:
            del inputs[name]
    for extra in draw(st.lists(tensor(), max_size=3)):
        inputs[extra[0]] = extra
    return model, list(inputs.values())


GENERATE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "text_input": st.one_of(st.sampled_from(["def main(", "x"]), prompts), "max_tokens": st.one_of(small_tokens, numbers),
    "stream": st.booleans(), "temperature": numbers, "top_p": numbers, "random_seed": numbers,
    "stop_words": st.one_of(prompts, st.lists(prompts, max_size=6)), "end_id": numbers,
    "policy": st.sampled_from(POLICIES), "min_k": st.integers(-1, 6), "max_k": st.integers(-1, 6),
    "return_stats": st.booleans(), "stop": st.booleans(), "apply_chat_template": st.booleans(),
    "proposers": st.one_of(proposer_texts, proposer_texts, proposer_lists), "id": texts,
    "parameters": st.dictionaries(texts, scalars, max_size=2)}


def generate_bodies() -> st.SearchStrategy[Any]:
    """JSON for /v2/models/{ensemble,ensemble_stream}/generate[_stream]: the inputs by name (mostly of their type,
    out of range; sometimes any JSON), unknown keys."""
    required = ("text_input", "max_tokens")
    body = st.fixed_dictionaries({k: _maybe(GENERATE_VALUES[k]) for k in required},
                                 optional={k: _maybe(v) for k, v in GENERATE_VALUES.items() if k not in required})
    return _with_extra(body)


def _as_json(t: tuple[str, str, np.ndarray]) -> dict[str, Any]:
    name, dt, arr = t
    flat = [x.decode("latin-1") if isinstance(x, bytes) else x for x in arr.reshape(-1).tolist()]
    return {"name": name, "shape": list(arr.shape), "datatype": dt, "data": flat}


def infer_bodies() -> st.SearchStrategy[Any]:
    """KServe v2 JSON for /v2/models/{model}/infer: the gRPC fuzzer's tensors as JSON (model, body); the models
    that answer HTTP infer (a decoupled one answers 501, documented)."""
    return triton_requests(("ensemble", "target", "draft")).map(lambda r: (r[0], {"inputs": [_as_json(t) for t in r[1]]}))
