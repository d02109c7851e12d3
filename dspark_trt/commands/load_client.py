"""The client side of `dspark-trt load` (and its --faults run): the built-in prompts, one request's record
(Sample), a gRPC stream to `ensemble_stream` that sends requests one after another (StreamClient), the jobs
(prompt, max tokens) and each job's single-stream reference answer. The commands and their reports live in
commands.load and commands.load_faults; this module imports neither."""
from __future__ import annotations

import json
import queue
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark_trt.errors import InvalidArgumentError, ServeError

MODEL = "ensemble_stream"
PROMPTS = ("def main(argv):", "import os\nimport sys\n", "class Queue:\n    def __init__(self", "# Copyright",
           "for i in range(10):", "return self._", "with open(path) as f:", "if __name__ == '__main__':",
           "The capital of France is", "Write a haiku about the sea.", "Once upon a time,", "SELECT name FROM",
           "def __repr__(self):", "raise ValueError(", "x = [i * i for i in", "from collections import")


@dataclass
class Sample:
    """One request: what came back and when (monotonic seconds)."""

    prompt: int
    ids: list[int] = field(default_factory=list)
    t_send: float = 0.0
    t_first: float | None = None
    t_done: float = 0.0
    gaps: list[float] = field(default_factory=list)  # per token after the first response: gap / tokens in response
    error: str | None = None


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(PROMPTS)
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    out = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    if not out:
        raise InvalidArgumentError(f"--prompts {path} holds no prompt")
    return out


class StreamClient:
    """One gRPC stream to `ensemble_stream`, requests sent one after another on it."""

    def __init__(self, url: str, timeout: float) -> None:
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        self.grpc, self.timeout = grpcclient, timeout
        self.client = grpcclient.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error, time.monotonic())))

    def close(self) -> None:
        """Close the stream, cancelling what is still in flight on it (after a timeout or on a broken server a plain
        stop_stream() waits for the server to end the stream, which may be never)."""
        try:
            self.client.stop_stream(cancel_requests=True)
        finally:
            self.client.close()

    def run(self, sample: Sample, prompt: str, max_tokens: int, policy: str | None) -> Sample:
        from dspark_trt.serve.clients.client import GenerationRequest  # noqa: PLC0415

        req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, stream=True, policy=policy, return_stats=False)
        return self.send(sample, req)

    def send(self, sample: Any, req: Any, stats: bool = False) -> Any:
        """Stream one GenerationRequest on this stream into `sample` (ids, times, error; with `stats`, the final
        stats JSON into sample.stats) → sample, t_done set."""
        from dspark_trt.serve.clients.client import infer_inputs  # noqa: PLC0415

        outputs = [self.grpc.InferRequestedOutput("output_ids")]
        if stats:
            outputs.append(self.grpc.InferRequestedOutput("stats"))
        sample.t_send = last = time.monotonic()
        try:
            self.client.async_stream_infer(MODEL, infer_inputs(self.grpc, req.fields()), outputs=outputs,
                                           request_id=uuid.uuid4().hex, enable_empty_final_response=True)
            while True:
                try:
                    result, error, t = self.q.get(timeout=self.timeout)
                except queue.Empty:
                    sample.error = f"no response within {self.timeout:.0f} s"
                    break
                if error is not None:
                    sample.error = error.message() if hasattr(error, "message") else str(error)
                    break
                ids = result.as_numpy("output_ids")
                new = [] if ids is None else [int(x) for x in ids.reshape(-1)]
                if new:
                    if sample.t_first is None:
                        sample.t_first = t
                    else:
                        sample.gaps.extend([(t - last) / len(new)] * len(new))
                    last = t
                    sample.ids.extend(new)
                blob = result.as_numpy("stats") if stats else None
                if blob is not None and blob.size and blob.reshape(-1)[0]:
                    sample.stats = json.loads(blob.reshape(-1)[0].decode("utf-8"))
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
        except Exception as exc:  # noqa: BLE001 - counted as an error of this request
            sample.error = f"{type(exc).__name__}: {exc}"
        sample.t_done = time.monotonic()
        return sample


def make_jobs(prompts: list[str], max_tokens: int) -> list[tuple[str, int]]:
    return [(p, max(1, max_tokens - 8 * (i % 3))) for i, p in enumerate(prompts)]


def reference_answers(url: str, jobs: list[tuple[str, int]], policy: str | None, timeout: float) -> list[list[int]]:
    """Each job's answer, streamed alone (one request at a time) through the same server."""
    client = StreamClient(url, timeout)
    try:
        out = []
        for i, (prompt, n) in enumerate(jobs):
            s = client.run(Sample(i), prompt, n, policy)
            if s.error:
                raise ServeError(f"the single-stream answer of prompt {i} failed: {s.error}")
            out.append(s.ids)
        return out
    finally:
        client.close()
