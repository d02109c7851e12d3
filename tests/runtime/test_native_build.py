"""The native kernels' build cache survives a process killed mid-build: a stale torch baton (`lock` file) left in
the build directory must not make later processes wait forever (it once hung a whole CI run); and processes with
another `ninja` first on PATH (the system's, where a Triton stub has the venv's) reuse the build instead of
rebuilding it (two ninja versions took each other's outputs for stale: 1–2 min per process on 2 cores) — a venv
that borrows this one's packages through a .pth (its ninja.BIN_DIR empty) included."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
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


def test_a_venv_borrowing_these_packages_reuses_the_build(tmp_path: Path) -> None:
    """The wheel's test venv (tests/test_packaging.py) and users' venvs that see another's site-packages: `ninja`
    imports there, but its BIN_DIR (the venv's own bin) holds no binary, so the system's ninja used to run and
    rebuild the cache directory the next process of this venv rebuilt again (~75 s each on a 2-core Zen 3)."""
    so = next(native.build_dir().glob("*.so"))
    before = so.stat().st_mtime_ns
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "_borrowed.pth").write_text("".join(f"{d}\n" for d in deps))
    marker = tmp_path / "decoy-ran"
    decoy = tmp_path / "bin" / "ninja"  # stands for the system's ninja, first on PATH after the venv's bin
    decoy.parent.mkdir()
    decoy.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\nexit 1\n")
    decoy.chmod(0o755)
    root = Path(native.__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root),
               PATH=os.pathsep.join([str(venv / "bin"), str(decoy.parent), os.environ.get("PATH", "")]))
    code = ("import ninja; from dspark_trt.runtime import native; assert native.available(), "
            "native.unavailable_reason(); print(repr(ninja.BIN_DIR), native._ninja_dir(), native.build_dir())")
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    bin_dir, ninja_dir, build = done.stdout.split()
    assert bin_dir == "''", f"the borrowing venv's ninja.BIN_DIR is {bin_dir}: this test no longer covers the case"
    assert ninja_dir == native._ninja_dir() and build == str(native.build_dir())
    assert not marker.exists(), "the build ran the first ninja on PATH, not the ninja package's"
    assert so.stat().st_mtime_ns == before, "the cached build was rebuilt"
