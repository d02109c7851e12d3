"""A second real server, started with `dspark-trt serve` (the user's command), on a copy of the tiny build's
repository with MAX_QUEUE 2, the first draft passes failing and every verify pass 5 ms slower
(DSPARK_SERVE_FAULTS=draft:3,slow:5: a 240-token answer then lasts over a second, so a stop or a cancel always
lands while it runs, however fast the machine): drafter fallback
keeps outputs identical and is counted; overload turns speculation off per round and back on; a stopped or
cancelled request frees its KV slot; SIGTERM leaves no processes, no /dev/shm regions and no run directory."""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from dspark_trt.errors import RequestError
from dspark_trt.serve.clients.client import generate_remote, stop_remote
from dspark_trt.serve.server import SHM_PREFIX, _group_pids, _mapped_shm, footprint, leftovers

from .conftest import read_metrics

pytestmark = pytest.mark.triton

FAILING_DRAFTS = 3
SLOW_MS = 5  # per verify pass


@dataclass
class CliServer:
    """`dspark-trt serve` running in a subprocess (the command users run), with the URLs it printed."""

    proc: subprocess.Popen
    http_url: str
    grpc_url: str
    metrics_url: str

    def server_pid(self) -> int:
        """The tritonserver child (its pid is also its process group: it runs in its own session)."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if "(tritonserver)" in stat and int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    return int(entry.name)
        raise AssertionError("no tritonserver child of `dspark-trt serve`")


@pytest.fixture(scope="module")
def fragile(tiny_build: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    repo = tmp_path_factory.mktemp("fragile") / "model_repo"
    shutil.copytree(tiny_build / "model_repo", repo)
    cfg = repo / "dspark" / "config.pbtxt"
    text = re.sub(r'(key: "MAX_QUEUE" value: \{ string_value: ")\d+', r"\g<1>2", cfg.read_text())
    assert 'key: "MAX_QUEUE" value: { string_value: "2" }' in text
    cfg.write_text(text)
    env = dict(os.environ, DSPARK_SERVE_FAULTS=f"draft:{FAILING_DRAFTS},slow:{SLOW_MS}")
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "serve", "--repo", str(repo), "--http-port", "0",
                             "--grpc-port", "0", "--metrics-port", "0"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until READY (or EOF if the command failed)
    assert line.startswith("READY"), f"`dspark-trt serve` did not become ready (exit {proc.wait()})"
    urls = dict(kv.split("=", 1) for kv in line.split()[1:])
    srv = CliServer(proc, urls["http"], urls["grpc"], urls["metrics"])
    yield srv
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


def test_failing_drafter_falls_back_with_same_output(fragile, reference) -> None:
    prompt, n = "def main(argv):", 30
    out = generate_remote(fragile.grpc_url, prompt, max_tokens=n, protocol="grpc", policy="fixed")
    assert out["token_ids"] == reference(prompt, n)
    assert out["stats"]["draft_failures"] == FAILING_DRAFTS
    assert out["stats"]["drafted_tokens"] > 0  # the drafter came back after the injected failures
    m = read_metrics(fragile.metrics_url)
    assert m["dspark_fallback_total"] == FAILING_DRAFTS


def test_overload_turns_speculation_off_then_on(fragile, reference) -> None:
    prompts = ["class Queue:", "for i in range(10):", "raise ValueError(", "return self._", "while True:", "print("]
    wants = [reference(p, 40) for p in prompts]
    results: dict[int, dict] = {}
    barrier = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        barrier.wait()
        results[i] = generate_remote(fragile.grpc_url, prompts[i], max_tokens=40, protocol="grpc", stream=True,
                                     policy="fixed")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i]["token_ids"] for i in range(len(prompts))] == wants
    assert max(r["stats"]["speculation_off_rounds"] for r in results.values()) > 0
    assert read_metrics(fragile.metrics_url)["dspark_speculation_off_rounds_total"] > 0
    alone = generate_remote(fragile.grpc_url, "def main(argv):", max_tokens=20, protocol="grpc", policy="fixed")
    assert alone["stats"]["speculation_off_rounds"] == 0 and alone["stats"]["drafted_tokens"] > 0


def _wait_metrics(url: str, settled: Callable[[dict[str, float]], bool], seconds: float = 60.0) -> dict[str, float]:
    """Poll the metrics until `settled` holds or the deadline passes (the server updates counters and gauges a
    moment apart); returns the last reading either way, for the test's own assertions."""
    deadline = time.monotonic() + seconds
    m = read_metrics(url)
    while not settled(m) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = read_metrics(url)
    return m


def test_stop_request_frees_kv_slot(fragile) -> None:
    """Through the ensemble: tensorrtllm_backend's `stop` input with the running request's id."""
    before = read_metrics(fragile.metrics_url).get("dspark_cancelled_total", 0.0)
    first = threading.Event()
    res: dict[str, dict] = {}

    def victim() -> None:
        res["out"] = generate_remote(fragile.grpc_url, "def main(argv):", max_tokens=240, protocol="grpc",
                                     stream=True, policy="plain", request_id="victim", on_text=lambda t: first.set())

    t = threading.Thread(target=victim)
    t.start()
    assert first.wait(120)
    stop_remote(fragile.http_url, "victim", protocol="http")
    t.join()
    assert res["out"]["stats"]["finish_reason"] == "stopped" and len(res["out"]["token_ids"]) < 240
    m = _wait_metrics(fragile.metrics_url, lambda m: m.get("dspark_active_requests", -1.0) == 0)
    assert m["dspark_cancelled_total"] == before + 1 and m["dspark_active_requests"] == 0
    with pytest.raises(RequestError, match="no in-flight request"):
        stop_remote(fragile.grpc_url, "victim")


def test_grpc_cancel_on_dspark_model_frees_kv_slot(fragile, reference) -> None:
    """Triton request cancellation (client closes the stream) reaches the decoupled `dspark` model directly."""
    client = grpcclient.InferenceServerClient(fragile.grpc_url)
    q: queue.Queue = queue.Queue()
    inputs = []
    for name, arr, dt in (("input_ids", np.array([reference.ids("def main(argv):")], dtype=np.int32), "INT32"),
                          ("max_tokens", np.array([[240]], dtype=np.int32), "INT32"),
                          ("stream", np.array([[True]]), "BOOL"),
                          ("policy", np.array([[b"plain"]], dtype=object), "BYTES")):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    before = read_metrics(fragile.metrics_url).get("dspark_cancelled_total", 0.0)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("dspark", inputs, request_id="to-cancel")
    result, error = q.get(timeout=120)
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    m = _wait_metrics(fragile.metrics_url, lambda m: m.get("dspark_cancelled_total", 0.0) > before
                      and m.get("dspark_active_requests", -1.0) == 0)
    assert m["dspark_cancelled_total"] == before + 1
    assert m["dspark_active_requests"] == 0
    assert generate_remote(fragile.http_url, "def f", max_tokens=4)["token_ids"]  # the freed slot is usable


def test_sigterm_stops_cleanly(fragile) -> None:
    """SIGTERM to `dspark-trt serve`: exit 0, no tritonserver or stub process, no /dev/shm region, no run directory
    (dspark_triton_* in the temp dir) left."""
    pgid = fragile.server_pid()
    pids = _group_pids(pgid)
    shm = _mapped_shm(pids)
    fp = footprint(pgid)
    assert len(pids) > 1 and shm, "expected the server, its stubs and their shm regions"
    assert fp.run_dir is not None and fp.run_dir.name.startswith("dspark_triton_") and fp.run_dir.is_dir()
    fragile.proc.send_signal(signal.SIGTERM)
    assert fragile.proc.wait() == 0
    assert _group_pids(pgid) == []
    assert not [n for n in shm if (Path("/dev/shm") / n).exists()]
    assert not any(p.name.startswith(SHM_PREFIX) and p.name in shm for p in Path("/dev/shm").iterdir())
    assert leftovers(fp) == [], "the server left something behind"
