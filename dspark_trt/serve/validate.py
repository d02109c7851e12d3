"""Request validation of every served entry point, written once: each check raises a RequestError (the one error
type, dspark_trt/errors.py) that names the problem and the fix, with `param` = the field as the caller's protocol
names it and, for requests too long for the build, `code` = "context_length_exceeded". The frontends map it to
their protocol: the Triton stubs (serve.triton, serve.gpu_host) to an INVALID_ARG error response, the OpenAI
frontend (serve.openai) to HTTP 400 in OpenAI's error shape. The server keeps serving either way.

Where each entry point asks (the edge of its process):
- Triton `preprocessing` (both ensembles): `check_request_parameters`, `decode_text`, `check_stop_strings` (the
  stop_words), then serve.text.encode_prompt → `check_prompt_tokens` (empty, over-long).
- Triton `dspark` (ensembles, direct gRPC, the OpenAI frontend's backend): `prompt_ids` (input_ids: one prompt,
  `check_prompt`), `check_stop_words_ids` + `check_stop_sequences` (stop_words_ids) and `parse_generation` (the
  generation tensors → `check_generation`); the GPU-host `dspark` runs the same code. `target` / `draft`:
  `check_prompt` per row.
- The OpenAI frontend: `check_text` on every string it tokenizes, `check_prompt` on the prompt it tokenized,
  `check_stop_strings` on `stop` and `check_generation` on the body's values, with its own field names
  (`OPENAI_NAMES`), before anything reaches Triton.
The request limits stated in docs/serving.md (the "Limits" table) are these constants and the build's ServeConfig:
MAX_STOP_WORDS stop strings (OpenAI's 4) of at most MAX_STOP_CHARS characters each (MAX_STOP_TOKENS ids each as
stop_words_ids), prompts of at most ServeConfig.max_prompt_tokens tokens, prompt + max_tokens ≤ ServeConfig.room.
The limits themselves are spec_decode.limits' (request_room, check_room, check_token_ids — the checks the round
loop's Request.check_fits asks too), the sampling rule spec_decode.sampling.check_sampling, the policy and proposer
names spec_decode.policies' (`check_proposers`: the per-request `proposers` field, PROPOSER_VALUES). Knows nothing
of Triton or HTTP (plain values and numpy in, dataclasses out).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from dspark_trt.errors import InvalidArgumentError, RequestError
from dspark_trt.serve.config import ServeConfig
from dspark_trt.spec_decode.limits import check_room, check_token_ids  # torch-free
from dspark_trt.spec_decode.policies import POLICIES, parse_proposers, resolve_policy_alias  # torch-free
from dspark_trt.spec_decode.sampling import check_sampling  # torch-free

__all__ = ["CONTEXT_LENGTH_EXCEEDED", "GenerationParams", "KNOWN_INPUTS", "KNOWN_PARAMETERS", "MAX_STOP_CHARS",
           "MAX_STOP_TOKENS", "MAX_STOP_WORDS", "NO_PROPOSERS", "OPENAI_NAMES", "PROPOSER_VALUES", "check_generation",
           "check_prompt", "check_prompt_tokens", "check_proposers", "check_request_parameters",
           "check_stop_sequences", "check_stop_strings", "check_stop_words_ids",
           "check_text", "decode_text", "parse_generation", "prompt_ids", "proposers_text", "request_key", "single"]

# Inputs of the ensemble (tensorrtllm_backend names + ours); anything else is unknown.
KNOWN_INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "random_seed", "stop_words", "end_id",
                "policy", "min_k", "max_k", "return_stats", "stop", "apply_chat_template", "proposers")

# Request parameters we accept: "id" = the request id over the HTTP generate endpoints (which pass unknown JSON
# keys as parameters and have no request-id field); a `stop` request targets it.
KNOWN_PARAMETERS = ("id",)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # RequestError.code of a request too long for the build
MAX_STOP_WORDS = 4  # stop strings per request (OpenAI's limit for `stop`; Triton's stop_words / stop_words_ids too)
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKENS = 4 * MAX_STOP_CHARS  # ids per stop sequence (stop_words_ids): a UTF-8 character is ≤ 4 byte tokens
# The OpenAI frontend's names for the fields check_generation knows by their Triton tensor names.
OPENAI_NAMES: Mapping[str, str] = {"random_seed": "seed"}
# The per-request `proposers` field (Triton input / OpenAI extension): who may propose this request's drafts. Absent:
# the server's (DSPARK_PROPOSERS). "none": no proposer, plain decoding (the policy becomes "plain"). The names may
# come in any order ("suffix,dspark" = "dspark,suffix"); OpenAI bodies may send a list of them.
NO_PROPOSERS = "none"
PROPOSER_VALUES = ("dspark", "suffix", "dspark,suffix", NO_PROPOSERS)
_ROOM_HINT = ", or rebuild with a larger --max-seq-len"


def request_key(request_id: str, params_json: str | None) -> str:
    """The id a `stop` request targets: the Triton request id, else the "id" request parameter."""
    if request_id:
        return request_id
    params = json.loads(params_json) if params_json else {}
    return str(params.get("id", ""))


@dataclass(frozen=True)
class GenerationParams:
    """One request's checked generation parameters."""

    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    policy: str = "survival"
    min_k: int = 2
    max_k: int = 8
    return_stats: bool = False
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    proposers: tuple[str, ...] | None = None  # None: the server's (DSPARK_PROPOSERS); (): "none" (policy "plain")


def check_text(text: str, what: str = "text_input", param: str | None = None) -> str:
    """`text` unchanged if it is valid Unicode a tokenizer can take; RequestError naming the first lone surrogate
    (JSON's "\\ud800" escapes decode to one; UTF-8 cannot encode it) otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), "
                           "which is not valid Unicode; send valid UTF-8 text (in JSON, escape a character outside "
                           "the BMP as a surrogate pair)", what if param is None else param) from exc
    return text


def decode_text(raw: object, what: str = "text_input") -> str:
    """bytes/str → str; bad UTF-8 (or a str with a lone surrogate) raises RequestError naming the offset."""
    if isinstance(raw, str):
        return check_text(raw, what)
    if not isinstance(raw, (bytes, bytearray, np.bytes_)):
        raise RequestError(f"{what} must be a string (BYTES tensor), got {type(raw).__name__}", what)
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 encoded "
                           "text", what) from exc


def check_request_parameters(params_json: str | Mapping[str, object] | None) -> None:
    """Triton request parameters (the generate endpoint turns unknown JSON keys into these) must be empty."""
    if not params_json:
        return
    params = json.loads(params_json) if isinstance(params_json, str) else dict(params_json)
    unknown = sorted(k for k in params if not k.startswith("triton_") and k not in KNOWN_PARAMETERS)
    if unknown:
        raise RequestError(f"unknown parameter(s) {', '.join(map(repr, unknown))}; known inputs are "
                           f"{', '.join(KNOWN_INPUTS)}", unknown[0])


# ---- proposers ----------------------------------------------------------------------------------------------
def check_proposers(value: str | Sequence[str] | None, param: str = "proposers") -> tuple[str, ...] | None:
    """The per-request proposers field → the proposer names in spec_decode.policies.PROPOSERS order (None: absent,
    the server's default; (): "none"). A comma list ("dspark,suffix") or a list of names, case and spaces
    ignored; RequestError naming the valid values (PROPOSER_VALUES) otherwise."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    names = [n.strip().lower() for n in items if n.strip()]
    if names == [NO_PROPOSERS]:
        return ()
    bad = NO_PROPOSERS in names or not names
    if not bad:
        try:
            return parse_proposers(names)
        except InvalidArgumentError:
            bad = True
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "…"
    raise RequestError(f"{param} must be one of {', '.join(repr(v) for v in PROPOSER_VALUES)} (who proposes this "
                       f"request's drafts; omit it for the server's default), got {shown}", param)


def proposers_text(proposers: tuple[str, ...] | None) -> str | None:
    """check_proposers' result as the field's canonical text ("dspark,suffix", "none"; None: absent)."""
    if proposers is None:
        return None
    return ",".join(proposers) if proposers else NO_PROPOSERS


# ---- stop strings -------------------------------------------------------------------------------------------
def check_stop_strings(stops: Sequence[str], param: str = "stop_words") -> tuple[str, ...]:
    """Stop strings of one request: at most MAX_STOP_WORDS, each non-empty valid text of at most MAX_STOP_CHARS
    characters. `param` names the field (OpenAI: "stop"; Triton: "stop_words")."""
    stops = tuple(stops)
    if len(stops) > MAX_STOP_WORDS:
        raise RequestError(f"{param} takes at most {MAX_STOP_WORDS} strings, got {len(stops)}; send the "
                           f"{MAX_STOP_WORDS} that matter (or cut the text on the client)", param)
    for i, s in enumerate(stops):
        if not s:
            raise RequestError(f"{param} contains an empty string (#{i}); remove it", param)
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"{param} #{i} is {len(s)} characters, more than the {MAX_STOP_CHARS} a stop string "
                               "may have; send a shorter one", param)
        check_text(s, f"{param} #{i}", param)
    return stops


def check_stop_words_ids(arr: np.ndarray | None) -> None:
    """The `dspark` model's stop_words_ids tensor: tensorrtllm_backend's [2, N] layout (row 0 the concatenated ids,
    row 1 the cumulative end offsets, then -1), with a leading batch dimension of 1 allowed; RequestError otherwise.
    What it holds is checked by check_stop_sequences once unpacked (serve.text.unpack_stop_words)."""
    if arr is None:
        return
    a = np.asarray(arr)
    shape = tuple(a.shape)
    if not (a.ndim == 2 and shape[0] == 2 or a.ndim == 3 and shape[:2] == (1, 2)):
        raise RequestError(f"stop_words_ids must be [2, N] or [1, 2, N] (tensorrtllm_backend's layout: ids, then end "
                           f"offsets), got shape {shape}", "stop_words_ids")
    ends = [int(e) for e in a.reshape(2, -1)[1] if e >= 0]
    n = a.shape[-1]
    if any(b < e for e, b in zip(ends, ends[1:])) or any(e > n for e in ends):
        raise RequestError(f"stop_words_ids row 1 must hold non-decreasing end offsets ≤ {n} (then -1), got "
                           f"{ends[:8]}", "stop_words_ids")


def check_stop_sequences(seqs: Sequence[Sequence[int]], cfg: ServeConfig,
                         param: str = "stop_words_ids") -> tuple[tuple[int, ...], ...]:
    """Stop sequences as token ids: at most MAX_STOP_WORDS of at most MAX_STOP_TOKENS ids, each id in the
    vocabulary when the build's is known."""
    out = tuple(tuple(int(t) for t in s) for s in seqs)
    if len(out) > MAX_STOP_WORDS:
        raise RequestError(f"{param} holds {len(out)} stop sequences, more than the {MAX_STOP_WORDS} a request may "
                           "have; send fewer stop words", param)
    for i, s in enumerate(out):
        if len(s) > MAX_STOP_TOKENS:
            raise RequestError(f"{param} sequence #{i} is {len(s)} ids, more than the {MAX_STOP_TOKENS} a stop "
                               "sequence may have; send a shorter stop word", param)
        if cfg.vocab_size is not None:
            try:
                check_token_ids(s, cfg.vocab_size, f"{param} sequence #{i}")
            except InvalidArgumentError as exc:
                raise RequestError(str(exc), param) from exc
    return out


# ---- the prompt ---------------------------------------------------------------------------------------------
def check_prompt_tokens(ids: Sequence[int], limit: int, vocab_size: int | None = None, what: str = "input_ids",
                        param: str | None = None) -> None:
    """A prompt's ids: at least one, at most `limit` (the build's max_prompt_tokens), each in the vocabulary when
    vocab_size is given. `what` names the prompt in the message, `param` the field in the error."""
    param = what if param is None else param
    if len(ids) == 0:
        raise RequestError(f"{what} is empty (no tokens); send a non-empty prompt", param)
    if len(ids) > limit:
        raise RequestError(f"{what} is {len(ids)} tokens, more than the {limit} this build accepts (MAX_SEQ_LEN − γ − "
                           "2); shorten the prompt or rebuild with a larger --max-seq-len", param,
                           CONTEXT_LENGTH_EXCEEDED)
    if vocab_size is not None:
        try:
            check_token_ids(ids, vocab_size, what)
        except InvalidArgumentError as exc:
            raise RequestError(str(exc), param) from exc


def check_prompt(ids: Sequence[int], cfg: ServeConfig, what: str = "input_ids", param: str | None = None) -> None:
    """check_prompt_tokens against the build's limits (cfg.max_prompt_tokens, cfg.vocab_size)."""
    check_prompt_tokens(ids, cfg.max_prompt_tokens, cfg.vocab_size, what, param)


def prompt_ids(arr: np.ndarray | None, cfg: ServeConfig) -> tuple[int, ...]:
    """The `dspark` model's input_ids tensor ([1, T] or [T]) → one checked prompt."""
    if arr is None:
        raise RequestError("input_ids is required", "input_ids")
    a = np.asarray(arr)
    if a.ndim == 2 and a.shape[0] != 1:
        raise RequestError(f"one prompt per request, got a batch of {a.shape[0]}; send concurrent requests instead "
                           "(they are batched in flight)", "input_ids")
    ids = tuple(int(t) for t in a.reshape(-1))
    check_prompt(ids, cfg)
    return ids


# ---- generation parameters ----------------------------------------------------------------------------------
def check_generation(prompt_len: int, cfg: ServeConfig, *, max_tokens: int | None, temperature: float | None = None,
                     top_p: float | None = None, seed: int | None = None, end_id: int | None = None,
                     policy: str | None = None, min_k: int | None = None, max_k: int | None = None,
                     stream: bool = False, return_stats: bool = False,
                     stop_sequences: tuple[tuple[int, ...], ...] = (),
                     proposers: str | Sequence[str] | None = None,
                     names: Mapping[str, str] | None = None) -> GenerationParams:
    """One request's generation parameters against the build: max_tokens (required, ≥ 1, prompt + max_tokens within
    spec_decode.limits.request_room), temperature / top_p / seed (spec_decode.sampling.check_sampling), end_id,
    policy, min_k / max_k, stop_sequences (check_stop_sequences), proposers (check_proposers; "none" makes the policy
    "plain"). None = the build's default (cfg.policy, cfg.min_k, cfg.max_k; greedy; the server's proposers). `names`
    maps the Triton tensor names used here (max_tokens, temperature, top_p, random_seed, end_id, policy, min_k, max_k,
    proposers) to the caller's own (OPENAI_NAMES), in the messages and in RequestError.param."""
    n = _names(names)
    max_tokens = _check_length(prompt_len, max_tokens, cfg, n)
    temperature = 0.0 if temperature is None else float(temperature)
    top_p = 1.0 if top_p is None else float(top_p)
    try:
        check_sampling(temperature, top_p, seed, names={"seed": n["random_seed"], "temperature": n["temperature"],
                                                        "top_p": n["top_p"]})
    except InvalidArgumentError as exc:
        raise RequestError(str(exc), _sampling_param(str(exc), n)) from exc
    if end_id is not None and cfg.vocab_size is not None and not 0 <= end_id < cfg.vocab_size:
        raise RequestError(f"{n['end_id']} must be a token id in [0, {cfg.vocab_size}), got {end_id}", n["end_id"])
    policy = resolve_policy_alias(cfg.policy if policy is None else policy.strip().lower())
    if policy not in POLICIES:
        raise RequestError(f"{n['policy']} must be one of {', '.join(POLICIES)} (\"seed\" = \"confidence\"), got "
                           f"{policy!r}", n["policy"])
    chosen = check_proposers(proposers, n["proposers"])
    if chosen == ():  # "none": no proposer, plain decoding whatever the policy asked
        policy = "plain"
    min_k = cfg.min_k if min_k is None else min_k
    max_k = cfg.max_k if max_k is None else max_k
    if not 0 <= min_k <= max_k <= cfg.gamma:
        raise RequestError(f"need 0 ≤ {n['min_k']} ≤ {n['max_k']} ≤ γ ({cfg.gamma}), got {n['min_k']}={min_k}, "
                           f"{n['max_k']}={max_k}", n["max_k"] if min_k <= max_k else n["min_k"])
    if policy == "confidence" and min_k < 1:
        raise RequestError(f"{n['min_k']} must be ≥ 1 for the confidence policy, got {min_k}; use policy \"plain\" "
                           "for K = 0", n["min_k"])
    stop_sequences = check_stop_sequences(stop_sequences, cfg)
    return GenerationParams(max_tokens=max_tokens, stream=stream, temperature=temperature, top_p=top_p, seed=seed,
                            end_id=end_id, policy=policy, min_k=min_k, max_k=max_k, return_stats=return_stats,
                            stop_sequences=stop_sequences, proposers=chosen)


def _names(names: Mapping[str, str] | None) -> dict[str, str]:
    n = {k: k for k in ("max_tokens", "temperature", "top_p", "random_seed", "end_id", "policy", "min_k", "max_k",
                        "proposers")}
    n.update(names or {})
    return n


def _check_length(prompt_len: int, max_tokens: int | None, cfg: ServeConfig, n: Mapping[str, str]) -> int:
    """max_tokens given and ≥ 1, a prompt, and both within the room (spec_decode.limits.check_room)."""
    if max_tokens is None:
        raise RequestError(f"{n['max_tokens']} is required (INT32, ≥ 1)", n["max_tokens"])
    if max_tokens < 1:
        raise RequestError(f"{n['max_tokens']} must be ≥ 1, got {max_tokens}", n["max_tokens"])
    if prompt_len < 1:
        raise RequestError("the prompt is empty; send a non-empty text_input", "text_input")
    try:
        check_room(prompt_len, max_tokens, cfg.max_seq_len, cfg.gamma,
                   names={"max_new_tokens": n["max_tokens"], "max_seq": "MAX_SEQ_LEN"}, hint=_ROOM_HINT)
    except InvalidArgumentError as exc:
        raise RequestError(str(exc), n["max_tokens"], CONTEXT_LENGTH_EXCEEDED) from exc
    return max_tokens


def _sampling_param(message: str, n: Mapping[str, str]) -> str | None:
    """The field a check_sampling message is about (it starts with the renamed argument)."""
    return next((n[k] for k in ("temperature", "top_p", "random_seed") if message.startswith(n[k])), None)


# ---- Triton tensors -----------------------------------------------------------------------------------------
def single(inputs: Mapping[str, np.ndarray | None], name: str) -> object | None:
    """The one element of an optional input ([1] or [1, 1]); None if absent; RequestError if several."""
    arr = inputs.get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name} must hold exactly one value per request, got shape {tuple(np.shape(arr))}; "
                           "send one prompt per request (concurrent requests are batched in flight)", name)
    return flat[0]


def _int(inputs: Mapping[str, np.ndarray | None], name: str) -> int | None:
    v = single(inputs, name)
    if v is None:
        return None
    if isinstance(v, (float, np.floating)) and not float(v).is_integer():
        raise RequestError(f"{name} must be an integer, got {v}", name)
    return int(v)


def _float(inputs: Mapping[str, np.ndarray | None], name: str) -> float | None:
    v = single(inputs, name)
    if v is None:
        return None
    out = float(v)
    if not math.isfinite(out):
        raise RequestError(f"{name} must be a finite number, got {out}", name)
    return out


def _flag(inputs: Mapping[str, np.ndarray | None], name: str) -> bool:
    v = single(inputs, name)
    return bool(v) if v is not None else False


def parse_generation(inputs: Mapping[str, np.ndarray | None], prompt_len: int, cfg: ServeConfig,
                     stop_sequences: tuple[tuple[int, ...], ...] = ()) -> GenerationParams:
    """The `dspark` model's generation tensors for one request → check_generation."""
    max_tokens = _check_length(prompt_len, _int(inputs, "max_tokens"), cfg, _names(None))  # before the rest is read
    temperature, top_p, seed = _float(inputs, "temperature"), _float(inputs, "top_p"), _int(inputs, "random_seed")
    end_id = _int(inputs, "end_id")
    raw_policy = single(inputs, "policy")
    policy = None if raw_policy is None else decode_text(raw_policy, "policy")
    raw_proposers = single(inputs, "proposers")
    proposers = None if raw_proposers is None else decode_text(raw_proposers, "proposers")
    return check_generation(prompt_len, cfg, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            end_id=end_id, policy=policy, min_k=_int(inputs, "min_k"), max_k=_int(inputs, "max_k"),
                            stream=_flag(inputs, "stream"), return_stats=_flag(inputs, "return_stats"),
                            stop_sequences=stop_sequences, proposers=proposers)
