"""The native kernels' build cache survives a process killed mid-build: a stale torch baton (`lock` file) left in
the build directory must not make later processes wait forever (it once hung a whole CI run); and processes with
another `ninja` first on PATH (the system's, where a Triton stub has the venv's) reuse the build instead of
rebuilding it (two ninja versions took each other's outputs for stale: 1–2 min per process on 2 cores)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_trt.runtime import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels do not build on this machine "
                                f"({native.unavailable_reason()}); the torch path is tested everywhere")


def test_stale_build_lock_does_not_hang_a_new_process() -> None:
    lock = native.build_dir() / "lock"
    lock.write_text("")  # what a process killed while compiling leaves behind
    code = "from dspark_trt.runtime import native; assert native.available(), native.unavailable_reason()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not lock.exists()


def test_another_ninja_first_on_path_reuses_the_build(tmp_path: Path) -> None:
    so = next(native.build_dir().glob("*.so"))
    before = so.stat().st_mtime_ns
    marker = tmp_path / "decoy-ran"
    decoy = tmp_path / "bin" / "ninja"
    decoy.parent.mkdir()
    decoy.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\nexit 1\n")  # a ninja that must never be asked
    decoy.chmod(0o755)
    env = dict(os.environ, PATH=os.pathsep.join([str(decoy.parent), os.environ.get("PATH", "")]))
    code = "from dspark_trt.runtime import native; assert native.available(), native.unavailable_reason()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists(), "the build ran the first ninja on PATH, not the ninja package's"
    assert so.stat().st_mtime_ns == before, "the cached build was rebuilt"


def test_one_ninja_restores_path() -> None:
    old = os.environ.get("PATH", "")
    with native._one_ninja():
        import shutil

        import ninja

        assert Path(shutil.which("ninja") or "").parent == Path(ninja.BIN_DIR)
    assert os.environ.get("PATH", "") == old
