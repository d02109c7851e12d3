"""`dspark-trt load --faults`: faults injected into a served build under load, one after another, each measured.

It starts its own server on `--repo` (tritonserver with the repository API on, `--model-control-mode=explicit`,
so that a reload can be asked for) under serve.supervisor.Supervisor (what `dspark-trt serve` runs: a dead stub or
a server that exited is restarted on the same ports), streams every prompt alone first (the reference answers),
then for each fault: N clients stream back to back (a client that gets an error reopens its stream and goes on),
after `--fault-after` s the fault is injected, the clients keep going until an answer sent after the fault comes
back exact (recovery) or `--recovery-timeout` passes, then every prompt is answered alone again and compared with
its reference, and what the server held before the fault is checked for leftovers.

Faults (FAULTS): `stub-kill` — SIGKILL the `dspark` model's python-backend stub; `reload` — ask the repository
API to reload the `dspark` model with a changed config (a load of the unchanged model is a no-op in Triton 2.51);
`restart` — a planned restart (TritonServer.restart: SIGTERM, Triton drains for its exit timeout, SIGKILL after
stop_timeout, a new server on the same ports); `triton-kill` — SIGKILL tritonserver itself.

Per fault the report gives: requests in flight at the fault, how many of them ended in an error and how many
requests sent after it failed before recovery, the time to the first error, the time the last in-flight request
ended, hung requests (no response within `--fault-bound` s), the time to recovery, the supervisor's restarts,
whether every answer after recovery equals its reference, KV slots still held (`dspark_active_requests`) and the
leftovers of what the server held before the fault (serve.server.leftovers when it was replaced; else the killed
stub still running, shm regions of its prefix no process maps). Exit 1 on a wrong answer, a hang, no recovery, a
held KV slot or a leftover; the process / shm / run-directory checks are serve.server's (one place for them).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from dspark_trt.commands.load_client import Sample, StreamClient, load_prompts, make_jobs, reference_answers
from dspark_trt.errors import InvalidArgumentError, ServeError
from dspark_trt.serve.server import Footprint, TritonServer, _group_pids, _mapped_shm, leftovers, shm_regions, stubs
from dspark_trt.serve.supervisor import Supervisor

log = logging.getLogger("dspark_trt.load")

FAULTS = ("stub-kill", "reload", "restart", "triton-kill")
EXPLICIT = ("--model-control-mode=explicit", "--load-model=*")
MODEL = "dspark"
BACKOFF_S = 0.25  # a client's pause after an error before its next request
SETTLE_S = 15.0  # after recovering, the server must stay up this long: the reload crash of 2.51 comes seconds
# late, and the supervisor needs up to 3 × (2 + 2) s to call a deaf server a fault


def add_fault_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", nargs="?", const=",".join(FAULTS), default=None, metavar="LIST",
                   help=f"with --repo: inject faults under load, in this order (default all: {','.join(FAULTS)}); "
                        "see docs/serving.md, Faults")
    p.add_argument("--fault-after", type=float, default=2.0, help="with --faults: seconds of load before each fault")
    p.add_argument("--fault-bound", type=float, default=60.0,
                   help="with --faults: a request in flight must end (answer or error) within this many seconds of "
                        "the fault, else it counts as hung (default 60)")
    p.add_argument("--recovery-timeout", type=float, default=300.0,
                   help="with --faults: seconds to wait for an exact answer after each fault (default 300)")


def parse_faults(spec: str) -> list[str]:
    names = [f.strip() for f in spec.split(",") if f.strip()]
    bad = [f for f in names if f not in FAULTS]
    if bad or not names:
        raise InvalidArgumentError(f"--faults: unknown fault(s) {', '.join(bad) or '(none given)'}; choose from "
                                   f"{', '.join(FAULTS)}")
    return names


# ---- injecting ------------------------------------------------------------------------------------------------
def kill_stub(server: TritonServer, model: str = MODEL) -> dict[str, Any]:
    """SIGKILL `model`'s python-backend stub of the running server."""
    assert server.pid is not None
    live = [s for s in stubs(server.pid, model) if not s.zombie]
    if not live:
        raise ServeError(f"no live python stub of model {model!r} under tritonserver {server.pid}")
    os.kill(live[0].pid, signal.SIGKILL)
    return {"killed_pid": live[0].pid, "shm_region": live[0].shm}


def reload_model(server: TritonServer, model: str = MODEL, tag: str = "1") -> dict[str, Any]:
    """POST /v2/repository/models/MODEL/load with the model's config plus a parameter DSPARK_RELOAD=tag (an
    unchanged config is a no-op in Triton 2.51). Returns the HTTP status, or the error when the server went away."""
    base = f"http://{server.http_url}"
    try:
        with urllib.request.urlopen(f"{base}/v2/models/{model}/config", timeout=30) as r:
            cfg = json.loads(r.read().decode())
        cfg.setdefault("parameters", {})["DSPARK_RELOAD"] = {"string_value": tag}
        body = json.dumps({"parameters": {"config": json.dumps(cfg)}}).encode()
        req = urllib.request.Request(f"{base}/v2/repository/models/{model}/load", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=300) as r:
            return {"load_status": r.status}
    except urllib.error.HTTPError as exc:
        return {"load_status": exc.code, "load_error": exc.read().decode(errors="replace")[:300]}
    except OSError as exc:  # the server died under the request
        return {"load_error": f"{type(exc).__name__}: {exc}"}


def kill_triton(server: TritonServer) -> dict[str, Any]:
    assert server.pid is not None
    pid = server.pid
    os.kill(pid, signal.SIGKILL)
    return {"killed_pid": pid}


def _inject(name: str, server: TritonServer, sup: Supervisor, n: int) -> tuple[dict[str, Any], threading.Thread | None]:
    """Start fault `name`; slow ones (reload, restart) run in a thread the caller joins."""
    if name == "stub-kill":
        return kill_stub(server), None
    if name == "triton-kill":
        return kill_triton(server), None
    out: dict[str, Any] = {}
    fn: Callable[[], Any] = ((lambda: out.update(reload_model(server, tag=str(n)))) if name == "reload"
                             else (lambda: sup.restart("planned restart (fault `restart`)")))
    th = threading.Thread(target=fn, name=f"fault-{name}", daemon=True)
    th.start()
    return out, th


# ---- the load through a fault -----------------------------------------------------------------------------------
class FaultLoad:
    """`clients` threads streaming `jobs` back to back to `url` until stop(); after an error a client waits BACKOFF_S
    and goes on over a new stream. Every response waits at most `bound` s (then the request is a hang)."""

    def __init__(self, url: str, jobs: list[tuple[str, int]], clients: int, policy: str | None, bound: float) -> None:
        self.url, self.jobs, self.clients, self.policy, self.bound = url, jobs, clients, policy, bound
        self.samples: list[Sample] = []
        self._open: dict[int, Sample] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _worker(self, c: int) -> None:
        k, client = c, None
        while not self._stop.is_set():
            i = k % len(self.jobs)
            k += self.clients
            s = Sample(i)
            s.t_send = time.monotonic()
            with self._lock:
                self._open[c] = s
            try:
                client = client or StreamClient(self.url, self.bound)
                client.run(s, self.jobs[i][0], self.jobs[i][1], self.policy)
            except Exception as exc:  # noqa: BLE001 - a failed stream open is this request's error
                s.error, s.t_done = f"{type(exc).__name__}: {exc}", time.monotonic()
            with self._lock:
                self._open.pop(c, None)
                self.samples.append(s)
            if s.error is not None:
                if client is not None:
                    try:
                        client.close()
                    except Exception:  # noqa: BLE001 - the stream is broken anyway
                        pass
                client = None
                self._stop.wait(BACKOFF_S)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass

    def start(self) -> "FaultLoad":
        self._threads = [threading.Thread(target=self._worker, args=(c,), name=f"fault-load-{c}", daemon=True)
                         for c in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def in_flight(self) -> int:
        with self._lock:
            return len(self._open)

    def recovered(self, t_fault: float, refs: list[list[int]]) -> Sample | None:
        """The first answer sent after the fault that came back exact, if any yet."""
        with self._lock:
            done = [s for s in self.samples if s.t_send >= t_fault and s.error is None and s.ids == refs[s.prompt]]
        return min(done, key=lambda s: s.t_done) if done else None

    def stop(self) -> list[Sample]:
        self._stop.set()
        for t in self._threads:
            t.join(self.bound + 10)
        with self._lock:
            return list(self.samples) + list(self._open.values())


# ---- one phase ----------------------------------------------------------------------------------------------------
def active_requests(metrics_url: str) -> float | None:
    """dspark_active_requests from the server's metrics (None: unreachable or not exported)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    vals = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("dspark_active_requests")]
    return sum(vals) if vals else None


def stale(before: Footprint, server: TritonServer, detail: dict[str, Any]) -> list[str]:
    """What is left of the server as it was before the fault: all of it (leftovers) when it was replaced or
    stopped; else the killed stub if it still runs, and shm regions of its prefix that no process of it maps."""
    if server.pid is None or server.pid != before.pgid:  # our servers lead their process group
        return leftovers(before)
    out = []
    pid = detail.get("killed_pid")
    if pid and os.path.exists(f"/proc/{pid}"):
        out.append(f"the killed process {pid} is still there")
    if before.shm_prefix:
        orphans = shm_regions(before.shm_prefix) - _mapped_shm(_group_pids(before.pgid))
        out += [f"/dev/shm/{n} is mapped by no process of the server" for n in sorted(orphans)]
    return out


def run_phase(name: str, n: int, server: TritonServer, sup: Supervisor, jobs: list[tuple[str, int]],
              refs: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    _wait_settled(server, sup, args.recovery_timeout)
    url = server.grpc_url
    before = server.footprint()
    restarts0 = len(sup.restarts)
    load = FaultLoad(url, jobs, args.clients, args.policy, args.fault_bound).start()
    time.sleep(args.fault_after)
    in_flight = load.in_flight()
    t_fault = time.monotonic()
    log.info("fault %s: injecting with %d requests in flight", name, in_flight)
    detail, th = _inject(name, server, sup, n)
    first_ok = _wait_recovered(load, server, sup, th, t_fault, refs, args)
    samples = load.stop()
    rep = summarize_phase(samples, t_fault, refs, args.fault_bound)
    rep.update(fault=name, detail=detail, in_flight=in_flight,
               recovered_s=None if first_ok is None else round(first_ok.t_done - t_fault, 2),
               restarts=[{"fault": r.fault, "ready_after_s": None if r.ready_after_s is None
                          else round(r.ready_after_s, 2)} for r in sup.restarts[restarts0:]])
    rep["exact_after"] = _exact_now(server, jobs, refs, args) if first_ok is not None else False
    _wait_settled(server, sup, args.recovery_timeout)
    time.sleep(0.5)  # the active gauge is flushed between rounds
    rep["kv_slots_held"] = active_requests(server.metrics_url) if server.started else None
    rep["leftovers"] = stale(before, server, detail)
    rep["ok"] = bool(rep["exact_after"] and not rep["wrong"] and not rep["hung"] and not rep["leftovers"]
                     and rep["recovered_s"] is not None and not rep["kv_slots_held"])
    log.info("fault %s: %s", name, json.dumps(rep))
    return rep


def _wait_settled(server: TritonServer, sup: Supervisor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (sup.busy or not server.started) and time.monotonic() < deadline:
        if sup.failed:
            raise ServeError(f"the server is down: {sup.failed}")
        time.sleep(0.2)
    if not server.started:
        raise ServeError(f"the server did not come back within {timeout:.0f} s")


def _wait_recovered(load: FaultLoad, server: TritonServer, sup: Supervisor, th: threading.Thread | None,
                    t_fault: float, refs: list[list[int]], args: argparse.Namespace) -> Sample | None:
    """The first exact answer sent after the fault (or after the last restart it caused) that SETTLE_S then
    followed without another restart; None if none came within --recovery-timeout."""
    deadline = t_fault + args.recovery_timeout
    mark, seen, first_ok, settle_until = t_fault, len(sup.restarts), None, 0.0
    while time.monotonic() < deadline and not sup.failed:
        time.sleep(0.2)
        if len(sup.restarts) != seen or sup.busy:  # (again) down: recovery counts from the restart on
            seen, first_ok = len(sup.restarts), None
            mark = sup.restarts[-1].t_detected if sup.restarts else mark
            continue
        if first_ok is None:
            first_ok = load.recovered(mark, refs) if server.started else None
            settle_until = time.monotonic() + SETTLE_S
        elif time.monotonic() >= settle_until and (th is None or not th.is_alive()):
            return first_ok
    return None


def _exact_now(server: TritonServer, jobs: list[tuple[str, int]], refs: list[list[int]],
               args: argparse.Namespace) -> bool:
    try:
        return reference_answers(server.grpc_url, jobs, args.policy, args.fault_bound) == refs
    except ServeError as exc:
        log.warning("answers after recovery failed: %s", exc)
        return False


def summarize_phase(samples: list[Sample], t_fault: float, refs: list[list[int]], bound: float) -> dict[str, Any]:
    """Counts and times (s after the fault) of one phase's requests."""
    flying = [s for s in samples if s.t_send < t_fault and (s.t_done == 0.0 or s.t_done >= t_fault)]
    after = [s for s in samples if s.t_send >= t_fault]
    errs = [s for s in samples if s.error is not None and s.t_done >= t_fault]
    hung = [s for s in flying if s.t_done == 0.0 or (s.error or "").startswith("no response within")]
    wrong = [s for s in samples if s.error is None and s.t_done > 0 and s.ids != refs[s.prompt]]
    r = lambda v: None if v is None else round(v, 2)  # noqa: E731
    return {"requests": len(samples), "in_flight_errors": sum(s.error is not None for s in flying),
            "in_flight_answered": sum(s.error is None and s.t_done > 0 for s in flying),
            "errors_after": sum(s.error is not None for s in after), "wrong": len(wrong), "hung": len(hung),
            "first_error_s": r(min((s.t_done - t_fault for s in errs), default=None)),
            "in_flight_ended_s": r(max((s.t_done - t_fault for s in flying if s.t_done), default=None)),
            "bound_s": bound, "first_errors": sorted({(s.error or "")[:160] for s in errs})[:4]}


# ---- the command --------------------------------------------------------------------------------------------------
def _report(rep: dict[str, Any]) -> str:
    lines = [f"faults on {rep['target']}: {rep['clients']} streaming clients, bound {rep['bound_s']} s",
             "| fault | in flight | in-flight errors / answered | errors after | first error s | in flight ended s "
             "| hung | recovered s | restarts | exact after | KV held | leftovers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in rep["phases"]:
        if "error" in p:
            lines.append(f"| {p['fault']} | FAILED: {p['error']} |")
            continue
        lines.append(f"| {p['fault']} | {p['in_flight']} | {p['in_flight_errors']} / {p['in_flight_answered']} | "
                     f"{p['errors_after']} | {p['first_error_s']} | {p['in_flight_ended_s']} | {p['hung']} | "
                     f"{p['recovered_s']} | {len(p['restarts'])} | {p['exact_after']} | {p['kv_slots_held']} | "
                     f"{len(p['leftovers'])} |")
    for p in (p for p in rep["phases"] if "error" not in p):
        lines += [f"{p['fault']}: {k} {v}" for k, v in p["detail"].items()]
        lines += [f"{p['fault']}: error: {e}" for e in p["first_errors"]]
        lines += [f"{p['fault']}: leftover: {x}" for x in p["leftovers"]]
    lines += [f"after stop: leftover: {x}" for x in rep["leftovers"]]
    lines.append("result: " + ("ok" if rep["ok"] else "FAILED"))
    return "\n".join(lines) + "\n"


def run_faults(args: argparse.Namespace) -> int:
    if not args.repo:
        raise InvalidArgumentError("--faults needs --repo: it starts, breaks and restarts its own server")
    if not 0 < args.fault_bound <= 3600 or args.fault_after < 0 or args.recovery_timeout <= 0:
        raise InvalidArgumentError("--fault-bound must be in (0, 3600], --fault-after ≥ 0, --recovery-timeout > 0")
    names = parse_faults(args.faults)
    jobs = make_jobs(load_prompts(args.prompts), args.max_tokens)
    env = dict(os.environ, DSPARK_THREADS=str(args.threads)) if args.threads else None
    server = TritonServer(args.repo, env=env, extra_args=EXPLICIT)

    def on_sigterm(signum: int, frame: object) -> None:  # run the finally below: stop the server, clean up
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_sigterm)
    phases: list[dict[str, Any]] = []
    final: list[str] = []
    sup: Supervisor | None = None
    try:
        server.start()
        sup = Supervisor(server, action="restart").start()
        refs = reference_answers(server.grpc_url, jobs, args.policy, args.fault_bound)
        for n, name in enumerate(names, 1):
            try:
                phases.append(run_phase(name, n, server, sup, jobs, refs, args))
            except ServeError as exc:  # the server did not come back: report what is known, stop here
                phases.append({"fault": name, "ok": False, "error": str(exc)})
                break
    finally:
        fp = server.footprint() if server.started else None
        if sup is not None:
            sup.close()
        else:
            server.close()
        signal.signal(signal.SIGTERM, old)
        if fp is not None:
            final = leftovers(fp)
    rep = {"target": str(args.repo), "clients": args.clients, "bound_s": args.fault_bound, "phases": phases,
           "leftovers": final}
    rep["ok"] = all(p["ok"] for p in phases) and not final
    sys.stdout.write(json.dumps(rep) + "\n" if args.json else _report(rep))
    return 0 if rep["ok"] else 1
