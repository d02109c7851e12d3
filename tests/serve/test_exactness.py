"""Exact under load through the real tritonserver: twelve concurrent gRPC streams (greedy under every K policy,
and seeded sampling with fixed K) each get exactly the answer their prompt gets as a single stream on the same
server — an answer must not depend on which other requests share its rounds (batch-invariant numerics)."""
from __future__ import annotations

import threading

import pytest

from dspark_trt.serve.clients.client import generate_remote

pytestmark = pytest.mark.triton

PROMPTS = ["def main(argv):", "import os\nimport sys", "class Queue:\n    def __init__(self", "for i in range(10):",
           "with open(path) as f:", "raise ValueError(", "return self._", "# Copyright 2001",
           "if __name__ == '__main__':", "x = [i * i for i in", "while True:", "from collections import"]
POLICIES = ("fixed", "confidence", "survival", "plain")


def _jobs() -> list[tuple[str, dict]]:
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        kw: dict = dict(max_tokens=24 + 7 * (i % 5), protocol="grpc", stream=True, policy=POLICIES[i % 4])
        if i in (3, 7):  # seeded sampling: reproducible for a fixed K
            kw.update(policy="fixed", max_k=3, temperature=0.8, top_p=0.95, seed=100 + i)
        jobs.append((prompt, kw))
    return jobs


def test_concurrent_streams_equal_single_stream(server) -> None:
    jobs = _jobs()
    alone = [generate_remote(server.grpc_url, p, **kw)["token_ids"] for p, kw in jobs]  # one at a time
    results: dict[int, list[int]] = {}
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(len(jobs))

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = generate_remote(server.grpc_url, jobs[i][0], **jobs[i][1])["token_ids"]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wrong = {i: (jobs[i][1]["policy"], next((j for j, (a, b) in enumerate(zip(results[i], alone[i])) if a != b),
                                            min(len(results[i]), len(alone[i]))))
             for i in range(len(jobs)) if results[i] != alone[i]}
    assert not wrong, f"answers differ from the single-stream ones (client: (policy, first differing token)): {wrong}"
