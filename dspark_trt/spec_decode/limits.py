"""The sequence budget of one request: the one room formula the round loops, the served frontends and the
build share. Torch-free (the Triton stubs and the OpenAI frontend import it)."""
from __future__ import annotations

__all__ = ["request_room"]


def request_room(max_seq: int, gamma: int) -> int:
    """The most prompt + new tokens one request may hold in a cache of max_seq tokens: max_seq − γ − 1 (a γ-block
    verify and the round's own target token must still fit)."""
    return max_seq - gamma - 1
