"""Keeps a TritonServer serving when a python-backend stub dies or tritonserver exits on its own.

Why it exists — what tritonserver 2.51 does on its own (measured, tests/serve/test_faults.py; docs/serving.md
"Faults"): when a stub process dies (kill -9, the OOM killer), Triton neither restarts it nor reports it. The model
and the server stay READY; the requests in flight on that stub never get another response (their streams hang);
each new request to the model fails after ~1 s with "Stub process '<model>_0_0' is not healthy."; the stub's shm
region stays; and a SIGTERM then never finishes (the server hangs after its exit timeout) until SIGKILL. Nor is the
repository API a way back: a load of the unchanged model is a no-op, and a real reload of the `dspark` model
segfaults tritonserver 2.51 (python-backend custom metrics, triton-inference-server/server#8663).

Owns `Supervisor`: a thread that checks every `interval` s that every model which had a stub when the server became
ready still has a live one, that tritonserver is still running and that its log shows no fatal signal ("Signal (11)
received.": after a real reload of `dspark`, 2.51 segfaulted or aborted on a corrupt heap and then hung in its own
signal handler — alive, its health endpoints answering 200, every inference hanging), and every `probe_every` s that
it still answers /v2/health/live (`probe_failures` probes in a row without an answer count as a fault). On a fault
it either restarts the server (action "restart": TritonServer.restart — SIGTERM, SIGKILL after `grace` s, the shm
regions and run directory of the old one removed, a new one on the same ports) or stops it (action "exit": the
caller, e.g. `dspark-trt serve`, then exits non-zero for its process manager). Either way every client in flight
gets an error as soon as the old server's sockets close — no hang — and nothing of the old server is left.
`Restart` records each one. After `max_restarts`, or when a restart fails, the supervisor stops the server and sets
`failed`. A planned restart goes through `restart(reason)`, which takes the same lock as the checks (never two
restarts at once). Not caught: a server that hangs without a fatal signal while its HTTP endpoints still answer.
"""
from __future__ import annotations

import logging
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dspark_trt.errors import ServeError
from dspark_trt.serve.server import TritonServer, stubs

log = logging.getLogger(__name__)

ACTIONS = ("restart", "exit")
FATAL = re.compile(rb"^Signal \((\d+)\) received", re.M)  # tritonserver's crash handler, first line


@dataclass(frozen=True)
class Restart:
    """One fault the supervisor acted on: what it saw, when (monotonic s), and how long the server took to be ready
    again (None: it was stopped instead, or the restart failed)."""

    fault: str
    t_detected: float
    ready_after_s: float | None


class Supervisor:
    """Watches `server` (already started) from a daemon thread; see the module docstring."""

    def __init__(self, server: TritonServer, action: str = "restart", interval: float = 0.5, grace: float = 2.0,
                 max_restarts: int = 5, on_fault: Callable[[str], None] | None = None, probe_every: float = 2.0,
                 probe_failures: int = 3) -> None:
        if action not in ACTIONS:
            raise ServeError(f"supervisor action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.server, self.action, self.interval, self.grace = server, action, interval, grace
        self.max_restarts, self.on_fault = max_restarts, on_fault
        self.probe_every, self.probe_failures = probe_every, probe_failures
        self._next_probe, self._deaf = 0.0, 0  # when to probe next; probes in a row without an answer
        self.restarts: list[Restart] = []
        self.failed: str | None = None  # why it gave up (the server is stopped then)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one check or restart at a time
        self.busy = False  # a restart (or stop) in progress
        self._models = self._live_models()
        self._log_at = self._log_size()  # where the log of the running server starts (it may append to an old one)

    def _log_size(self) -> int:
        try:
            return Path(self.server.log_path).stat().st_size if self.server.log_path else 0
        except OSError:
            return 0

    def _fatal_in_log(self) -> str | None:
        """The first fatal signal tritonserver logged since the last check (None: none)."""
        if not self.server.log_path:
            return None
        try:
            with open(self.server.log_path, "rb") as f:
                f.seek(self._log_at)
                new = f.read()
        except OSError:
            return None
        cut = new.rfind(b"\n") + 1  # whole lines only
        self._log_at += cut
        m = FATAL.search(new[:cut])
        return None if m is None else m.group(1).decode()

    def _live_models(self) -> set[str]:
        pid = self.server.pid
        return set() if pid is None else {s.model for s in stubs(pid) if not s.zombie}

    def fault(self) -> str | None:
        """What is wrong with the server now (None: nothing, or it was stopped on purpose)."""
        pid = self.server.pid
        if pid is None or not self.server.started:  # stopped, or (re)starting: nothing to judge yet
            return None
        if not self._models:  # made before the server was started
            self._models = self._live_models()
        code = self.server.exit_code()
        dead = self._models - self._live_models() if code is None else set()
        if self.server.pid != pid:  # a stop() began meanwhile: its doing, not a fault
            return None
        if code is not None:
            return f"tritonserver exited on its own (code {code})"
        if dead:
            return f"the python stub of model {', '.join(sorted(dead))} died"
        sig = self._fatal_in_log()
        if sig is not None and self.server.pid == pid:
            return f"tritonserver crashed (its log: Signal ({sig}) received) and is still there"
        if time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + self.probe_every
            self._deaf = 0 if self._live() else self._deaf + 1
            if self._deaf >= self.probe_failures and self.server.pid == pid:
                self._deaf = 0
                return f"tritonserver stopped answering /v2/health/live ({self.probe_failures} probes in a row)"
        return None

    def _live(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.server.http_url}/v2/health/live", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check(self) -> str | None:
        """One check; on a fault, act on it (restart or stop) before returning what it was."""
        with self._lock:
            fault = self.fault()
            if fault is None or self._stopping.is_set():
                return None
            log.error("%s; %s tritonserver (log tail:\n%s)", fault,
                      "restarting" if self.action == "restart" else "stopping", self.server.log_tail(15))
            if self.on_fault is not None:
                self.on_fault(fault)
            self.busy = True
            try:
                return self._act(fault, self.action)
            finally:
                self.busy = False

    def restart(self, reason: str = "planned restart") -> None:
        """Restart the server now (a planned restart, recorded like a fault's), never during another one."""
        with self._lock:
            self.busy = True
            try:
                self._act(reason, "restart", planned=True)
            finally:
                self.busy = False

    def _act(self, fault: str, action: str, planned: bool = False) -> str:
        t = time.monotonic()
        if action == "exit" or (not planned and len(self.restarts) >= self.max_restarts):
            self.failed = fault if action == "exit" else f"{fault}; gave up after {len(self.restarts)} restarts"
            self.restarts.append(Restart(fault, t, None))
            self.server.stop(timeout=self.grace)
            self._stopping.set()
            return fault
        try:
            self.server.restart(grace=None if planned else self.grace)
        except ServeError as exc:
            if self._stopping.is_set():  # closed while it restarted
                return fault
            self.failed = f"{fault}; the restart failed: {exc}"
            self.restarts.append(Restart(fault, t, None))
            self.server.stop(timeout=self.grace)
            self._stopping.set()
            return fault
        self._models = self._live_models()
        self._deaf, self._log_at = 0, self._log_size()
        self.restarts.append(Restart(fault, t, time.monotonic() - t))
        log.info("tritonserver restarted in %.1f s (http %s grpc %s)", time.monotonic() - t, self.server.http_url,
                 self.server.grpc_url)
        return fault

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch goes on; a failing check is logged, not fatal
                log.exception("supervisor check failed")

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._run, name="triton-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 600.0) -> None:
        """Stop watching (after a restart in progress); the server keeps running."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def close(self, timeout: float = 60.0) -> None:
        """Stop watching and close the server for good (a restart in progress is aborted)."""
        self._stopping.set()
        self.server.close()
        self.stop(timeout)

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
