"""`dspark-trt` entry point: dispatches to subcommand modules in dspark_trt.commands.

Each subcommand lives in dspark_trt/commands/<name>.py and exposes
`add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args: argparse.Namespace) -> int`.
Modules are imported lazily so `dspark-trt --help` stays fast. Logs and progress go to stderr;
DsparkError is printed as one clear line (exit 2), never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from dspark_trt.errors import DsparkError

COMMANDS: dict[str, str] = {
    "generate": "Generate text with DSpark speculative decoding (in process, from a build, or via a Triton URL)",
    "build": "Validate, quantize (ModelOpt), export TRT-LLM checkpoints, build engines, write the Triton repo",
    "serve": "Start tritonserver on a built model repository",
    "load": "Soak / load check of a served build: N streaming clients for T s, answers checked, leak check",
    "openai": "OpenAI-compatible API (/v1/completions, /v1/chat/completions) in front of a running tritonserver",
    "bench": "Benchmarks: plain vs DSpark vs Hugging Face generate",
    "train-drafter": "Distill a DSpark block drafter from a target",
}


def _module(name: str):  # noqa: ANN202 - returns a module
    return importlib.import_module(f"dspark_trt.commands.{name.replace('-', '_')}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dspark-trt", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only import the module that runs
            _module(name).add_arguments(p)
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * args.verbose if args.verbose else logging.INFO
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(_module(args.command).run(args) or 0)
    except DsparkError as exc:
        logging.getLogger("dspark_trt").error("%s: %s", type(exc).__name__, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
