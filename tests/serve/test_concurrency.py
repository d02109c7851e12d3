"""16 concurrent clients with different prompts and lengths: each gets its own correct output (nothing mixed or
lost), and rounds were batched (per-request stats and the server's round-batch-size metric)."""
from __future__ import annotations

import threading

import pytest

from dspark_trt.serve.clients.client import generate_remote

pytestmark = pytest.mark.triton

PROMPTS = ["def main(argv):", "import os\nimport sys", "class Queue:", "for i in range(10):", "with open(path) as f:",
           "raise ValueError(", "return self._", "# Copyright 2001", "if __name__ == '__main__':", "try:\n    import",
           "def __repr__(self):", "x = [i * i for i in", "while True:", "lambda x:", "print(", "from collections"]
POLICIES = ("confidence", "fixed", "survival", "plain")


def test_sixteen_concurrent_clients(server, reference, metrics) -> None:
    before = metrics()
    jobs = [(PROMPTS[i], 12 + 5 * (i % 7), POLICIES[i % 4], ("grpc", "http")[i % 2], i % 3 != 0) for i in range(16)]
    wants = [reference(p, n) for p, n, *_ in jobs]  # computed before the burst
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    barrier = threading.Barrier(16)

    def client(i: int) -> None:
        prompt, n, policy, protocol, stream = jobs[i]
        url = server.grpc_url if protocol == "grpc" else server.http_url
        barrier.wait()
        try:
            results[i] = generate_remote(url, prompt, max_tokens=n, protocol=protocol, stream=stream, policy=policy)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == list(range(16))
    for i, out in results.items():
        assert out["token_ids"] == wants[i], f"client {i} ({jobs[i][:4]}) got someone else's or wrong tokens"
        assert out["text"] == reference.text(wants[i])
    max_batches = [out["stats"]["batch"]["max"] for out in results.values()]
    assert max(max_batches) >= 4, f"rounds were not batched: per-request max batch {max_batches}"
    after = metrics()
    rounds = after["dspark_round_batch_size_count"] - before.get("dspark_round_batch_size_count", 0.0)
    served = after["dspark_round_batch_size_sum"] - before.get("dspark_round_batch_size_sum", 0.0)
    assert rounds > 0 and served / rounds > 1.5, f"mean round batch {served / max(rounds, 1):.2f}"
    assert after["dspark_active_requests"] == 0
