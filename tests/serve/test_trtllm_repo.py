"""The GPU-host repository end to end in the real tritonserver: `dspark-trt build --serving trtllm` writes
model_repo_trtllm/, the testing stand-in (dspark_trt.testing.trtllm_standin: the tensorrtllm interface answered by
the reference runtime) replaces `target` and `draft` in a COPY of it, and 8 concurrent streams through the
ensemble get exactly the reference repository's greedy output, with the verify requests batched by Triton.
No TensorRT-LLM engine runs here: that part is docs/gpu.md's GPU-host check."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

from dspark_trt.errors import RequestError
from dspark_trt.serve.clients.client import generate_remote
from dspark_trt.serve.server import TritonServer
from dspark_trt.testing.trtllm_standin import install_standin

from .conftest import GAMMA, MAX_BATCH, MAX_SEQ_LEN, read_metrics

pytestmark = [pytest.mark.triton, pytest.mark.slow]

PROMPTS = ["def main(argv):", "import os\nimport sys", "class Queue:", "for i in range(10):", "with open(path) as f:",
           "raise ValueError(", "return self._", "# Copyright 2001"]
# The burst's policies always verify ≥ 1 draft token, so a round's verify requests carry the same inputs and the
# stand-in's Triton dynamic batcher can batch them (a K = 0 row has no draft_input_ids: another batch there; the real
# tensorrtllm backend batches in flight inside TensorRT-LLM's executor whatever Triton hands it). survival and
# plain are checked one by one below.
POLICIES = ("confidence", "fixed")


@pytest.fixture(scope="module")
def trtllm_build(tiny_build: Path, tiny_pair, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001
    """A copy of the session's tiny build, rebuilt with --serving trtllm (every stage but model_repo is unchanged)."""
    out = tmp_path_factory.mktemp("trtllm_build") / "tiny"
    shutil.copytree(tiny_build, out)
    shutil.rmtree(out / "model_repo")
    cmd = [sys.executable, "-m", "dspark_trt.cli", "build", "--target", str(tiny_pair.target), "--draft",
           str(tiny_pair.draft), "--output", str(out), "--dtype", "float32", "--max-draft-len", str(GAMMA),
           "--max-batch-size", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN), "--policy", "confidence",
           "--min-k", "1", "--max-queue", "64", "--no-bench", "--no-engines", "--serving", "trtllm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"build failed:\n{proc.stderr[-4000:]}"
    assert "model repositories: model_repo_trtllm" in proc.stdout
    return out


@pytest.fixture(scope="module")
def standin_server(trtllm_build: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    repo = tmp_path_factory.mktemp("standin") / "model_repo_trtllm"
    shutil.copytree(trtllm_build / "model_repo_trtllm", repo)
    assert install_standin(repo) == ["target", "draft"]
    with TritonServer(repo) as srv:
        yield srv


def _burst(url: str, jobs: list[tuple[str, int, str]]) -> dict[int, dict]:
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(len(jobs))

    def client(i: int) -> None:
        prompt, n, policy = jobs[i]
        barrier.wait()
        try:
            results[i] = generate_remote(url, prompt, max_tokens=n, protocol="grpc", stream=True, policy=policy)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_build_writes_the_gpu_host_repository(trtllm_build: Path) -> None:
    repo = trtllm_build / "model_repo_trtllm"
    assert sorted(p.name for p in repo.iterdir()) == ["draft", "dspark", "dspark_sync", "ensemble", "ensemble_stream",
                                                      "preprocessing", "target"]
    for role in ("target", "draft"):
        text = (repo / role / "config.pbtxt").read_text()
        assert 'backend: "tensorrtllm"' in text and f"{trtllm_build.resolve()}/engines/{role}" in text
    assert not (trtllm_build / "model_repo").exists()  # --serving trtllm writes only the GPU-host repository
    assert (trtllm_build / "engines" / "NOT_BUILT.txt").is_file()  # and nothing pretends an engine ran


def test_eight_streams_equal_the_reference_repository(standin_server: TritonServer, server: TritonServer,
                                                      reference: Callable) -> None:
    jobs = [(PROMPTS[i], 24 + 4 * i, POLICIES[i % 2]) for i in range(8)]
    before = read_metrics(standin_server.metrics_url)
    got = _burst(standin_server.grpc_url, jobs)
    want = _burst(server.grpc_url, jobs)  # the reference repository (model_repo/) on the same build
    after = read_metrics(standin_server.metrics_url)
    for i, (prompt, n, policy) in enumerate(jobs):
        assert got[i]["token_ids"] == want[i]["token_ids"] == reference(prompt, n), (i, policy)
        assert got[i]["text"] == want[i]["text"]
    stats = [got[i]["stats"] for i in range(8)]
    assert max(s["batch"]["max"] for s in stats) >= 4, "rounds were not batched"
    assert sum(s["accepted_tokens"] for s in stats) > 0, "no draft token was accepted through the engines' path"

    def delta(name: str, model: str) -> float:
        key = f'{name}{{model="{model}",version="1"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)

    inferences, executions = delta("nv_inference_count", "target"), delta("nv_inference_exec_count", "target")
    assert inferences > 0 and inferences / executions > 1.5, (inferences, executions)  # the batcher batched BLS calls
    assert delta("nv_inference_count", "draft") > 0
    assert after["dspark_active_requests"] == 0


def test_every_policy_one_by_one_and_bad_input(standin_server: TritonServer, server: TritonServer,
                                                reference: Callable) -> None:
    for i, policy in enumerate(("survival", "plain", "fixed")):
        prompt, protocol = PROMPTS[2 + i], ("http", "grpc")[i % 2]
        url, ref_url = (standin_server.http_url, server.http_url) if protocol == "http" else \
            (standin_server.grpc_url, server.grpc_url)
        got = generate_remote(url, prompt, max_tokens=20, protocol=protocol, policy=policy)
        want = generate_remote(ref_url, prompt, max_tokens=20, protocol=protocol, policy=policy)
        assert got["token_ids"] == want["token_ids"] == reference(prompt, 20), policy
        assert got["text"] == want["text"]
    with pytest.raises(RequestError, match="policy must be one of"):
        generate_remote(standin_server.http_url, PROMPTS[0], max_tokens=8, protocol="http", policy="bogus")
    assert generate_remote(standin_server.grpc_url, PROMPTS[0], max_tokens=8, protocol="grpc")["token_ids"] == \
        reference(PROMPTS[0], 8)
