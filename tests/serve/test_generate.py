"""Greedy output through the real server's ensemble (HTTP generate, HTTP generate_stream, gRPC, gRPC streaming)
equals in-process plain generation on the same build, for every K policy; stats and metrics come back."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark_trt.serve.clients.client import generate_remote
from dspark_trt.spec_decode.scheduler import POLICIES

pytestmark = pytest.mark.triton

PROMPTS = ["def main(argv):", "import os\nimport sys", "class Queue:", "for i in range(10):",
           "with open(path) as f:", "raise ValueError(", "return self._", "# Copyright 2001"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("protocol,stream", [("http", False), ("http", True), ("grpc", False), ("grpc", True)])
def test_greedy_equals_in_process(server, reference, policy: str, protocol: str, stream: bool) -> None:
    i = POLICIES.index(policy) * 2 + (protocol == "grpc")
    prompt, n = PROMPTS[i % len(PROMPTS)], 20 + 3 * i
    url = server.http_url if protocol == "http" else server.grpc_url
    pieces: list[str] = []
    out = generate_remote(url, prompt, max_tokens=n, protocol=protocol, stream=stream, policy=policy,
                          on_text=pieces.append)
    want = reference(prompt, n)
    assert out["token_ids"] == want, f"{policy}/{protocol}/stream={stream}: token ids differ"
    assert out["text"] == reference.text(want)
    stats = out["stats"]
    assert stats["committed_tokens"] == len(want)
    assert len(stats["k_per_round"]) == stats["target_calls"] - 1  # every round but the prefill
    if policy == "plain":
        assert stats["drafted_tokens"] == 0 and set(stats["k_per_round"]) <= {0}
    if policy == "fixed":
        assert stats["drafted_tokens"] > 0 and stats["tau"] > 1.0
    if stream and len(want) > 1:
        assert len(pieces) > 1, "streaming sent everything in one response"


def test_stats_and_metrics(server, metrics) -> None:
    out = generate_remote(server.grpc_url, "def main(argv):", max_tokens=24, protocol="grpc", policy="fixed",
                          max_k=3)
    s = out["stats"]
    for key in ("tau", "accepted_tokens", "drafted_tokens", "k_per_round", "acceptance_rate", "batch"):
        assert key in s
    assert max(s["k_per_round"]) <= 3
    m = metrics()
    for name in ("dspark_acceptance_rate", "dspark_tau", "dspark_k_count", "dspark_fallback_total",
                 "dspark_draft_latency_seconds_count", "dspark_verify_latency_seconds_count",
                 "dspark_round_batch_size_count"):
        assert name in m, f"metric {name} missing"
    assert m["dspark_verify_latency_seconds_count"] > 0 and m["dspark_draft_latency_seconds_count"] > 0
    assert 0.0 < m["dspark_acceptance_rate"] <= 1.0 and m["dspark_tau"] >= 1.0


def test_stop_words_and_end_id(server, reference) -> None:
    prompt = "def main(argv):"
    full = reference(prompt, 30)
    stop_text = reference.text(full[5:6])
    stop_ids = reference.pair.tokenizer(stop_text, add_special_tokens=False)["input_ids"]
    want = full
    for end in range(len(stop_ids), len(full) + 1):  # the loop stops right after the first occurrence
        if full[end - len(stop_ids):end] == stop_ids:
            want = full[:end]
            break
    out = generate_remote(server.http_url, prompt, max_tokens=30, stop_words=[stop_text])
    assert out["token_ids"] == want
    if stop_ids == full[5:6]:
        assert len(want) <= 6 and out["stats"]["finish_reason"] == "stop"
    out = generate_remote(server.grpc_url, prompt, max_tokens=30, protocol="grpc", end_id=full[3])
    want = full[: full.index(full[3]) + 1]
    assert out["token_ids"] == want and out["stats"]["finish_reason"] == "eos"


def test_cli_generate_matches_server(server, tiny_build, reference) -> None:
    """`dspark-trt generate --build-dir` (in process, plain) vs `dspark-trt generate --url` (this server)."""
    prompt, n = "class Queue:", 16
    local = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", "--build-dir", str(tiny_build),
                            "--policy", "plain", "--dtype", "float32", "--prompt", prompt, "--max-new-tokens",
                            str(n), "--json"],
                           capture_output=True, text=True)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "generate", "--url", server.grpc_url,
                             "--protocol", "grpc", "--stream", "--prompt", prompt, "--max-new-tokens", str(n),
                             "--json"], capture_output=True, text=True)
    assert remote.returncode == 0, remote.stderr[-3000:]
    a, b = json.loads(local.stdout), json.loads(remote.stdout)
    assert a["token_ids"] == b["token_ids"] == reference(prompt, n)
    assert a["text"] == b["text"]


def test_target_and_draft_models_explicit_batch(server, reference) -> None:
    """The explicit-batch `target` / `draft` models: B right-padded rows in one request."""
    import numpy as np
    import tritonclient.http as httpclient

    prompts = ["def main(argv):", "class Queue:", "for i in range(10):"]
    rows = [reference.ids(p) for p in prompts]
    ids = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)  # [B, T]
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    # the first call loads the build in the `target` stub (and its native kernels: a rebuild can take a minute)
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=600.0)
    inputs = [httpclient.InferInput("input_ids", list(ids.shape), "INT32"),
              httpclient.InferInput("input_lengths", [len(rows)], "INT32")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.array([len(r) for r in rows], dtype=np.int32))
    nxt = client.infer("target", inputs).as_numpy("next_token_ids")
    assert nxt.tolist() == [reference(p, 1)[0] for p in prompts]
    out = client.infer("draft", inputs)
    assert out.as_numpy("anchor_ids").tolist() == nxt.tolist()
    assert out.as_numpy("draft_ids").shape == (len(rows), 4) and out.as_numpy("confidence").shape == (len(rows), 4)


@pytest.mark.parametrize("model", ["target", "draft"])
@pytest.mark.parametrize("ids_shape,lengths,names", [
    ((1, 3), [], "input_lengths"),  # no row (the fuzzer's find: a reshape error answered as INTERNAL)
    ((1, 3), [0], "input_lengths[0] = 0"),
    ((1, 3), [-1], "input_lengths[0] = -1"),  # would have sliced the row from its end
    ((1, 3), [4], "input_lengths[0] = 4"),  # more tokens than the row holds
    ((1, 3), [2, 1], "3 ids for 2 rows"),
])
def test_target_and_draft_bad_batch_is_invalid_argument(server, reference, model: str, ids_shape, lengths,
                                                        names: str) -> None:
    """Malformed explicit batches are the client's error (gRPC INVALID_ARGUMENT naming the input), and the model
    answers the next good request."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    ids = np.array(reference.ids("def main(argv):")[:3], dtype=np.int32).reshape(ids_shape)

    def inputs(ids: np.ndarray, lens: list[int]) -> list:
        out = [grpcclient.InferInput("input_ids", list(ids.shape), "INT32"),
               grpcclient.InferInput("input_lengths", [len(lens)], "INT32")]
        out[0].set_data_from_numpy(ids)
        out[1].set_data_from_numpy(np.array(lens, dtype=np.int32))
        return out

    with pytest.raises(InferenceServerException) as err:
        client.infer(model, inputs(ids, lengths), client_timeout=600.0)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT", err.value
    assert names in err.value.message()
    good = client.infer(model, inputs(ids, [3]), client_timeout=600.0)
    assert good.as_numpy("next_token_ids" if model == "target" else "anchor_ids").shape == (1,)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_seeded_sampling_plain_equals_in_process(server, reference, protocol: str) -> None:
    """Sampling is keyed on (seed, position), so the served plain-policy sample equals the in-process one.
    (Speculative policies are lossless in distribution; their per-seed reproducibility depends on the drafter's
    RNG, see docs/serving.md.)"""
    from dspark_trt.spec_decode.loop import LoopConfig, generate
    from dspark_trt.spec_decode.protocols import SamplingParams
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    from .conftest import GAMMA

    prompt = "import os\nimport sys"
    want = generate(reference.backend, reference.ids(prompt), max_new_tokens=24,
                    sampling=SamplingParams(0.8, 0.95, 11), policy=PolicyConfig(policy="plain", min_k=0),
                    eos_ids=reference.eos, config=LoopConfig(gamma=GAMMA)).tokens
    url = server.http_url if protocol == "http" else server.grpc_url
    out = generate_remote(url, prompt, max_tokens=24, protocol=protocol, policy="plain", temperature=0.8, top_p=0.95,
                          seed=11)
    assert out["token_ids"] == want


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_seeded_sampled_request_gets_the_suffix_match_and_plain_samplings_tokens(server, reference,
                                                                                protocol: str) -> None:
    """A sampled request with a seed that names no proposers gets the suffix match alone, whose rounds are verified
    coupled to the target's sampler: the served answer equals in-process plain sampling with that seed, token for
    token, while the match's proposals were verified and some kept."""
    from dspark_trt.spec_decode.loop import LoopConfig, generate
    from dspark_trt.spec_decode.protocols import SamplingParams
    from dspark_trt.spec_decode.scheduler import PolicyConfig

    from .conftest import GAMMA

    prompt, n = "a b c d e a b c d e a b c d e a b c d e a b", 32
    want = generate(reference.backend, reference.ids(prompt), max_new_tokens=n,
                    sampling=SamplingParams(0.1, 1.0, 21), policy=PolicyConfig(policy="plain", min_k=0),
                    eos_ids=reference.eos, config=LoopConfig(gamma=GAMMA)).tokens
    url = server.http_url if protocol == "http" else server.grpc_url
    out = generate_remote(url, prompt, max_tokens=n, protocol=protocol, temperature=0.1, seed=21, policy="fixed",
                          max_k=3)
    assert out["token_ids"] == want
    st = out["stats"]
    assert st["proposers_allowed"] == ["suffix"] and st["draft_calls"] == 0
    assert st["proposers"]["suffix"]["drafted_tokens"] > 0 and st["proposers"]["suffix"]["accepted_tokens"] > 0


def _infer_inputs(module, prompt: str, n: int) -> list:  # noqa: ANN001 - tritonclient.http or .grpc
    import numpy as np

    inputs = []
    for name, arr, dt in (("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
                          ("max_tokens", np.array([[n]], dtype=np.int32), "INT32"),
                          ("return_stats", np.array([[True]]), "BOOL")):
        t = module.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_plain_infer_on_ensemble(server, reference, protocol: str) -> None:
    """The `ensemble` is not decoupled: tritonclient's plain infer (HTTP POST .../infer, gRPC ModelInfer) answers
    with the greedy text (tensorrtllm_backend users call both infer and streaming on one repository)."""
    import json as _json

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    prompt, n = "with open(path) as f:", 21
    out = module.InferenceServerClient(url).infer("ensemble", _infer_inputs(module, prompt, n))
    want = reference(prompt, n)
    assert out.as_numpy("output_ids").reshape(-1).tolist() == want
    assert out.as_numpy("text_output").reshape(-1)[0].decode() == reference.text(want)
    assert _json.loads(out.as_numpy("stats").reshape(-1)[0])["committed_tokens"] == len(want)


def test_stream_true_on_ensemble_names_ensemble_stream(server) -> None:
    import requests

    r = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate_stream",
                      json={"text_input": "def f", "max_tokens": 4, "stream": True}, timeout=120)
    assert "ensemble_stream" in r.text, r.text
    r = requests.post(f"http://{server.http_url}/v2/models/ensemble_stream/generate_stream",
                      json={"text_input": "def f", "max_tokens": 4, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.text.count("data:") >= 2, r.text


def test_seeded_sampling_reproducible_on_long_running_server(server) -> None:
    """Same seed, prompt and fixed K → the same sampled tokens, with other requests (greedy, other seeds, other
    policies, concurrent ones) served in between: every draw is keyed on (seed, position), drafters' included."""
    import threading

    prompt, n = "import os\nimport sys", 40
    kw = dict(max_tokens=n, protocol="grpc", stream=True, policy="fixed", max_k=3, temperature=0.9, top_p=0.95,
              seed=1234, proposers="dspark")  # the drafter's own draws (a seeded request's default is the suffix)
    first = generate_remote(server.grpc_url, prompt, **kw)["token_ids"]
    assert len(first) > 1
    generate_remote(server.http_url, "class Queue:", max_tokens=17, policy="confidence")
    generate_remote(server.grpc_url, prompt, max_tokens=23, protocol="grpc", policy="fixed", temperature=0.9, seed=99)
    again: dict[str, list[int]] = {}
    others = [threading.Thread(target=generate_remote, args=(server.grpc_url, p),
                               kwargs=dict(max_tokens=30, protocol="grpc", stream=True, policy=pol))
              for p, pol in (("def main(argv):", "survival"), ("for i in range(10):", "plain"))]
    for t in others:
        t.start()
    again["concurrent"] = generate_remote(server.grpc_url, prompt, **kw)["token_ids"]
    for t in others:
        t.join()
    again["alone"] = generate_remote(server.grpc_url, prompt, **kw)["token_ids"]
    assert again["alone"] == first
    assert again["concurrent"] == first
