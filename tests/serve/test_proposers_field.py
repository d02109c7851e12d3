"""The per-request `proposers` field (issue #24): who proposes a request's drafts — "dspark", "suffix",
"dspark,suffix" or "none" — at every served entry point, and the counters per proposer.

Without a server: the one validator (serve.validate.check_proposers through parse_generation / check_generation),
the request's field over the server's default (serve.worker.policy_config) and the labelled counters of
serve.metrics. Through the REAL tritonserver of conftest.py (the tiny build, greedy): each value gives plain greedy
decoding's answer over the ensembles (HTTP and gRPC, streamed and not) and the OpenAI frontend; concurrent
requests with mixed proposers each get their single-stream answer; a bad value is a 400 / INVALID_ARGUMENT naming
the valid values and the server keeps serving; the stats per proposer come back with return_stats and reach the
Prometheus counters."""
from __future__ import annotations

import threading
from typing import Iterator

import numpy as np
import pytest
import requests

from dspark_trt.errors import RequestError
from dspark_trt.serve.clients.client import generate_remote
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.metrics import PROPOSER_COUNTERS, ServeMetrics, labelled
from dspark_trt.serve.validate import (OPENAI_NAMES, PROPOSER_VALUES, check_generation, check_proposers,
                                       parse_generation, proposers_text)
from dspark_trt.serve.worker import policy_config

from .conftest import read_metrics

LIMITS = ServeConfig(max_seq_len=64, max_batch=4, gamma=4, vocab_size=512, policy="confidence", min_k=1, max_k=4,
                     max_queue=8)
REPEATS = "a b c d e a b c d e a b c d e a b c d e a b"  # repeats: the suffix match proposes from the first round
CODE = "def main(argv):"
MODEL = "tiny"  # the OpenAI frontend's model name (the build directory's)


def _inp(**kw: object) -> dict[str, np.ndarray]:
    return {k: np.array([[v]], dtype=object if isinstance(v, (str, bytes)) else None) for k, v in kw.items()}


# ---- the validator, the worker's choice, the counters (no server) -------------------------------------------
@pytest.mark.parametrize("value,want", [
    (None, None), ("dspark", ("dspark",)), ("suffix", ("suffix",)), ("suffix,dspark", ("dspark", "suffix")),
    (" Dspark , SUFFIX ", ("dspark", "suffix")), ("none", ()), (["suffix", "dspark"], ("dspark", "suffix")),
    (["none"], ()),
])
def test_check_proposers_accepts(value: object, want: tuple[str, ...] | None) -> None:
    assert check_proposers(value) == want  # type: ignore[arg-type]
    if want is not None:
        assert proposers_text(want) in PROPOSER_VALUES and check_proposers(proposers_text(want)) == want


@pytest.mark.parametrize("value", ["ngram", "", ",", "none,suffix", "dspark;suffix", [], ["dspark", "x"], "x" * 5000])
def test_check_proposers_rejects_naming_the_valid_values(value: object) -> None:
    with pytest.raises(RequestError) as info:
        check_proposers(value)  # type: ignore[arg-type]
    err = info.value
    assert err.param == "proposers" and all(repr(v) in str(err) for v in PROPOSER_VALUES)
    assert len(str(err)) < 400  # a huge value is cut in the message


def test_parse_generation_reads_the_field() -> None:
    p = parse_generation(_inp(max_tokens=8, proposers=b"suffix"), 5, LIMITS)
    assert (p.proposers, p.policy) == (("suffix",), "confidence")
    p = parse_generation(_inp(max_tokens=8, proposers=b"none", policy=b"survival"), 5, LIMITS)
    assert (p.proposers, p.policy) == ((), "plain")  # none: plain decoding whatever the policy
    assert parse_generation(_inp(max_tokens=8), 5, LIMITS).proposers is None  # absent: the server's
    with pytest.raises(RequestError, match="proposers must be one of"):
        parse_generation(_inp(max_tokens=8, proposers=b"ngram"), 5, LIMITS)
    with pytest.raises(RequestError, match="UTF-8"):
        parse_generation(_inp(max_tokens=8, proposers=b"\xff"), 5, LIMITS)
    with pytest.raises(RequestError, match="policy must be one of"):  # the policy is still checked
        parse_generation(_inp(max_tokens=8, proposers=b"none", policy=b"bogus"), 5, LIMITS)
    with pytest.raises(RequestError) as info:  # the OpenAI frontend's names
        check_generation(5, LIMITS, max_tokens=8, proposers="bogus", names=OPENAI_NAMES)
    assert info.value.param == "proposers"


def test_request_field_wins_over_the_server_default() -> None:
    own = parse_generation(_inp(max_tokens=8, proposers=b"suffix"), 5, LIMITS)
    absent = parse_generation(_inp(max_tokens=8), 5, LIMITS)
    none = parse_generation(_inp(max_tokens=8, proposers=b"none"), 5, LIMITS)
    assert policy_config(own, ("dspark",)).proposers == ("suffix",)
    assert policy_config(absent, ("dspark",)).proposers == ("dspark",)
    cfg = policy_config(none, ("dspark", "suffix"))
    assert cfg.policy == "plain" and not cfg.uses("dspark") and not cfg.uses("suffix")
    # no field, no server default: both, but the suffix match alone for a sampled request that names its seed
    assert policy_config(absent).proposers == ("dspark", "suffix")
    sampled = parse_generation(_inp(max_tokens=8, temperature=0.7), 5, LIMITS)
    seeded = parse_generation(_inp(max_tokens=8, temperature=0.7, random_seed=3), 5, LIMITS)
    assert policy_config(sampled).proposers == ("dspark", "suffix")
    assert policy_config(seeded).proposers == ("suffix",)
    assert policy_config(seeded, ("dspark",)).proposers == ("dspark",)  # the server's default still wins


def test_metrics_per_proposer_in_memory() -> None:
    m = ServeMetrics(None, gamma=4)
    m.proposer_done("suffix", proposed=7, drafted=4, accepted=3, rounds=2)
    m.proposer_done("ngram", 1, 1, 1, 1)  # unknown: ignored, never a failed round
    c = m.counters
    assert c[labelled("dspark_proposed_tokens_total", "suffix")] == 7
    assert c[labelled("dspark_proposer_drafted_tokens_total", "suffix")] == 4
    assert c[labelled("dspark_proposer_accepted_tokens_total", "suffix")] == 3
    assert c[labelled("dspark_proposer_rounds_total", "suffix")] == 2
    assert all(c[labelled(name, "dspark")] == 0 for name in PROPOSER_COUNTERS)


# ---- through the real tritonserver --------------------------------------------------------------------------
def _per_proposer(metrics: dict[str, float], name: str, proposer: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name + "{") and f'proposer="{proposer}"' in k)


@pytest.mark.triton
@pytest.mark.parametrize("proposers,protocol,stream", [
    ("suffix", "grpc", False), ("dspark,suffix", "http", True), ("none", "grpc", True), ("dspark", "http", False),
])
def test_each_value_equals_plain_greedy(server, reference, proposers: str, protocol: str, stream: bool) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    for prompt, n in ((REPEATS, 24), (CODE, 16)):
        out = generate_remote(url, prompt, max_tokens=n, protocol=protocol, stream=stream, proposers=proposers)
        assert out["token_ids"] == reference(prompt, n), (proposers, prompt)
        st = out["stats"]
        assert st["proposers_allowed"] == ([] if proposers == "none" else proposers.split(","))
        assert set(st["proposers"]) <= set(st["proposers_allowed"])
        if proposers == "none":
            assert st["drafted_tokens"] == 0 and st["draft_calls"] == 0 and st["proposers"] == {}
        if proposers == "suffix":
            assert st["draft_calls"] == 0
        for ps in st["proposers"].values():  # the funnel: offered ≥ verified ≥ accepted
            assert ps["proposed_tokens"] >= ps["drafted_tokens"] >= ps["accepted_tokens"] >= 0
            assert len(ps["acceptance_per_position"]) <= max(1, ps["drafted_tokens"])
    if "suffix" in proposers:  # the repeated prompt: the match proposed and the target kept some of it
        sfx = generate_remote(url, REPEATS, max_tokens=24, protocol=protocol, proposers=proposers)["stats"]
        assert sfx["proposers"]["suffix"]["proposed_tokens"] > 0 and sfx["proposers"]["suffix"]["accepted_tokens"] > 0


@pytest.mark.triton
def test_concurrent_mixed_proposers_equal_their_single_stream_answers(server, reference) -> None:
    prompts = [REPEATS, CODE, "import os\nimport sys", "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", "class Queue:"]
    values = ["suffix", "dspark,suffix", "none", "dspark", None]
    jobs = [(prompts[i % len(prompts)], values[i % len(values)], 14 + 3 * (i % 4), ("grpc", "http")[i % 2])
            for i in range(10)]

    def one(i: int) -> dict:
        prompt, proposers, n, protocol = jobs[i]
        url = server.grpc_url if protocol == "grpc" else server.http_url
        return generate_remote(url, prompt, max_tokens=n, protocol=protocol, stream=i % 3 == 0, proposers=proposers)

    alone = {i: one(i)["token_ids"] for i in range(len(jobs))}
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(len(jobs))

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = one(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, out in results.items():
        prompt, proposers, n, _ = jobs[i]
        assert out["token_ids"] == alone[i] == reference(prompt, n), f"request {i} ({jobs[i]}) differs"
    assert max(out["stats"]["batch"]["max"] for out in results.values()) >= 2, "the requests were not batched"
    assert any("suffix" in out["stats"]["proposers"] for out in results.values())


@pytest.mark.triton
def test_bad_value_is_invalid_argument_and_the_server_keeps_serving(server, reference) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    r = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate",
                      json={"text_input": CODE, "max_tokens": 4, "proposers": "ngram"}, timeout=120)
    assert r.status_code == 400 and "proposers must be one of" in r.json()["error"], (r.status_code, r.text)
    arrays = {"text_input": (np.array([[CODE.encode()]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[4]], dtype=np.int32), "INT32"),
              "proposers": (np.array([[b"dspark,ngram"]], dtype=object), "BYTES")}
    for module, status in ((grpcclient, "StatusCode.INVALID_ARGUMENT"), (httpclient, "400")):
        client = module.InferenceServerClient(server.grpc_url if module is grpcclient else server.http_url)
        tensors = []
        for name, (arr, dt) in arrays.items():
            t = module.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        with pytest.raises(InferenceServerException) as info:
            client.infer("ensemble", tensors)
        client.close()
        assert info.value.status() == status and "'dspark,suffix'" in info.value.message(), info.value
    with pytest.raises(RequestError, match="proposers must be one of"):  # the streamed path, the dspark model's own
        generate_remote(server.grpc_url, CODE, max_tokens=4, protocol="grpc", stream=True, proposers="none,suffix")
    assert generate_remote(server.http_url, CODE, max_tokens=6)["token_ids"] == reference(CODE, 6)


@pytest.mark.triton
def test_counters_per_proposer_reach_prometheus(server) -> None:
    def settled() -> dict[str, float]:
        return read_metrics(server.metrics_url)

    before = settled()
    out = generate_remote(server.grpc_url, REPEATS, max_tokens=24, protocol="grpc", proposers="suffix")
    after = settled()
    st = out["stats"]["proposers"]["suffix"]
    delta = {name: _per_proposer(after, name, "suffix") - _per_proposer(before, name, "suffix")
             for name in PROPOSER_COUNTERS}
    assert delta["dspark_proposed_tokens_total"] == st["proposed_tokens"] > 0
    assert delta["dspark_proposer_drafted_tokens_total"] == st["drafted_tokens"]
    assert delta["dspark_proposer_accepted_tokens_total"] == st["accepted_tokens"]
    assert delta["dspark_proposer_rounds_total"] == st["rounds"]
    assert _per_proposer(after, "dspark_proposed_tokens_total", "dspark") == _per_proposer(
        before, "dspark_proposed_tokens_total", "dspark")  # the drafter never ran for it
    drafted = after["dspark_drafted_tokens_total"] - before.get("dspark_drafted_tokens_total", 0.0)
    assert drafted == st["drafted_tokens"]  # the per-proposer series add up to the totals


@pytest.mark.triton
def test_generate_url_sends_the_field(server, reference, capsys: pytest.CaptureFixture[str]) -> None:
    """`dspark-trt generate --url ... --proposers suffix --json`: the request's field, the stats per proposer."""
    import json

    from dspark_trt.cli import main

    assert main(["generate", "--url", server.grpc_url, "--protocol", "grpc", "--prompt", REPEATS,
                 "--max-new-tokens", "20", "--proposers", "suffix", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == reference(REPEATS, 20)
    st = out["stats"]
    assert st["proposers_allowed"] == ["suffix"] and st["draft_calls"] == 0
    assert st["proposers"]["suffix"]["proposed_tokens"] >= st["proposers"]["suffix"]["drafted_tokens"] > 0


@pytest.fixture(scope="module")
def openai_client(server) -> Iterator:  # noqa: ANN001
    import openai

    from dspark_trt.serve.openai.config import OpenAIConfig
    from dspark_trt.serve.openai.server import OpenAIServer

    with OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0)) as fe:
        yield openai.OpenAI(base_url=fe.url, api_key="x", max_retries=0, timeout=300)


@pytest.mark.triton
def test_openai_extension_field(openai_client, reference) -> None:  # noqa: ANN001
    import openai

    n = 20
    for proposers in ("suffix", ["dspark", "suffix"], "none"):
        out = openai_client.completions.create(model=MODEL, prompt=REPEATS, max_tokens=n, temperature=0,
                                               extra_body={"proposers": proposers, "return_stats": True})
        assert out.choices[0].text == reference.text(reference(REPEATS, n)), proposers
        stats = out.model_extra["dspark_stats"]
        want = [] if proposers == "none" else (proposers.split(",") if isinstance(proposers, str) else proposers)
        assert stats["proposers_allowed"] == want and set(stats["proposers"]) <= set(want)
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt=CODE, max_tokens=4, extra_body={"proposers": "ngram"})
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == "proposers" and "'none'" in err["message"], err
    with pytest.raises(openai.BadRequestError):  # a wrong type is a 400 too (the body's model)
        openai_client.completions.create(model=MODEL, prompt=CODE, max_tokens=4, extra_body={"proposers": 3})
    out = openai_client.completions.create(model=MODEL, prompt=CODE, max_tokens=6, temperature=0)
    assert out.choices[0].text == reference.text(reference(CODE, 6))
