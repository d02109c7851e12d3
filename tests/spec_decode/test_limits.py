"""One room formula and one K ceiling: the round loops, the served frontends and the build agree on how much one
request may hold and verify."""
from __future__ import annotations

import numpy as np
import pytest

from dspark_trt.builder.options import BuildOptions
from dspark_trt.errors import InvalidArgumentError, RequestError
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.validate import parse_generation
from dspark_trt.spec_decode.limits import request_room
from dspark_trt.spec_decode.loop import Request
from dspark_trt.spec_decode.scheduler import PolicyConfig, PolicyState, verify_cap


def test_request_room_is_what_the_loop_and_the_served_validator_accept() -> None:
    max_seq, gamma = 64, 7
    room = request_room(max_seq, gamma)
    assert room == 56
    Request(tuple(range(1, 11)), room - 10).check_fits(100, max_seq, gamma)  # exactly full: accepted
    with pytest.raises(InvalidArgumentError, match="exceeds the 56 tokens"):
        Request(tuple(range(1, 11)), room - 9).check_fits(100, max_seq, gamma)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        Request((1, 200), 4).check_fits(100, max_seq, gamma)
    limits = ServeConfig(max_seq_len=max_seq, max_batch=2, gamma=gamma, vocab_size=100, max_k=gamma)

    assert parse_generation({"max_tokens": np.array([[room - 10]], dtype=np.int32)}, 10, limits).max_tokens == room - 10
    with pytest.raises(RequestError, match="exceeds the 56 tokens"):
        parse_generation({"max_tokens": np.array([[room - 9]], dtype=np.int32)}, 10, limits)


def test_build_prompt_budget_uses_the_same_room() -> None:
    opts = BuildOptions(max_seq_len=512, max_draft_len=7)
    assert opts.max_input_len == request_room(512, 7) == 504


@pytest.mark.parametrize("policy,k_state,want", [("plain", 5, 0), ("fixed", 5, 3), ("confidence", 5, 5),
                                                  ("survival", 5, 6)])
def test_verify_cap_is_the_policy_ceiling_bounded_by_gamma_tokens_left_and_room(policy: str, k_state: int,
                                                                               want: int) -> None:
    cfg = PolicyConfig(policy=policy, k=3, min_k=2, max_k=6)
    st = PolicyState.initial(cfg)
    st.k = k_state
    assert verify_cap(cfg, st, 7, 100, 1000, 10) == want
    assert verify_cap(cfg, st, 2, 100, 1000, 10) == min(want, 2)  # γ
    assert verify_cap(cfg, st, 7, 2, 1000, 10) == min(want, 1)  # tokens left − 1
    assert verify_cap(cfg, st, 7, 100, 13, 10) == min(want, 2)  # cache room max_seq − committed − 1
    assert verify_cap(cfg, st, 7, 1, 11, 10) == 0  # never below 0
