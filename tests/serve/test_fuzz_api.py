"""The property-based fuzzer of scripts/fuzz_api.py, bounded for CI, against the REAL tritonserver of conftest.py
and the OpenAI frontend in front of it: hypothesis-generated OpenAI request bodies (types, ranges, unicode with
lone surrogates and invalid UTF-8 bytes, empty and huge values, nested junk, unparsable JSON) and Triton requests
(gRPC tensors of any dtype / shape / range, empty ones; HTTP generate / infer JSON). Per request: no 5xx for bad
input (apart from the documented 500s of Triton 2.51's own HTTP JSON parser, counted apart), an answer within the
per-request timeout, and after every request a good greedy request whose answer equals in-process generation.
Derandomized (the same inputs every run); ~60 s of fuzzing in all. The long run: scripts/fuzz_api.py --minutes N.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Iterator

import pytest

from dspark_trt.serve.openai.config import OpenAIConfig
from dspark_trt.serve.openai.server import OpenAIServer

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"completions": 200, "chat": 150, "grpc": 80, "http": 150}  # ~10-40 s each on 2 loaded cores


def _load_fuzzer():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("fuzz_api", ROOT / "scripts" / "fuzz_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_api"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fuzz_api = _load_fuzzer()


@pytest.fixture(scope="module")
def frontend(server) -> Iterator[OpenAIServer]:  # noqa: ANN001
    with OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0)) as fe:
        yield fe


@pytest.fixture(scope="module")
def targets(server, frontend, reference):  # noqa: ANN001, ANN201
    good = reference(fuzz_api.GOOD_PROMPT, fuzz_api.GOOD_TOKENS)
    t = fuzz_api.Targets(frontend.url, server.grpc_url, server.http_url, model="tiny", good_text=reference.text(good),
                         good_ids=good)
    fuzz_api.Fuzzer(t, fuzz_api.Tally()).warm_up()  # target / draft load the build on their first request
    return t


@pytest.fixture(autouse=True)
def quiet_unknown_fields() -> Iterator[None]:
    """One warning per fuzzed body with unknown fields would flood the log."""
    logger = logging.getLogger("dspark_trt.serve.openai.protocol")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("surface", list(EXAMPLES))
def test_fuzz_never_5xx_never_hangs_next_good_answer_exact(targets, surface: str) -> None:  # noqa: ANN001
    tally = fuzz_api.Tally()
    fz = fuzz_api.Fuzzer(targets, tally)
    fuzz_api.run_properties(fz, (surface,), EXAMPLES[surface], derandomize=True, good_every=1)
    print(f"\n{surface}:\n{tally.report()}")
    assert not tally.failures, "\n".join(tally.failures[:10])
    total = sum(tally.counts.values())
    assert total >= EXAMPLES[surface] // 2, tally.counts  # the strategies produced requests
    ok = sum(v for (s, outcome), v in tally.counts.items() if str(outcome) in ("200", "ok"))
    rejected = total - ok
    assert ok > 0 and rejected > 0, f"the fuzzer needs both answered and rejected requests: {tally.counts}"


def test_fuzzer_catches_a_5xx(targets) -> None:  # noqa: ANN001
    """The property can fail: a 5xx, a hang or a wrong good answer is recorded as a failure."""
    tally = fuzz_api.Tally()
    fz = fuzz_api.Fuzzer(targets, tally)
    fz._check_openai(500, "application/json", b'{"error": {"message": "boom"}}', b"{}")
    fz._check_openai(200, "text/event-stream", b"data: {}\n\n", b"{}")
    wrong = fuzz_api.Targets(targets.openai_url, targets.grpc_url, targets.http_url, model="tiny",
                             good_text=targets.good_text + "x", good_ids=[*targets.good_ids, 0])
    fz.t = wrong
    fz.check_good_openai()
    fz.check_good_triton()
    assert len(tally.failures) == 4, tally.failures
