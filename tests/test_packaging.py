"""The wheel works on its own: build it, install it into a fresh venv (no repository on sys.path), then run
`dspark-trt build`, `dspark-trt generate --build-dir` and `dspark-trt serve` (a real tritonserver, called through
tritonclient from the same venv) on the tiny pair from a directory outside the repository.

The fresh venv borrows the dependencies (torch, transformers, ...) of the interpreter running the tests through a
.pth file that names its site-packages directory. A path line in a .pth file is only appended to sys.path: the .pth
files inside that directory are not processed, so an editable install of dspark_trt there stays invisible and
`import dspark_trt` must come from the wheel.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_MODELS = ("draft", "dspark", "dspark_sync", "ensemble", "ensemble_stream", "preprocessing", "target")


def _source_files() -> list[str]:
    """Files of the working tree that a clean clone would have (tracked + untracked, minus ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                             capture_output=True, timeout=60).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "build", "__pycache__", ".pytest_cache", ".hypothesis"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("packaging")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    # 1. a wheel from a copy of the sources (setuptools writes build/ and *.egg-info next to them)
    src = tmp / "src"
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
         cwd=tmp, env=env)
    (wheel,) = dist.glob("dspark_trt-*.whl")
    # 2. a fresh venv that sees the dependencies of this interpreter, not its dspark_trt
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp,
                     env=env).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_dspark_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    # 3. the wheel, installed by this interpreter's pip into the fresh venv
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=tmp, env=env)
    work = tmp / "work"
    work.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {"wheel": wheel, "venv": venv, "py": py, "site": site, "work": work, "env": env}  # type: ignore[dict-item]


def test_wheel_holds_the_package_and_its_data_only(installed) -> None:  # noqa: ANN001
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert {n.split("/")[0] for n in names} == {"dspark_trt", "dspark_trt-0.1.0.dist-info"}  # no top-level plugins
    for model in TEMPLATE_MODELS:
        assert f"dspark_trt/model_repo/{model}/config.pbtxt" in names
    assert "dspark_trt/model_repo/ensemble/1/README" in names
    assert "dspark_trt/model_repo/dspark/1/model.py" in names
    assert "dspark_trt/kernels/fused_accept/kernel.py" in names
    from dspark_trt.runtime import native  # every engine's kernel sources, so an installed wheel builds them all

    for build in native.BUILDS.values():
        for f in build.sources + build.headers:
            assert f"dspark_trt/runtime/native/{f}" in names, f"{f} ({build.name} engine) is not in the wheel"
    assert "dspark_trt/assets/dspark-smollm2-135m/model.safetensors" in names
    assert "dspark_trt/assets/calib/calib.txt" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_import_resolves_inside_the_fresh_venv(installed) -> None:  # noqa: ANN001
    out = _run([str(installed["py"]), "-c",
                "import json, dspark_trt, dspark_trt.kernels\n"
                "from dspark_trt.builder.model_repo import TEMPLATE_DIR\n"
                "import importlib.util as u\n"
                "print(json.dumps([dspark_trt.__file__, dspark_trt.kernels.__file__, str(TEMPLATE_DIR),"
                " u.find_spec('plugins') is None]))"],
               cwd=installed["work"], env=installed["env"]).stdout
    pkg, kernels, templates, no_plugins = json.loads(out.strip().splitlines()[-1])
    site = installed["site"].resolve()
    assert Path(pkg).resolve().is_relative_to(site), pkg
    assert Path(kernels).resolve().is_relative_to(site), kernels
    assert Path(templates).resolve() == site / "dspark_trt" / "model_repo"
    assert no_plugins
    assert not (site / "plugins").exists()


def test_build_and_generate_from_the_wheel(installed, tiny_pair) -> None:  # noqa: ANN001
    env, work = installed["env"], installed["work"]
    cli = str(installed["venv"] / "bin" / "dspark-trt")
    out = work / "build" / "tiny"
    _run([cli, "build", "--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "--dtype", "float32",
          "--output", str(out), "--calib-samples", "4", "--calib-seq-len", "64", "--eval-tokens", "128",
          "--max-seq-len", "256", "--max-draft-len", "4", "--no-bench", "--no-engines"], cwd=work, env=env)
    repo = out / "model_repo"
    for model in TEMPLATE_MODELS:
        text = (repo / model / "config.pbtxt").read_text()
        assert "${" not in text, model
    assert str(out.resolve()) in (repo / "dspark" / "config.pbtxt").read_text()  # BUILD_DIR filled
    assert (repo / "dspark" / "1" / "model.py").is_file()
    assert not list(repo.rglob("__pycache__"))  # pip byte-compiled the templates; the build skips the caches
    res = _run([cli, "generate", "--build-dir", str(out), "--prompt", "class A:", "--max-new-tokens", "12",
                "--policy", "fixed", "--k", "3", "--json"], cwd=work, env=env)
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["token_ids"] and isinstance(data["text"], str)
    assert data["stats"]["drafted_tokens"] > 0
    assert "deprecated" not in res.stderr
    served = _serve_and_request(cli, repo, installed, "class A:", 12)
    assert served["token_ids"] == data["token_ids"]  # greedy: the served answer is the in-process one
    assert Path(served["dspark_trt"]).resolve().is_relative_to(installed["site"].resolve())


def _serve_and_request(cli: str, repo: Path, installed: dict, prompt: str, n: int) -> dict:
    """`dspark-trt serve` from the wheel's venv, then one streamed gRPC request through tritonclient from that venv."""
    env, work = installed["env"], installed["work"]
    proc = subprocess.Popen([cli, "serve", "--repo", str(repo), "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0"], cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until READY (or EOF if the command failed)
        assert line.startswith("READY"), f"`dspark-trt serve` from the wheel did not become ready (exit {proc.wait()})"
        grpc = dict(kv.split("=", 1) for kv in line.split()[1:])["grpc"]
        code = ("import json, dspark_trt\n"
                "from dspark_trt.serve.clients.client import generate_remote\n"
                f"out = generate_remote({grpc!r}, {prompt!r}, max_tokens={n}, protocol='grpc', stream=True,"
                " policy='fixed', max_k=3)\n"
                "print(json.dumps({'token_ids': out['token_ids'], 'dspark_trt': dspark_trt.__file__}))")
        res = _run([str(installed["py"]), "-c", code], cwd=work, env=env)
        return json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
