"""Faults on a REAL tritonserver 2.51, each on its own server from the tiny build (never the session's `server`),
every verify pass slowed (DSPARK_SERVE_FAULTS=slow:MS) so that the streams are mid-answer when the fault lands:

- kill -9 of the `dspark` stub with 4 gRPC streams in flight: what Triton 2.51 does alone (usually the streams hang,
  the model and the server stay READY, a new request fails with "is not healthy", the stub's shm region stays;
  once, in CI, it dropped every stream's socket at once instead, and the test takes either), then what
  serve.supervisor.Supervisor does about it (restart: every client gets its error, the old server leaves nothing,
  the answers are exact again);
- tritonserver stopped (our SIGTERM stop, and SIGKILL) with 4 streams in flight: errors within the bound, no
  process, shm region or run directory left (after SIGKILL the stubs leave by themselves, the regions are removed by
  TritonServer.stop: they carry its prefix);
- kill -9 of the OpenAI frontend (`dspark-trt openai`) mid-stream: the openai client errors, Triton frees the KV
  slot and keeps answering exactly;
- `dspark-trt load --faults` (its bounds, and one fault through the command and the supervisor's own thread).
Measured numbers: docs/serving.md, Faults.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from dspark_trt.errors import ServeError
from dspark_trt.serve.clients.client import generate_remote
from dspark_trt.serve.server import TritonServer, _group_pids, free_port, leftovers, shm_regions, stubs
from dspark_trt.serve.supervisor import Supervisor

from .conftest import read_metrics

pytestmark = pytest.mark.triton

BOUND_S = 30.0  # every client in flight at a fault has its answer or its error within this many seconds
PROMPT = "def main(argv):"
CHECK = ("class Queue:", 24)  # the greedy request after recovery


class Streams:
    """`n` gRPC streams through `ensemble_stream`, one thread each; `first` is set once every one has text."""

    def __init__(self, url: str, n: int = 4, max_tokens: int = 200) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.ended: dict[int, tuple[float, Any]] = {}  # i → (monotonic end, result dict or exception)
        self.first = threading.Event()
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(n)]

    def _one(self, i: int) -> None:
        def on_text(_: str) -> None:
            with self._lock:
                self._seen.add(i)
                if len(self._seen) == self.n:
                    self.first.set()

        try:
            out: Any = generate_remote(self.url, PROMPT, max_tokens=self.max_tokens, protocol="grpc", stream=True,
                                       policy="plain", timeout=2 * BOUND_S, on_text=on_text)
        except Exception as exc:  # noqa: BLE001 - what the client got is the test's subject
            out = exc
        self.ended[i] = (time.monotonic(), out)

    def start(self) -> "Streams":
        for t in self._threads:
            t.start()
        assert self.first.wait(180), "the streams never all got text"
        return self

    def join(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def errors(self) -> list[BaseException]:
        return [out for _, out in self.ended.values() if isinstance(out, BaseException)]


def _ready(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _slow(ms: int) -> dict[str, str]:
    return dict(os.environ, DSPARK_SERVE_FAULTS=f"slow:{ms}")


def _exact(srv: TritonServer, reference) -> None:  # noqa: ANN001
    prompt, n = CHECK
    assert generate_remote(srv.grpc_url, prompt, max_tokens=n, protocol="grpc")["token_ids"] == reference(prompt, n)
    out = generate_remote(srv.grpc_url, prompt, max_tokens=n, protocol="grpc", stream=True)
    assert out["token_ids"] == reference(prompt, n)


def _stop_clean(srv: TritonServer) -> None:
    fp = srv.footprint() if srv.started else None
    srv.stop()
    if fp is not None:
        assert leftovers(fp) == [], "the server left something behind"


def test_stub_kill_mid_stream(tiny_build: Path, reference) -> None:  # noqa: ANN001
    srv = TritonServer(tiny_build / "model_repo", env=_slow(20)).start()
    try:
        sup = Supervisor(srv)  # its thread not started: first Triton alone, then one check() by hand
        old = srv.footprint()
        regions = shm_regions(srv.shm_prefix)
        assert len(regions) == len(stubs(srv.pid)) == 5, "one shm region per stub, all with this server's prefix"
        (stub,) = stubs(srv.pid, "dspark")
        streams = Streams(srv.grpc_url).start()
        t_kill = time.monotonic()
        os.kill(stub.pid, signal.SIGKILL)

        # Triton 2.51 on its own does one of two things. Usually (every local run): no restart, no report, the
        # streams hang, the model stays READY, a new request fails fast. Sometimes (one CI run, 2026-12-06) it
        # goes down with the stub: every stream gets "Stream removed (Socket closed)" at once. Either way nothing
        # restarts the model; the supervisor below must.
        time.sleep(3.0)
        alone = "hung" if not streams.ended else "dropped"
        log_tail = srv.log_tail(20)
        if alone == "hung":
            assert not [s for s in stubs(srv.pid, "dspark") if not s.zombie], "Triton restarted the stub by itself"
            assert _ready(f"http://{srv.http_url}/v2/models/dspark/ready") == 200  # still READY
            assert srv.is_ready()
            t = time.monotonic()
            with pytest.raises(ServeError, match="is not healthy"):
                generate_remote(srv.grpc_url, PROMPT, max_tokens=4, protocol="grpc", timeout=BOUND_S)
            assert time.monotonic() - t < 10
            assert stub.shm in shm_regions(srv.shm_prefix), "the dead stub's region is still there"
        else:
            assert len(streams.ended) == 4 and all(isinstance(e, ServeError) for e in streams.errors()), \
                (streams.ended, log_tail)

        # the supervisor: restart (SIGTERM, SIGKILL after 2 s, cleanup, a new server on the same ports)
        grpc_url = srv.grpc_url
        fault = sup.check()
        if alone == "hung":
            assert fault == "the python stub of model dspark died", (fault, log_tail)
        else:  # the stub's death, or Triton's own exit / crash, whichever the supervisor saw first
            assert fault is not None and re.match(
                r"the python stub of model dspark died|tritonserver exited on its own|tritonserver crashed",
                fault), (fault, log_tail)
        streams.join(BOUND_S)
        assert len(streams.ended) == 4 and len(streams.errors()) == 4, streams.ended
        assert all(isinstance(e, ServeError) for e in streams.errors()), streams.errors()
        assert max(t for t, _ in streams.ended.values()) - t_kill < BOUND_S
        assert srv.started and srv.pid != old.pgid and srv.grpc_url == grpc_url and srv.is_ready()
        assert leftovers(old) == [], "the old server (its stubs, shm regions, run directory) left something"
        assert len(sup.restarts) == 1 and sup.restarts[0].ready_after_s is not None
        _exact(srv, reference)
        assert len(shm_regions(srv.shm_prefix)) == len(stubs(srv.pid)) == 5
        m = read_metrics(srv.metrics_url)
        assert m.get("dspark_active_requests", 0.0) == 0
        print(f"stub kill: Triton alone {alone} the streams; they errored "
              f"{max(t for t, _ in streams.ended.values()) - t_kill:.1f} s after the kill; fault seen: {fault}; "
              f"restart ready in {sup.restarts[0].ready_after_s:.1f} s")
    finally:
        _stop_clean(srv)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_stop_while_streaming(tiny_build: Path, how: str) -> None:
    """240 tokens with 100 ms per round: longer than Triton's 10 s exit timeout, so a stop always cuts them."""
    srv = TritonServer(tiny_build / "model_repo", env=_slow(100)).start()
    fp = srv.footprint()
    regions = shm_regions(srv.shm_prefix)
    assert regions and set(fp.shm) == regions
    try:
        streams = Streams(srv.grpc_url, max_tokens=240).start()
        t0 = time.monotonic()
        if how == "sigterm":
            srv.stop()  # SIGTERM; Triton drains for 10 s, cannot exit with the streams open; SIGKILL at 20 s
            assert time.monotonic() - t0 < srv.stop_timeout + 10
        else:
            os.kill(fp.pgid, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while [p for p in _group_pids(fp.pgid) if p != fp.pgid] and time.monotonic() < deadline:
                time.sleep(0.1)  # the stubs leave by themselves (their parent watch), the server is our zombie
            assert [p for p in _group_pids(fp.pgid) if p != fp.pgid] == [], "stubs outlived their server"
            left_s = time.monotonic() - t0
            assert shm_regions(srv.shm_prefix) == regions, "a killed Triton cannot remove its regions"
            srv.stop()
        streams.join(BOUND_S)
        assert len(streams.ended) == 4, "a client still waits"
        assert all(isinstance(out, ServeError) for _, out in streams.ended.values()), streams.ended
        assert max(t for t, _ in streams.ended.values()) - t0 < BOUND_S
        assert leftovers(fp) == [] and shm_regions(srv.shm_prefix) == set()
        print(f"{how}: streams errored {max(t for t, _ in streams.ended.values()) - t0:.1f} s after the signal"
              + (f"; the stubs were gone after {left_s:.1f} s" if how == "sigkill" else ""))
    finally:
        srv.stop()


def test_frontend_kill_mid_stream(tiny_build: Path, reference) -> None:  # noqa: ANN001
    srv = TritonServer(tiny_build / "model_repo", env=_slow(20)).start()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dspark_trt.cli", "openai", "--triton-url", srv.grpc_url,
                             "--port", str(port)])
    try:
        deadline = time.monotonic() + 300
        while _ready(f"http://127.0.0.1:{port}/v1/models") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the frontend did not come up"
            time.sleep(0.5)
        before = read_metrics(srv.metrics_url).get("dspark_cancelled_total", 0.0)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=BOUND_S)
        it = iter(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stream=True,
                                            extra_body={"policy": "plain"}))
        got = 0
        while got < 2:
            got += bool(next(it).choices[0].text)
        t0 = time.monotonic()
        proc.kill()
        with pytest.raises((openai.APIError, httpx2.HTTPError)):  # the connection dropped mid-body
            for _ in it:
                pass
        assert time.monotonic() - t0 < BOUND_S
        assert proc.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + BOUND_S  # its gRPC stream died with it: Triton cancels, the KV slot is freed
        m = read_metrics(srv.metrics_url)
        while (m.get("dspark_cancelled_total", 0.0) <= before or m.get("dspark_active_requests", -1.0) != 0) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
            m = read_metrics(srv.metrics_url)
        assert m["dspark_cancelled_total"] == before + 1 and m["dspark_active_requests"] == 0
        _exact(srv, reference)
        print(f"frontend kill: client error {time.monotonic() - t0:.1f} s after")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _stop_clean(srv)


def test_load_faults_bounds() -> None:
    for extra in (["--url", "127.0.0.1:1", "--faults"], ["--repo", "/nonexistent", "--faults", "bogus"],
                  ["--repo", "/nonexistent", "--faults", "--fault-bound", "0"]):
        proc = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "load", *extra], capture_output=True,
                              text=True)
        assert proc.returncode == 2 and "InvalidArgumentError" in proc.stderr, (extra, proc.stderr[-500:])


@pytest.mark.slow
def test_load_faults_stub_kill(tiny_build: Path) -> None:
    """The command, with the supervisor's own thread doing the restart."""
    proc = subprocess.run([sys.executable, "-m", "dspark_trt.cli", "load", "--repo", str(tiny_build / "model_repo"),
                           "--faults", "stub-kill", "--clients", "3", "--max-tokens", "24", "--fault-after", "1",
                           "--json"], capture_output=True, text=True, timeout=900)
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (rep, proc.stderr[-3000:])
    (p,) = rep["phases"]
    assert p["fault"] == "stub-kill" and p["in_flight"] == 3 and p["in_flight_errors"] + p["in_flight_answered"] == 3
    assert p["hung"] == 0 and p["wrong"] == 0 and p["exact_after"] and p["leftovers"] == [] and rep["leftovers"] == []
    assert p["first_error_s"] < BOUND_S and p["recovered_s"] is not None and len(p["restarts"]) == 1
    assert p["kv_slots_held"] == 0
