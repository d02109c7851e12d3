#!/usr/bin/env python3
"""Property-based fuzzing (hypothesis) of the served API against REAL servers: OpenAI request bodies (wrong types,
out-of-range numbers, unicode with lone surrogates and invalid UTF-8 bytes, empty and huge values, nested junk,
unparsable JSON) to /v1/completions and /v1/chat/completions, and Triton requests — gRPC input tensors of any
dtype, shape and range (empty ones too) to `ensemble`, `ensemble_stream`, `dspark`, `target`, `draft`, and
JSON bodies to the HTTP generate / infer endpoints. The properties, per request:

- no 5xx for bad input (OpenAI: HTTP status < 500 and the OpenAI error shape; Triton gRPC: no INTERNAL / UNKNOWN
  status and no "internal error" message from a model). Exception, counted apart: the 500s Triton 2.51's own HTTP
  JSON parser gives for bodies it cannot map onto tensors (TRITON_CORE_500), before any model sees them;
- no hang: every request finishes within REQUEST_TIMEOUT_S;
- the next good request is answered correctly: a greedy completion equal to the reference answer.

    .venv/bin/python scripts/fuzz_api.py --minutes 30                       # builds the tiny test pair, own servers
    .venv/bin/python scripts/fuzz_api.py --minutes 30 --repo build/default/model_repo
    .venv/bin/python scripts/fuzz_api.py --minutes 5 --openai-url http://127.0.0.1:9000/v1 --triton-grpc \\
        127.0.0.1:8001 --triton-http 127.0.0.1:8000                         # servers started elsewhere

It prints the requests by surface and status (e.g. `openai 400: 1234`) and every failure, and exits 1 if any
property failed. tests/serve/test_fuzz_api.py runs the same properties bounded (derandomized, ~60 s in all) in CI.
The strategies (what a fuzzed request is, the per-request `proposers` field among the fields) are in
scripts/fuzz_strategies.py; this file owns sending, checking and the command.
"""
from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fuzz_strategies beside this file, however it is loaded
from fuzz_strategies import (DTYPES, MODELS, VALID, chat_bodies, completion_bodies, encoded,  # noqa: E402
                             generate_bodies, infer_bodies, triton_requests)

log = logging.getLogger("fuzz_api")

REQUEST_TIMEOUT_S = 60.0  # a request (streamed or not) must be answered within this
GOOD_PROMPT, GOOD_TOKENS = "def main(argv):", 4
# Error messages of Triton 2.51's own HTTP frontend answering a body it cannot map onto tensors with HTTP 500, before
# any model runs (not ours to change; docs/serving.md "Limits"): counted apart, never a property failure.
TRITON_CORE_500 = ("failed to parse the request JSON buffer", "Unable to parse ", "attempt to ",
                   "failed to get request params", "Expected JSON object for keyword", "parameter key ",
                   "Converting keyword")
INTERNAL_MARKERS = ("internal error", "Stub process", "Traceback", "unexpected error")
SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
            HealthCheck.large_base_example]


# ---- running one request and checking it ---------------------------------------------------------------------
@dataclass
class Tally:
    """Requests by (surface, outcome) and the property failures seen."""

    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, surface: str, what: str, request: Any) -> None:
        text = f"{surface}: {what} — request {repr(request)[:300]}"
        log.error("%s", text)
        self.failures.append(text)

    def report(self) -> str:
        lines = [f"{k[0]} {k[1]}: {v}" for k, v in sorted(self.counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
        lines.append(f"requests: {sum(self.counts.values())}, property failures: {len(self.failures)}")
        return "\n".join(lines + [f"FAILED {f}" for f in self.failures[:20]])


@dataclass
class Targets:
    """Where the servers are, the served model id, and the reference answers of the good requests."""

    openai_url: str | None  # http://HOST:PORT/v1
    grpc_url: str | None  # HOST:PORT of Triton's gRPC
    http_url: str | None  # HOST:PORT of Triton's HTTP
    model: str = "tiny"
    good_text: str | None = None  # the OpenAI greedy completion of GOOD_PROMPT
    good_ids: list[int] | None = None  # Triton's greedy answer to GOOD_PROMPT
    api_key: str = "unused"


class Fuzzer:
    """Sends one fuzzed request, checks the properties, then (check_good) a good request."""

    def __init__(self, targets: Targets, tally: Tally) -> None:
        import requests  # noqa: PLC0415

        self.t, self.tally, self.http = targets, tally, requests.Session()

    # OpenAI
    def openai(self, path: str, body: bytes) -> None:
        import requests  # noqa: PLC0415

        url = f"{self.t.openai_url}/{path}"
        t0 = time.monotonic()
        try:
            with self.http.post(url, data=body, stream=True, timeout=(10, REQUEST_TIMEOUT_S),
                                headers={"Content-Type": "application/json",
                                         "Authorization": f"Bearer {self.t.api_key}"}) as r:
                chunks = []
                for chunk in r.iter_content(65536):
                    chunks.append(chunk)
                    if time.monotonic() - t0 > REQUEST_TIMEOUT_S:
                        raise TimeoutError(f"still streaming after {REQUEST_TIMEOUT_S:.0f} s")
                self._check_openai(r.status_code, r.headers.get("content-type", ""), b"".join(chunks), body)
        except (requests.RequestException, TimeoutError) as exc:
            self.tally.counts[("openai", "no answer")] += 1
            self.tally.fail("openai", f"no answer within {REQUEST_TIMEOUT_S:.0f} s ({type(exc).__name__}: {exc})",
                            body)

    def _check_openai(self, status: int, ctype: str, raw: bytes, request: bytes) -> None:
        self.tally.counts[("openai", status)] += 1
        if status >= 500:
            self.tally.fail("openai", f"HTTP {status}: {raw[:300]!r}", request)
            return
        if status != 200:
            err = json.loads(raw).get("error", {})
            if set(err) != {"message", "type", "param", "code"} or not err["message"]:
                self.tally.fail("openai", f"HTTP {status} without OpenAI's error shape: {raw[:300]!r}", request)
            return
        if "text/event-stream" not in ctype:
            json.loads(raw)["choices"][0]  # noqa: B018 - a completion, or KeyError/ValueError (a failure)
            return
        events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            self.tally.fail("openai", f"stream does not end with [DONE]: {raw[-200:]!r}", request)
        for ev in events[:-1]:
            err = json.loads(ev).get("error")
            if err is not None and err.get("type") == "server_error":
                self.tally.fail("openai", f"server error in the stream: {err}", request)

    def check_good_openai(self) -> None:
        import openai  # noqa: PLC0415

        client = openai.OpenAI(base_url=self.t.openai_url, api_key=self.t.api_key, max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        try:
            text = client.completions.create(model=self.t.model, prompt=GOOD_PROMPT, max_tokens=GOOD_TOKENS,
                                             temperature=0).choices[0].text
        except openai.OpenAIError as exc:
            self.tally.fail("openai good", f"{type(exc).__name__}: {exc}", GOOD_PROMPT)
            return
        finally:
            client.close()
        if text != self.t.good_text:
            self.tally.fail("openai good", f"{text!r} != reference {self.t.good_text!r}", GOOD_PROMPT)

    # Triton
    def triton_grpc(self, model: str, inputs: list[tuple[str, str, np.ndarray]]) -> None:
        import tritonclient.grpc as grpcclient  # noqa: PLC0415
        from tritonclient.utils import InferenceServerException  # noqa: PLC0415

        tensors = []
        for name, dt, arr in inputs:
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            tensors.append(t)
        client = grpcclient.InferenceServerClient(self.t.grpc_url)
        try:
            if model in ("ensemble_stream", "dspark"):
                outcome, message = _stream_outcome(client, model, tensors)
            else:
                try:
                    client.infer(model, tensors, client_timeout=REQUEST_TIMEOUT_S)
                    outcome, message = "ok", ""
                except InferenceServerException as exc:
                    outcome, message = str(exc.status() or "error"), exc.message() or ""
        finally:
            client.close()
        self.tally.counts[(f"grpc {model}", outcome)] += 1
        if outcome == "timeout" or any(s in outcome for s in ("INTERNAL", "UNKNOWN", "DEADLINE")) or any(
                m in message for m in INTERNAL_MARKERS):
            self.tally.fail(f"grpc {model}", f"{outcome}: {message[:300]}", [(n, d, a.shape) for n, d, a in inputs])

    def triton_http(self, path: str, body: bytes) -> None:
        import requests  # noqa: PLC0415

        try:
            r = self.http.post(f"http://{self.t.http_url}/{path}", data=body, timeout=(10, REQUEST_TIMEOUT_S))
        except requests.RequestException as exc:
            self.tally.counts[("http", "no answer")] += 1
            self.tally.fail("http", f"no answer ({type(exc).__name__}: {exc})", body)
            return
        text = r.text
        try:
            message = str(json.loads(text).get("error", ""))
        except (ValueError, AttributeError):
            message = ""
        core = r.status_code == 500 and message.startswith(TRITON_CORE_500)
        self.tally.counts[("http", f"{r.status_code}{' (triton core json)' if core else ''}")] += 1
        if r.status_code >= 500 and not core:
            self.tally.fail("http", f"HTTP {r.status_code}: {text[:300]}", body)

    def warm_up(self) -> None:
        """One good request to each one-pass model: `target` and `draft` load the build on their first request
        (serve.triton.one_pass), which on a loaded host can take longer than REQUEST_TIMEOUT_S."""
        import tritonclient.grpc as grpcclient  # noqa: PLC0415

        client = grpcclient.InferenceServerClient(self.t.grpc_url)
        try:
            for model in ("target", "draft"):
                tensors = []
                for name in MODELS[model]:
                    dt, data = VALID[name]
                    arr = np.array(data, dtype=DTYPES[dt])
                    t = grpcclient.InferInput(name, list(arr.shape), dt)
                    t.set_data_from_numpy(arr)
                    tensors.append(t)
                client.infer(model, tensors, client_timeout=600.0)
        finally:
            client.close()

    def check_good_triton(self) -> None:
        from dspark_trt.errors import DsparkError  # noqa: PLC0415
        from dspark_trt.serve.clients.client import generate_remote  # noqa: PLC0415

        try:
            ids = generate_remote(self.t.grpc_url, GOOD_PROMPT, max_tokens=GOOD_TOKENS, protocol="grpc",
                                  timeout=REQUEST_TIMEOUT_S)["token_ids"]
        except DsparkError as exc:
            self.tally.fail("triton good", f"{type(exc).__name__}: {exc}", GOOD_PROMPT)
            return
        if ids != self.t.good_ids:
            self.tally.fail("triton good", f"{ids} != reference {self.t.good_ids}", GOOD_PROMPT)


def _stream_outcome(client: Any, model: str, tensors: list[Any]) -> tuple[str, str]:
    """One request on a gRPC stream until its final response: ("ok" | "error" | "timeout" | a status, message)."""
    from tritonclient.utils import InferenceServerException  # noqa: PLC0415

    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    try:
        client.async_stream_infer(model, tensors, request_id="fuzz", enable_empty_final_response=True)
        while True:
            try:
                result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                return "timeout", f"no final response within {REQUEST_TIMEOUT_S:.0f} s"
            if error is not None:
                return "error", error.message() if hasattr(error, "message") else str(error)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return "ok", ""
    except InferenceServerException as exc:
        return str(exc.status() or "error"), exc.message() or ""
    finally:
        client.stop_stream(cancel_requests=True)


# ---- the properties as hypothesis tests ----------------------------------------------------------------------
def run_properties(fz: Fuzzer, surfaces: tuple[str, ...], max_examples: int, derandomize: bool,
                   good_every: int = 1) -> None:
    """Each surface's property over max_examples inputs (hypothesis: derandomized = the same inputs every run)."""
    cfg = settings(max_examples=max_examples, derandomize=derandomize, database=None, deadline=None,
                   suppress_health_check=SUPPRESS, phases=[Phase.explicit, Phase.generate], print_blob=False)
    seen = Counter()

    def after(kind: str) -> None:
        seen[kind] += 1
        if seen[kind] % good_every == 0:
            (fz.check_good_openai if kind == "openai" else fz.check_good_triton)()

    props: dict[str, Callable[[], None]] = {}

    @cfg
    @given(encoded(completion_bodies(fz.t.model)))
    def completions(body: bytes) -> None:
        fz.openai("completions", body)
        after("openai")

    @cfg
    @given(encoded(chat_bodies(fz.t.model)))
    def chat(body: bytes) -> None:
        fz.openai("chat/completions", body)
        after("openai")

    @cfg
    @given(triton_requests())
    def grpc(request: tuple[str, list[tuple[str, str, np.ndarray]]]) -> None:
        fz.triton_grpc(*request)
        after("triton")

    @cfg
    @given(st.one_of(st.tuples(st.sampled_from(["ensemble/generate", "ensemble_stream/generate_stream",
                                                "ensemble_stream/generate"]), encoded(generate_bodies())),
                     infer_bodies().map(lambda mb: (f"{mb[0]}/infer", json.dumps(mb[1]).encode()))))
    def http(request: tuple[str, bytes]) -> None:
        fz.triton_http(f"v2/models/{request[0]}", request[1])
        after("triton")

    props.update(completions=completions, chat=chat, grpc=grpc, http=http)
    for name in surfaces:
        props[name]()
    for kind in ("openai", "triton"):  # the last example was bad: the next good request still gets its answer
        if any(s in surfaces for s in (("completions", "chat") if kind == "openai" else ("grpc", "http"))):
            (fz.check_good_openai if kind == "openai" else fz.check_good_triton)()


def fuzz_for(fz: Fuzzer, minutes: float, surfaces: tuple[str, ...], batch: int = 50) -> None:
    """Rounds of `batch` random examples per surface (new random inputs each round) until `minutes` have passed."""
    deadline = time.monotonic() + 60 * minutes
    rounds = 0
    while time.monotonic() < deadline:
        run_properties(fz, surfaces, batch, derandomize=False, good_every=5)
        rounds += 1
        log.info("round %d: %d requests, %d failures", rounds, sum(fz.tally.counts.values()), len(fz.tally.failures))


# ---- the command ---------------------------------------------------------------------------------------------
def _tiny_repo(workdir: Path) -> Path:
    """`dspark-trt build` of the tiny test pair (as tests/serve/conftest.py builds it) → its model repository."""
    import subprocess  # noqa: PLC0415

    from dspark_trt.testing.tiny import default_tiny_root, make_tiny_pair  # noqa: PLC0415

    pair = make_tiny_pair(default_tiny_root())
    out = workdir / "tiny"
    cmd = [sys.executable, "-m", "dspark_trt.cli", "build", "--target", str(pair.target), "--draft", str(pair.draft),
           "--output", str(out), "--dtype", "float32", "--max-draft-len", "4", "--max-batch-size", "16",
           "--max-seq-len", "256", "--policy", "confidence", "--min-k", "1", "--no-bench", "--no-engines"]
    subprocess.run(cmd, check=True, capture_output=True)
    return out / "model_repo"


def references(fz: Fuzzer) -> None:
    """The good requests' answers before any fuzzing (greedy: every later answer must equal them)."""
    import openai  # noqa: PLC0415

    from dspark_trt.serve.clients.client import generate_remote  # noqa: PLC0415

    if fz.t.openai_url:
        client = openai.OpenAI(base_url=fz.t.openai_url, api_key=fz.t.api_key, max_retries=0, timeout=300)
        fz.t.model = client.models.list().data[0].id
        fz.t.good_text = client.completions.create(model=fz.t.model, prompt=GOOD_PROMPT, max_tokens=GOOD_TOKENS,
                                                   temperature=0).choices[0].text
    if fz.t.grpc_url:
        fz.warm_up()
        fz.t.good_ids = generate_remote(fz.t.grpc_url, GOOD_PROMPT, max_tokens=GOOD_TOKENS, protocol="grpc")["token_ids"]


def main(argv: list[str] | None = None) -> int:
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default 10)")
    p.add_argument("--repo", type=Path, default=None, help="model repository to serve (default: build the tiny pair)")
    p.add_argument("--openai-url", default=None, help="fuzz this running OpenAI frontend (http://HOST:PORT/v1)")
    p.add_argument("--triton-grpc", default=None, help="... and this running Triton's gRPC HOST:PORT")
    p.add_argument("--triton-http", default=None, help="... and its HTTP HOST:PORT")
    p.add_argument("--surfaces", nargs="+", default=["completions", "chat", "grpc", "http"],
                   choices=["completions", "chat", "grpc", "http"], help="what to fuzz (default: all)")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("dspark_trt.serve.openai.protocol", "httpx"):  # one line per fuzzed request otherwise
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from dspark_trt.serve.openai.config import OpenAIConfig  # noqa: PLC0415
    from dspark_trt.serve.openai.server import OpenAIServer  # noqa: PLC0415
    from dspark_trt.serve.server import TritonServer  # noqa: PLC0415

    own = args.openai_url is None and args.triton_grpc is None
    with tempfile.TemporaryDirectory(prefix="fuzz_api_") as tmp:
        server = frontend = None
        try:
            if own:
                repo = args.repo or _tiny_repo(Path(tmp))
                server = TritonServer(repo).start()
                frontend = OpenAIServer(OpenAIConfig(triton_url=server.grpc_url, port=0, repo=repo)).start()
                targets = Targets(frontend.url, server.grpc_url, server.http_url)
            else:
                targets = Targets(args.openai_url, args.triton_grpc, args.triton_http,
                                  api_key=os.environ.get("DSPARK_API_KEY", "unused"))
            surfaces = tuple(s for s in args.surfaces if (targets.openai_url if s in ("completions", "chat") else
                                                          targets.grpc_url if s == "grpc" else targets.http_url))
            fz = Fuzzer(targets, Tally())
            references(fz)
            log.info("fuzzing %s for %.1f min", ", ".join(surfaces), args.minutes)
            t0 = time.monotonic()
            fuzz_for(fz, args.minutes, surfaces)
            wall = time.monotonic() - t0
        finally:
            if frontend is not None:
                frontend.stop()
            if server is not None:
                server.stop()
    counts = {f"{k[0]} {k[1]}": v for k, v in sorted(fz.tally.counts.items(), key=lambda kv: str(kv[0]))}
    if args.json:
        print(json.dumps({"wall_s": round(wall, 1), "counts": counts, "failures": fz.tally.failures}))
    else:
        print(f"fuzzed {wall / 60:.1f} min\n{fz.tally.report()}")
    return 1 if fz.tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
