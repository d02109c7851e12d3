"""Fixtures for serving tests on a REAL tritonserver: the tiny pair built once per session with `dspark-trt build`,
one server on its model repository, and in-process reference generation (plain policy) on the same build.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import pytest

from dspark_trt.serve.server import TritonServer

GAMMA = 4
MAX_SEQ_LEN = 256
MAX_BATCH = 16


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """In-process generation here (reference, worker tests) with one intra-op thread: on the 2 shared cores of CI,
    two OpenMP threads made the tiny model ~15× slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_build(tiny_pair, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001
    """`dspark-trt build` of the tiny target + noisy-copy draft (float32, γ 4, 16 slots, 256 tokens)."""
    out = tmp_path_factory.mktemp("serve_build") / "tiny"
    cmd = [sys.executable, "-m", "dspark_trt.cli", "build", "--target", str(tiny_pair.target), "--draft",
           str(tiny_pair.draft), "--output", str(out), "--dtype", "float32", "--max-draft-len", str(GAMMA),
           "--max-batch-size", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN), "--policy", "confidence",
           "--min-k", "1", "--max-queue", "64", "--no-bench", "--no-engines"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"build failed:\n{proc.stderr[-4000:]}"
    assert (out / "model_repo" / "ensemble" / "config.pbtxt").exists()
    return out


@pytest.fixture(scope="session")
def server(tiny_build: Path) -> Iterator[TritonServer]:
    with TritonServer(tiny_build / "model_repo") as srv:
        yield srv


class Reference:
    """In-process greedy generation on the same build with the plain policy (what `generate --build-dir` runs)."""

    def __init__(self, build: Path) -> None:
        from dspark_trt.builder.artifacts import load_built_pair
        from dspark_trt.runtime.backend import SpecBackend

        self.pair = load_built_pair(build)
        self.backend = SpecBackend(self.pair.target, self.pair.drafter, max_batch=1, max_seq=MAX_SEQ_LEN)
        self.eos = tuple(int(e) for e in getattr(self.pair.target.config, "eos_token_ids", ()) or ())
        self.cache: dict[tuple[str, int], list[int]] = {}
        self.lock = threading.Lock()

    def ids(self, prompt: str) -> list[int]:
        from dspark_trt.serve.text import encode_prompt

        return encode_prompt(self.pair.tokenizer, prompt, False, MAX_SEQ_LEN)

    def __call__(self, prompt: str, max_tokens: int) -> list[int]:
        from dspark_trt.spec_decode.loop import LoopConfig, generate
        from dspark_trt.spec_decode.scheduler import PolicyConfig

        key = (prompt, max_tokens)
        with self.lock:
            if key not in self.cache:
                res = generate(self.backend, self.ids(prompt), max_new_tokens=max_tokens,
                               policy=PolicyConfig(policy="plain", min_k=0), eos_ids=self.eos,
                               config=LoopConfig(gamma=GAMMA))
                self.cache[key] = list(res.tokens)
            return self.cache[key]

    def text(self, ids: list[int]) -> str:
        return self.pair.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def reference(tiny_build: Path) -> Reference:
    return Reference(tiny_build)


def read_metrics(url: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value} (and bare names summed over labels)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        bare = key.split("{", 1)[0]
        out[bare] = out.get(bare, 0.0) + v if bare != key else v
    return out


@pytest.fixture
def metrics(server: TritonServer) -> Callable[[], dict[str, float]]:
    return lambda: read_metrics(server.metrics_url)


def stats_of(out: dict) -> dict:
    s = out["stats"]
    return s if isinstance(s, dict) else json.loads(s)
