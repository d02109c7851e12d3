"""The DSpark GPU-host repository end to end in the real tritonserver: `dspark-trt build --serving both` of the tiny
target + a DSpark drafter writes model_repo/ and model_repo_trtllm/ (the tapped target as the executor-bindings
python model, no draft engine, the DSpark `dspark` model) and the LLM-API files; the testing stand-in (the tensorrtllm interface answered by the
reference runtime, with context logits, the tap outputs and TensorRT-LLM's KV-block-reuse contract) replaces
`target` in a COPY, and 8 concurrent streams through ensemble_stream get exactly the reference repository's tokens
and text, greedy and seeded sampling. No TensorRT-LLM engine runs here (docs/gpu.md)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

from dspark_trt.serve.clients.client import generate_remote
from dspark_trt.serve.server import TritonServer
from dspark_trt.testing.trtllm_standin import install_standin

from .conftest import GAMMA, MAX_BATCH, MAX_SEQ_LEN, read_metrics

pytestmark = [pytest.mark.triton, pytest.mark.slow]

PROMPTS = ["def main(argv):", "import os\nimport sys", "class Queue:", "for i in range(10):", "with open(path) as f:",
           "raise ValueError(", "return self._", "# Copyright 2001"]


@pytest.fixture(scope="module")
def dspark_build(tiny_pair, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001
    """--serving both of the tiny target + a 1-layer DSpark drafter (taps 0, 1; γ 4)."""
    from transformers import AutoModelForCausalLM

    from dspark_trt.runtime.drafters import DSparkModel, save_dspark
    from dspark_trt.train.model_init import new_config

    torch.manual_seed(0)
    emb = AutoModelForCausalLM.from_pretrained(tiny_pair.target, dtype=torch.float32).get_input_embeddings().weight
    cfg = new_config(tiny_pair.target, (0, 1), num_layers=1, gamma=GAMMA, markov_rank=8, draft_vocab_size=0,
                     embed_weight=emb)
    m = DSparkModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    drafter = save_dspark(m, tmp_path_factory.mktemp("dspark") / "drafter", dtype=torch.float32)
    out = tmp_path_factory.mktemp("dspark_build") / "tiny"
    cmd = [sys.executable, "-m", "dspark_trt.cli", "build", "--target", str(tiny_pair.target), "--draft", str(drafter),
           "--output", str(out), "--dtype", "float32", "--max-draft-len", str(GAMMA), "--max-batch-size",
           str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN), "--policy", "fixed", "--min-k", "1", "--max-queue",
           "64", "--no-bench", "--no-engines", "--serving", "both"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"build failed:\n{proc.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def servers(dspark_build: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, TritonServer]]:
    repo = tmp_path_factory.mktemp("standin") / "model_repo_trtllm"
    shutil.copytree(dspark_build / "model_repo_trtllm", repo)
    assert install_standin(repo, reuse_block=8) == ["target"]
    with TritonServer(repo) as gpu_host, TritonServer(dspark_build / "model_repo") as reference:
        yield gpu_host, reference


def test_build_writes_both_repositories_and_the_llmapi_files(dspark_build: Path) -> None:
    repo = dspark_build / "model_repo_trtllm"
    assert sorted(p.name for p in repo.iterdir()) == ["dspark", "dspark_sync", "ensemble", "ensemble_stream",
                                                      "preprocessing", "target"]
    text = (repo / "target" / "config.pbtxt").read_text()
    assert 'backend: "python"' in text and 'name: "dspark_tap_0"' in text and 'name: "dspark_tap_1"' in text
    assert 'key: "dspark_tap_names" value: { string_value: "dspark_tap_0,dspark_tap_1" }' in text
    # the executor-bindings model (the stock tensorrtllm backend drops additional outputs; docs/gpu.md)
    assert "ExecutorTargetModel" in (repo / "target" / "1" / "model.py").read_text()
    assert (dspark_build / "model_repo" / "dspark").is_dir()
    manifest = json.loads((dspark_build / "manifest.json").read_text())
    eng = manifest["stages"]["engines"]["outputs"]
    assert eng["built"] is False and eng["tap_outputs"] == ["dspark_tap_0", "dspark_tap_1"]
    assert "--tap_layers 0,1" in (dspark_build / "engines" / "build_engines.sh").read_text()
    spec = json.loads((dspark_build / "engines" / "llmapi" / "dspark_decoding_config.json").read_text())
    assert spec["target_layer_ids"] == [0, 1] and spec["max_draft_len"] == GAMMA
    assert (dspark_build / "engines" / "NOT_BUILT.txt").is_file()  # nothing pretends an engine ran


def _burst(url: str, jobs: list[tuple[str, int, dict]]) -> dict[int, dict]:
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(len(jobs))

    def client(i: int) -> None:
        prompt, n, kw = jobs[i]
        barrier.wait()
        try:
            results[i] = generate_remote(url, prompt, max_tokens=n, protocol="grpc", stream=True, **kw)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_eight_streams_equal_the_reference_repository(servers: tuple[TritonServer, TritonServer]) -> None:
    gpu_host, reference = servers
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
    jobs = [(PROMPTS[i], 24 + 4 * i, {"policy": "fixed", **(sampled if i % 2 else {})}) for i in range(8)]
    before = read_metrics(gpu_host.metrics_url)
    got = _burst(gpu_host.grpc_url, jobs)
    want = _burst(reference.grpc_url, jobs)
    after = read_metrics(gpu_host.metrics_url)
    for i in range(8):
        assert got[i]["token_ids"] == want[i]["token_ids"], i
        assert got[i]["text"] == want[i]["text"]
    key = 'nv_inference_count{model="target",version="1"}'
    assert after.get(key, 0.0) - before.get(key, 0.0) > 8  # every round went through the tapped target model
    assert after["dspark_active_requests"] == 0
