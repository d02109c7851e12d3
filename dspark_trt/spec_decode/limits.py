"""The sequence budget of one request: the one room formula the round loops, the served frontends and the
build share, and the two checks written against it (room, prompt ids in the vocabulary), each with the one message
every caller raises. Torch-free (the Triton stubs and the OpenAI frontend import it).

`RoundScheduler.add` asks them through `loop.Request.check_fits` (the loop's own invariant); the served entry points
ask them through dspark_trt.serve.validate, which renames the arguments as each protocol calls them (`names=`, as
`sampling.check_sampling` does) and re-raises the message as a RequestError.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from dspark_trt.errors import InvalidArgumentError

__all__ = ["request_room", "check_room", "check_token_ids"]


def request_room(max_seq: int, gamma: int) -> int:
    """The most prompt + new tokens one request may hold in a cache of max_seq tokens: max_seq − γ − 1 (a γ-block
    verify and the round's own target token must still fit)."""
    return max_seq - gamma - 1


def check_room(prompt_len: int, new_tokens: int, max_seq: int, gamma: int, names: Mapping[str, str] | None = None,
               hint: str = "") -> None:
    """InvalidArgumentError unless prompt_len + new_tokens ≤ request_room(max_seq, gamma). `names` renames
    "max_new_tokens" / "max_seq" in the message (a served request says max_tokens / MAX_SEQ_LEN); `hint` is a further
    fix appended to it."""
    n = {"max_new_tokens": "max_new_tokens", "max_seq": "max_seq", **(names or {})}
    room = request_room(max_seq, gamma)
    if prompt_len + new_tokens > room:
        new, seq = n["max_new_tokens"], n["max_seq"]
        raise InvalidArgumentError(
            f"prompt ({prompt_len} tokens) + {new} ({new_tokens}) exceeds the {room} tokens one request may hold "
            f"({seq} {max_seq} − γ {gamma} − 1); shorten the prompt or lower {new}{hint}")


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "the prompt") -> None:
    """InvalidArgumentError naming the first offending ids unless every id is in [0, vocab_size); `what` names
    the sequence in the message."""
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidArgumentError(f"{what} holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); send "
                                   "ids of the model's tokenizer")
