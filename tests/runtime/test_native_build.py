"""The native kernels' build cache survives a process killed mid-build: a stale torch baton (`lock` file) left in
the build directory must not make later processes wait forever (it once hung a whole CI run)."""
from __future__ import annotations

import subprocess
import sys

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
