"""Lifecycle of a real tritonserver process on a model repository: find the binary, lay out the python
backend directory, build the environment the python-backend stub needs, start, wait for readiness, stop.

Owns: `TritonServer` (context manager), `find_triton()`, `prepare_backend_dir()`, `server_env()`, and the leak
check (`Footprint` of a running server: its processes, shm regions, shm prefix and run directory; `find_server`,
`leftovers` — what is still there after it stopped; `stubs` — its python-backend stub processes, per model;
`shm_regions` — the /dev/shm regions of a prefix).
Knows nothing about DSpark or the models in the repository.

Facts about the python-backend stub this follows: it must be symlinked (a copy loses its $ORIGIN
RUNPATH); the stub embeds Python in isolated mode, ignores PYTHONPATH and finds its prefix by searching PATH
for `python3`, so the venv's bin goes first in PATH; LD_LIBRARY_PATH gets the interpreter's LIBDIR so the stub
loads the same libpython. A crashed stub leaves /dev/shm/triton_python_backend_shm_region_* behind, and so does a
SIGKILLed server: each start passes its own region prefix (`--backend-config=python,shm-region-prefix-name=`,
SHM_PREFIX + a per-start token), so stop() removes exactly this server's regions — the ones it mapped and any
other with its prefix (a stub that died before it was seen) — and never another server's. Each start makes one run
directory (`dspark_triton_*` in the temp dir: the backend symlinks and, unless `log_path` is given, the server log);
stop() removes it unless `keep_logs` is set (then it logs where the log stays).
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from dspark_trt.errors import ServeError

log = logging.getLogger(__name__)

SHM_PREFIX = "triton_python_backend_shm_region_"
PY_TAG = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class TritonInstall:
    """Where the server binary and the python backend pieces live."""

    binary: Path
    python_backend: Path  # directory holding libtriton_python.so and triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub matching this interpreter
    system: bool = False  # an installed server (NVIDIA container): use its own backends directory as is


def _bundled() -> TritonInstall | None:
    try:
        import pytriton  # noqa: PLC0415 - optional at import time
    except ImportError:
        return None
    root = Path(pytriton.__file__).parent / "tritonserver"
    inst = TritonInstall(root / "bin" / "tritonserver", root / "backends" / "python",
                         root / "python_backend_stubs" / PY_TAG / "triton_python_backend_stub")
    return inst if inst.binary.exists() and inst.stub.exists() else None


def _system() -> TritonInstall | None:
    binary = shutil.which("tritonserver")
    if binary is None:
        return None
    backends = Path(os.environ.get("TRITON_BACKENDS_DIR", "/opt/tritonserver/backends")) / "python"
    stub = backends / "triton_python_backend_stub"
    if not (backends / "libtriton_python.so").exists() or not stub.exists():
        return None
    return TritonInstall(Path(binary), backends, stub, system=True)


def find_triton(prefer_system: bool = True) -> TritonInstall:
    """The system `tritonserver` (with its python backend) when present, else the nvidia-pytriton bundle."""
    order = (_system, _bundled) if prefer_system else (_bundled, _system)
    for finder in order:
        inst = finder()
        if inst is not None:
            return inst
    raise ServeError("No tritonserver found: install the pinned wheel (`pip install nvidia-pytriton==0.7.0`, "
                     "see scripts/setup_env.sh) or put NVIDIA's `tritonserver` on PATH")


def prepare_backend_dir(inst: TritonInstall, dest: Path) -> Path:
    """dest/python/ with symlinks (never copies) to the python backend library, utils and the stub."""
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (inst.python_backend / "libtriton_python.so",
                inst.python_backend / "triton_python_backend_utils.py", inst.stub):
        link = py / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src.resolve())
    return dest


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so its python stubs run this interpreter's venv."""
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir])
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [libdir, env.get("LD_LIBRARY_PATH", "")] if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Threads: the light stubs (tokenizers, collectors) need none, so OpenMP starts with 1 everywhere; the `dspark`
    # stub then sets torch's intra-op threads itself (serve.tuning: DSPARK_THREADS, else measured at startup). An
    # OMP_NUM_THREADS the caller set is kept and, without DSPARK_THREADS, fixes the dspark stub's count as before.
    if "OMP_NUM_THREADS" in env and "DSPARK_THREADS" not in env:
        env["DSPARK_THREADS"] = env["OMP_NUM_THREADS"]
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def free_port() -> int:
    """A port that was free a moment ago (bind to 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                pids.append(int(entry.name))
        except (ProcessLookupError, PermissionError):
            continue
    return pids


def _mapped_shm(pids: list[int]) -> set[str]:
    names: set[str] = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            tail = line.rsplit("/dev/shm/", 1)
            if len(tail) == 2 and tail[1].startswith(SHM_PREFIX):
                names.add(tail[1].split(" ")[0])
    return names


RUN_DIR_PREFIX = "dspark_triton_"
SHM_PREFIX_FLAG = "--backend-config=python,shm-region-prefix-name="


def shm_regions(prefix: str = SHM_PREFIX) -> set[str]:
    """Names of the /dev/shm regions starting with `prefix` (default: every python-backend region)."""
    try:
        return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)}
    except OSError:
        return set()


def _args(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def _state(pid: int) -> str:
    """The process state letter from /proc/PID/stat ("Z": a zombie, dead but not reaped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@dataclass(frozen=True)
class StubProcess:
    """One python-backend stub of a server: `triton_python_backend_stub MODEL.py SHM_REGION ... INSTANCE ...`."""

    pid: int
    model: str  # the model directory's name (…/MODEL/1/model.py)
    instance: str  # Triton's instance name, e.g. dspark_0_0
    shm: str  # the shm region it was started with
    zombie: bool  # dead, not yet reaped by the server


def stubs(server_pid: int, model: str | None = None) -> list[StubProcess]:
    """The python-backend stubs of the server `server_pid` (processes of its group; only `model`'s if given)."""
    try:
        pgid = os.getpgid(server_pid)
    except ProcessLookupError:  # gone (and reaped): TritonServer's servers lead their own group
        pgid = server_pid
    out = []
    for pid in _group_pids(pgid):
        try:
            args, state = _args(pid), _state(pid)
        except OSError:
            continue
        if len(args) < 9 or not args[0].endswith("triton_python_backend_stub"):
            continue
        name = Path(args[1]).parent.parent.name
        if model is None or name == model:
            out.append(StubProcess(pid, name, args[8], args[2], state == "Z"))
    return sorted(out, key=lambda s: s.pid)


@dataclass(frozen=True)
class Footprint:
    """What one running tritonserver holds on this machine: its process group (server + python stubs), the shm
    regions they map, its shm region prefix (when it was started with one) and its run directory (when it is one
    of ours)."""

    pgid: int
    pids: tuple[int, ...]
    shm: tuple[str, ...]
    run_dir: Path | None
    shm_prefix: str | None = None


def _run_dir_of(pid: int) -> Path | None:
    """The dspark_triton_* directory holding the server's backend links or its log (stdout), if any."""
    places: list[Path] = []
    try:
        args = _args(pid)
        places += [Path(a.split("=", 1)[1]) for a in args if a.startswith("--backend-directory=")]
        places.append(Path(os.readlink(f"/proc/{pid}/fd/1")))
    except OSError:
        pass
    for p in places:
        for parent in (p, *p.parents):
            if parent.name.startswith(RUN_DIR_PREFIX):
                return parent
    return None


def footprint(pid: int) -> Footprint:
    """The footprint of the running server `pid` (it leads its own process group, as TritonServer starts it)."""
    pgid = os.getpgid(pid)
    pids = tuple(sorted(_group_pids(pgid)))
    return Footprint(pgid, pids, tuple(sorted(_mapped_shm(list(pids)))), _run_dir_of(pid), _shm_prefix_of(pid))


def _shm_prefix_of(pid: int) -> str | None:
    """The shm-region-prefix-name the server `pid` was started with, if one of ours (it starts with SHM_PREFIX)."""
    try:
        flags = [a[len(SHM_PREFIX_FLAG):] for a in _args(pid) if a.startswith(SHM_PREFIX_FLAG)]
    except OSError:
        return None
    return flags[-1] if flags and flags[-1].startswith(SHM_PREFIX) and flags[-1] != SHM_PREFIX else None


def find_server(grpc_port: int) -> int | None:
    """The pid of the tritonserver on this machine started with --grpc-port=grpc_port, if any."""
    flag = f"--grpc-port={grpc_port}"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and args[0].endswith("tritonserver") and flag in args:
            return int(entry.name)
    return None


def leftovers(fp: Footprint) -> list[str]:
    """What of a stopped server's footprint is still there: processes of its group, shm regions, run directory."""
    out = [f"process {pid} of the server's group is still running" for pid in _group_pids(fp.pgid)]
    names = {n for n in fp.shm if (Path("/dev/shm") / n).exists()}
    names |= shm_regions(fp.shm_prefix) if fp.shm_prefix else set()
    out += [f"/dev/shm/{name} is still there" for name in sorted(names)]
    if fp.run_dir is not None and fp.run_dir.exists():
        out.append(f"run directory {fp.run_dir} is still there")
    return out


@dataclass
class TritonServer:
    """A tritonserver on `repo`, ports chosen free when 0. Use as a context manager or start()/stop().

    Runs in its own process group so stop() can reach every stub; stop() is SIGTERM, then SIGKILL of the group
    after `stop_timeout` s, then removal of leftover shm regions this server had mapped or made.
    stop() and close() may come from another thread while start() waits for readiness (serve.supervisor restarts
    the server from its thread): start() then raises ServeError; after close() no start() begins.
    """

    repo: Path
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    host: str = "127.0.0.1"
    log_path: Path | None = None
    log_verbose: int = 0
    ready_timeout: float = 300.0
    stop_timeout: float = 20.0  # Triton drains for --exit-timeout-secs=10, then unloads (~2 s idle here)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    prefer_system: bool = True
    keep_logs: bool = False  # keep the run directory (and the server log in it) after stop()
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: Path | None = field(default=None, init=False, repr=False)
    _shm: set[str] = field(default_factory=set, init=False, repr=False)
    _shm_prefix: str | None = field(default=None, init=False, repr=False)  # this start's region prefix
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _started: subprocess.Popen | None = field(default=None, init=False, repr=False)  # the last start() that finished

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def footprint(self) -> Footprint:
        """Processes, shm regions and run directory of the running server (for leak checks after stop())."""
        if self._proc is None:
            raise ServeError("the server is not running")
        fp = footprint(self._proc.pid)
        return Footprint(fp.pgid, fp.pids, fp.shm, fp.run_dir or self._tmp, fp.shm_prefix or self._shm_prefix)

    @property
    def shm_prefix(self) -> str | None:
        """The prefix of every shm region this start of the server makes (None: the caller passed its own)."""
        return self._shm_prefix

    def exit_code(self) -> int | None:
        """The server's exit code if it has exited on its own, else None."""
        proc = self._proc
        return None if proc is None else proc.poll()

    def command(self, backend_dir: Path) -> list[str]:
        inst = find_triton(self.prefer_system)
        return [str(inst.binary), f"--model-repository={Path(self.repo).resolve()}",
                f"--backend-directory={backend_dir}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-gpu-metrics=false", "--allow-cpu-metrics=false", "--pinned-memory-pool-byte-size=0",
                "--disable-auto-complete-config", "--exit-timeout-secs=10", "--strict-readiness=true",
                f"--log-verbose={self.log_verbose}",
                *([f"{SHM_PREFIX_FLAG}{self._shm_prefix}"] if self._shm_prefix else []), *self.extra_args]

    def start(self) -> "TritonServer":
        if self._proc is not None:
            raise ServeError("This TritonServer is already started; stop() it first")
        repo = Path(self.repo)
        if not repo.is_dir():
            raise ServeError(f"Model repository {repo} does not exist: run `dspark-trt build` first "
                             "or pass --repo build/NAME/model_repo")
        inst = find_triton(self.prefer_system)
        own_prefix = not any(a.startswith(SHM_PREFIX_FLAG) for a in self.extra_args)
        self._shm_prefix = f"{SHM_PREFIX}{secrets.token_hex(6)}_" if own_prefix else None
        self._tmp = Path(tempfile.mkdtemp(prefix="dspark_triton_"))
        try:
            # bundled: a directory of symlinks to the wheel's pieces; system: its own (keeps e.g. tensorrtllm there)
            backend_dir = (inst.python_backend.parent if inst.system
                           else prepare_backend_dir(inst, self._tmp / "backends"))
            taken = {self.http_port, self.grpc_port, self.metrics_port} - {0}
            for name in ("http_port", "grpc_port", "metrics_port"):
                if getattr(self, name) == 0:  # free_port() may hand out the same port twice: keep them apart
                    port = free_port()
                    while port in taken:
                        port = free_port()
                    taken.add(port)
                    setattr(self, name, port)
            if self.log_path is None:
                self.log_path = self._tmp / "tritonserver.log"
            cmd = self.command(backend_dir)
            log.info("starting %s (log: %s)", " ".join(cmd), self.log_path)
            with self._lock, open(self.log_path, "ab") as out:
                if self._closed:
                    raise ServeError("this TritonServer was closed; it does not start again")
                if self._proc is not None:
                    raise ServeError("This TritonServer was started meanwhile (another thread); stop() it first")
                proc = self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, env=server_env(self.env),
                                                     start_new_session=True)
            self.wait_ready(proc)
        except BaseException as exc:  # a failed start names its log: keep it to read (not on Ctrl-C)
            self.stop(keep_logs=self.keep_logs or not isinstance(exc, KeyboardInterrupt))
            raise
        self._shm |= _mapped_shm(_group_pids(proc.pid))
        self._started = proc
        return self

    @property
    def started(self) -> bool:
        """True between a finished start() (the server was ready) and the next stop()."""
        proc = self._proc
        return proc is not None and proc is self._started

    def restart(self, grace: float | None = None) -> "TritonServer":
        """stop() (SIGKILL after `grace` s, default stop_timeout), then start() again on the same ports."""
        self.stop(timeout=grace)
        return self.start()

    def close(self) -> None:
        """stop() for good: a start() in progress in another thread is aborted, none begins after this."""
        with self._lock:
            self._closed = True
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, proc: subprocess.Popen | None = None) -> None:
        proc = proc or self._proc
        assert proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self._proc is not proc:
                raise ServeError("tritonserver was stopped before it was ready")
            if proc.poll() is not None:
                raise ServeError(f"tritonserver exited with code {proc.returncode} before it was ready; "
                                 f"its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if self.is_ready():
                log.info("tritonserver ready: http %s grpc %s metrics %s", self.http_url, self.grpc_url,
                         self.metrics_port)
                return
            time.sleep(0.25)
        raise ServeError(f"tritonserver not ready after {self.ready_timeout:.0f} s (a model failed to load?); "
                         f"log tail:\n{self.log_tail()}")

    def stop(self, keep_logs: bool | None = None, timeout: float | None = None) -> None:
        """SIGTERM, wait `timeout` s (default stop_timeout), SIGKILL the process group if needed; remove shm regions
        left by this server (mapped by it or with its prefix) and its run directory (kept, with the log in it, when
        keep_logs — default: the field — is true)."""
        with self._lock:
            self._stop(keep_logs, self.stop_timeout if timeout is None else timeout)

    def _stop(self, keep_logs: bool | None, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            pgid = proc.pid
            self._shm |= _mapped_shm(_group_pids(pgid))
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop within %.0f s; killing its process group", timeout)
                os.killpg(pgid, signal.SIGKILL)
                proc.wait()
            deadline = time.monotonic() + 10.0
            while _group_pids(pgid) and time.monotonic() < deadline:  # stubs exit right after the server
                time.sleep(0.1)
            stragglers = _group_pids(pgid)
            if stragglers:
                log.warning("killing %d leftover process(es) of the server: %s", len(stragglers), stragglers)
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + 5.0
                while _group_pids(pgid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        if self._shm_prefix:
            self._shm |= shm_regions(self._shm_prefix)  # a stub that died unseen, a server killed by SIGKILL
        for name in sorted(self._shm):
            path = Path("/dev/shm") / name
            if path.exists():
                log.warning("removing leftover shared memory region %s", path)
                path.unlink(missing_ok=True)
        self._shm.clear()
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            log_inside = self.log_path is not None and tmp in Path(self.log_path).parents
            shutil.rmtree(tmp / "backends", ignore_errors=True)
            if (self.keep_logs if keep_logs is None else keep_logs) and log_inside:
                log.info("tritonserver log kept at %s", self.log_path)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                if log_inside:
                    self.log_path = None  # it was in the run directory, now gone

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
