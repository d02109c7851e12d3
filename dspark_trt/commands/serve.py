"""`dspark-trt serve`: start tritonserver (the system one when present, else the nvidia-pytriton bundle) on a
built model repository, wait until it is ready, keep it running until SIGINT/SIGTERM, then stop it cleanly
(no stub processes, no /dev/shm regions left). Lifecycle lives in dspark_trt.serve.server. With --openai-port,
the OpenAI-compatible API (dspark_trt.serve.openai) runs next to it, in this process, on the server's gRPC port.
While it runs, serve.supervisor.Supervisor watches it (--on-fault): a python stub that died, a tritonserver that
exited or crashed → restart on the same ports (default), or stop and exit with an error ("exit"), or nothing
("off": a tritonserver that exits still ends the command).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from dspark_trt.errors import ServeError

log = logging.getLogger(__name__)

DEFAULT_REPO = Path("build/default/model_repo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPO,
                        help="model repository written by `dspark-trt build` (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port, 0 = any free (default: %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port, 0 = any free (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=8002,
                        help="Prometheus metrics port, 0 = any free (default: %(default)s)")
    parser.add_argument("--log-file", type=Path, default=None,
                        help="tritonserver log (default: in the server's run directory, removed at stop unless "
                             "--keep-logs)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the server's run directory (dspark_triton_* in the temp dir, with its log) at stop")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--bundled", action="store_true",
                        help="use the nvidia-pytriton bundled tritonserver even if one is on PATH")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--threads", default=None, metavar="N|auto",
                        help="torch threads of the dspark model (default: $DSPARK_THREADS, else auto = the fastest "
                             "of 1 / half / all CPUs, measured at startup)")
    parser.add_argument("--on-fault", choices=("restart", "exit", "off"), default="restart",
                        help="when a python stub dies or tritonserver exits or crashes: restart it on the same ports "
                             "(default), stop it and exit with an error, or do nothing (docs/serving.md, Faults)")
    parser.add_argument("--openai-port", type=int, default=None,
                        help="also serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions) on this "
                             "port, 0 = any free (default: off)")
    from dspark_trt.commands.openai import add_frontend_arguments  # noqa: PLC0415

    add_frontend_arguments(parser, with_triton=False)


def run(args: argparse.Namespace) -> int:
    from dspark_trt.serve.server import TritonServer  # noqa: PLC0415
    from dspark_trt.serve.supervisor import Supervisor  # noqa: PLC0415

    repo = Path(args.repo)
    if not (repo / "ensemble" / "config.pbtxt").exists():
        raise ServeError(f"{repo} is not a built model repository (no ensemble/config.pbtxt); run "
                         "`dspark-trt build --output build/NAME` and pass --repo build/NAME/model_repo")
    stop = threading.Event()
    ready = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; stopping tritonserver", signal.Signals(signum).name)
        stop.set()
        if not ready.is_set():
            raise KeyboardInterrupt  # abort the readiness wait; start() stops what it began

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    frontend = None
    supervisor = None
    env = None
    if args.threads is not None:
        from dspark_trt.serve.tuning import THREADS_ENV, parse_threads  # noqa: PLC0415

        parse_threads(args.threads)  # a bad value fails here, not in the stub
        env = dict(os.environ, **{THREADS_ENV: str(args.threads)})
    server = TritonServer(repo, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          host=args.host, log_path=args.log_file, log_verbose=args.log_verbose,
                          ready_timeout=args.ready_timeout, prefer_system=not args.bundled,
                          keep_logs=args.keep_logs, env=env)
    try:
        server.start()
        if args.on_fault != "off":
            supervisor = Supervisor(server, action=args.on_fault).start()
        openai = ""
        if args.openai_port is not None:
            from dspark_trt.commands.openai import config_from_args  # noqa: PLC0415
            from dspark_trt.serve.openai.server import OpenAIServer  # noqa: PLC0415

            frontend = OpenAIServer(config_from_args(args, triton_url=server.grpc_url, repo=repo, host=args.host,
                                                     port=args.openai_port)).start()
            openai = f" openai={frontend.url}"
        ready.set()
        log.info("serving %s — HTTP %s (/v2/models/ensemble/infer|generate, "
                 "/v2/models/ensemble_stream/generate_stream), gRPC %s (ensemble: infer; ensemble_stream: "
                 "stream_infer), metrics %s%s; Ctrl-C to stop", repo, server.http_url, server.grpc_url, server.metrics_url,
                 f", OpenAI API {frontend.url}" if frontend is not None else "")
        sys.stdout.write(f"READY http={server.http_url} grpc={server.grpc_url} metrics={server.metrics_url}{openai}\n")
        sys.stdout.flush()
        while not stop.wait(1.0):
            if supervisor is not None:
                if supervisor.failed:
                    raise ServeError(f"tritonserver stopped: {supervisor.failed}")
                continue
            code = server.exit_code()
            if code is not None:
                raise ServeError(f"tritonserver exited unexpectedly (code {code}); log tail:\n{server.log_tail()}")
    except KeyboardInterrupt:
        log.info("interrupted before the server was ready")
        return 130
    finally:
        if frontend is not None:
            frontend.stop()
        if supervisor is not None:
            supervisor.close()
        else:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    log.info("tritonserver stopped")
    return 0
